"""Streaming vs shards: trainer tokens/s on the same data and machine, the stream's wait fraction, and its
peak scratch and RSS as the dataset grows (``train.target_features: stream``); with ``--faults``, what a
fault costs a stream run instead.

A tiny Qwen3 target, synthetic token shards, their hf feature shards; then, each in a fresh process:
``shards`` (train from the feature shards) and ``stream`` (train against ``--servers`` hf feature servers,
``python -m dflash_pipeline.features serve``, or one vLLM CPU server with ``--vllm``), at 1x and 10x the base
record count. Prints one table and the ratios: stream/shards tokens/s, 10x/1x peak RSS and peak scratch.

``--faults`` (hf servers only): an uninterrupted stream run (the reference), then one run per fault on the
same data and settings: a feature server SIGKILLed mid-epoch (two servers, the run finishes on the
survivor), a server that hangs (``serve --hang-after N``: accepts feature requests and never answers; the
fleet's ``request_timeout_s`` fails them), and the trainer SIGKILLed after a state save and rerun (it
resumes from ``state/``). Each fault row: ran (the fault happened mid-run and the run finished), lost
(records the reference trained that the fault run never trained), duplicated (record trainings beyond the
reference's count) and whether ``final/model.safetensors`` equals the reference's tensor for tensor. Records
are counted from the batch traces (``train.trace_batches``; the bench's child also writes each batch's
records, by content, next to the trainer's ``trace/rank0.jsonl``), the last trace of each step only: a
killed trainer may have traced a step it never finished, and its rerun trains that step again. The
reference and the three fault runs run at once (each its own out dir; the healthy server ``a`` serves all).

    python bench/bench_stream.py --smoke            # seconds: 1x only, 40 records
    python bench/bench_stream.py --records 400 --servers 2
    python bench/bench_stream.py --vllm             # a vLLM CPU server ($DFLASH_VLLM_PYTHON)
    python bench/bench_stream.py --smoke --faults   # ~1 min: 80 records of <= 64 tokens

``python bench/bench_stream.py --faults --records 200`` on the 2-core box while the test suite ran (load
average 4-6; the four runs at once, 68 s in all): 200 records x <= 256 tokens, hidden 128, 50 steps, 197
record trainings, a state saved every 8 steps::

    fault                      ran  lost  duplicated  final weights  detail
    server SIGKILLed mid-epoch yes  0     0           equal          killed after step 12/50, 2 request(s) retried
    server hangs               yes  0     0           equal          3 request(s) hung, 3 retried after 5 s
    trainer SIGKILLed, rerun   yes  0     0           equal          killed after step 12 (state at 8), rerun resumed at 8/50

(measured with a 5 s ``request_timeout_s`` for the hang run; :data:`HANG_FLEET` now gives 10 s, a margin so that
a healthy server slowed by a loaded box is never timed out with the hung one).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LAYERS = [1, 2]
TRAIN = {
    "num_processes": 1,
    "epochs": 1,
    "batch_size": 4,
    "learning_rate": 1e-3,
    "num_anchors": 16,
    "mixed_precision": "no",
    "seed": 0,
    "save_every_steps": 10**6,
    "log_every_steps": 5,
}
#: Fleet knobs of the fault runs: a dead server is taken out at its first failure and re-probed at once.
FLEET = {
    "request_timeout_s": 120,
    "max_retries": 6,
    "endpoint_max_failures": 1,
    "endpoint_reprobe_s": 0.05,
    "retry_backoff_s": 0.01,
    "retry_backoff_max_s": 0.05,
    "circuit_breaker_failures": 3,
}
#: The hang run's: a hung request fails after ``request_timeout_s`` and the hung server stays out.
HANG_FLEET = {**FLEET, "request_timeout_s": 10, "endpoint_reprobe_s": 600}
#: Feature requests the hanging server answers before it hangs.
HANG_AFTER = 3
#: Seconds a fault run (or the wait for a server) may take before the bench gives up.
TIMEOUT_S = 900


def make_data(
    root: Path, records: int, seq: int, hidden: int, features: bool = True
) -> tuple[Path, list[Path], list[Path], dict]:
    """The target (once), a token shard of ``records`` synthetic records of ``seq // 2`` to ``seq`` tokens,
    and (``features``) its hf feature shard; returns ``(target, [tokens], [features], probe)``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_pipeline.core.contracts import TOKEN_SCHEMA
    from dflash_pipeline.core.shards import table_from_records, write_parquet
    from dflash_pipeline.features.extract import extract_shard

    target = root / "target"
    if not target.is_dir():
        torch.manual_seed(0)
        Qwen3ForCausalLM(
            Qwen3Config(
                vocab_size=512,
                hidden_size=hidden,
                intermediate_size=2 * hidden,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=hidden // 4,
                max_position_embeddings=4096,
                tie_word_embeddings=False,
            )
        ).save_pretrained(target)
    rng = np.random.default_rng(records)
    recs = []
    for i in range(records):
        n = int(rng.integers(seq // 2, seq))
        ids = rng.integers(0, 500, n).tolist()
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        recs.append(
            {
                "prompt_id": f"p{i}",
                "input_ids": ids,
                "loss_mask": mask,
                "num_tokens": n,
                "num_loss_tokens": sum(mask),
                "truncated": False,
                "turn": 0,
            }
        )
    tok = root / f"tokens-{records}.parquet"
    write_parquet(tok, table_from_records(recs, TOKEN_SCHEMA))
    feats = root / f"features-{records}.safetensors"
    if features:
        extract_shard(
            tok,
            feats,
            target_dir=target,
            target_layer_ids=LAYERS,
            hidden_size=hidden,
            num_hidden_layers=4,
            backend="hf",
        )
    probe = {
        "hidden_size": hidden,
        "num_hidden_layers": 4,
        "tie_word_embeddings": False,
        "drafter": {
            "block_size": 4,
            "num_draft_layers": 1,
            "target_layer_ids": LAYERS,
            "mask_token_id": 511,
        },
    }
    return target, [tok], [feats], probe


def _trace_records() -> None:
    """Wrap the trainer's batch trace (``train.trace_batches``) so that it also appends ``{step, records}``
    to ``trace/records<rank>.jsonl``: a digest of each row's token ids (padding dropped; rows are records
    when packing is off), for counting records lost or trained twice."""
    from dflash_pipeline.train import loop

    real = loop.trace_batch

    def trace_batch(out_dir: Path, rank: int, step: int, batch: dict) -> None:
        real(out_dir, rank, step, batch)
        ids, am = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
        recs = [hashlib.sha1(ids[i][am[i]].numpy().tobytes()).hexdigest()[:16] for i in range(len(ids))]
        with open(Path(out_dir) / "trace" / f"records{rank}.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, "records": recs}) + "\n")

    loop.trace_batch = trace_batch


def child(spec_path: str) -> None:
    """One training run (``--child SPEC``): prints a JSON line with tokens/s, wait fraction, peak RSS/scratch
    and the stream's request and retry counts."""
    from dflash_pipeline.train import train

    spec = json.loads(Path(spec_path).read_text())
    cfg = dict(TRAIN, target_features=spec["mode"], **spec.get("cfg", {}))
    if cfg.get("trace_batches"):
        _trace_records()
    s = train(
        token_shards=spec["tokens"],
        feature_shards=spec["features"] if spec["mode"] == "shards" else (),
        probe=spec["probe"],
        target_dir=spec["target"],
        out_dir=spec["out"],
        cfg=cfg,
        stream=spec.get("stream"),
    )
    log = [json.loads(x) for x in (Path(spec["out"]) / "train_log.jsonl").read_text().splitlines()]
    tps = [r["tokens_per_s"] for r in log[1:]] or [log[0]["tokens_per_s"]]  # the first window pays the warm-up
    st = s.get("stream") or {}
    print(
        "RESULT "
        + json.dumps(
            {
                "tokens_per_s": float(np.median(tps)),
                "wait_fraction": st.get("wait_fraction"),
                "peak_scratch_bytes": st.get("peak_scratch_bytes"),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "steps": s["steps"],
                "requests": st.get("requests"),
                "retries": st.get("retries"),
            }
        ),
        flush=True,
    )


def start_servers(target: Path, root: Path, n: int, vllm: bool, hidden: int) -> tuple[list, list[dict]]:
    """``n`` hf feature servers (or one vLLM CPU server) on ``target``: ``(processes, endpoints)``."""
    from dflash_pipeline.features.colocate import start_servers as start

    probe = {
        "drafter": {"target_layer_ids": LAYERS},
        "num_hidden_layers": 4,
        "hidden_size": hidden,
    }
    stream = {
        "servers": n,
        "backend": "vllm" if vllm else "hf",
        "scratch_dir": str(root / "scratch"),
        "max_len": 1024,
        "vllm": {
            "python": os.environ.get("DFLASH_VLLM_PYTHON", str(REPO / ".venv-vllm/bin/python")),
            "engine_args": {},
        },
    }
    return start(stream, probe=probe, target=str(target), timeout_s=1800)


def launch(mode: str, root: Path, target, tokens, feats, probe, stream=None, *, name=None, cfg=None):
    """Start one training run in a fresh process (:func:`child`, its own session; output appended to
    ``<out>.log``); returns ``(process, out dir, log path)``."""
    out = root / (name or f"run-{mode}-{tokens[0].stem}")
    spec = root / f"{out.name}.json"
    spec.write_text(
        json.dumps(
            {
                "mode": mode,
                "tokens": list(map(str, tokens)),
                "features": list(map(str, feats)),
                "probe": probe,
                "target": str(target),
                "out": str(out),
                "stream": stream,
                "cfg": cfg or {},
            }
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    log = root / f"{out.name}.log"
    with open(log, "ab") as fh:  # a file, not a pipe: a parent that polls never blocks the child's output
        proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(spec)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return proc, out, log


def result(proc: subprocess.Popen, log: Path, what: str, timeout_s: float = TIMEOUT_S) -> dict:
    """Wait for a :func:`launch` ed run and return its ``RESULT`` dict; RuntimeError (with the log's tail)
    when it failed or printed none."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text(errors="replace")
    line = next((x for x in reversed(text.splitlines()) if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{what} run failed ({proc.returncode}):\n{text[-4000:]}")
    return json.loads(line[7:])


def run(mode: str, root: Path, target, tokens, feats, probe, stream=None) -> dict:
    """One training run in a fresh process, to its end: its ``RESULT`` dict."""
    proc, _, log = launch(mode, root, target, tokens, feats, probe, stream)
    return result(proc, log, mode)


# ---------------------------------------------------------------------------------------------------
# --faults
# ---------------------------------------------------------------------------------------------------


def fault_servers(target: Path, root: Path, hidden: int) -> dict[str, tuple[subprocess.Popen, str]]:
    """Three hf feature servers started together, each in its own session: ``a`` (every fault run's),
    ``b`` (SIGKILLed by the first fault) and ``hang`` (``--hang-after`` :data:`HANG_AFTER`); returns
    ``{name: (process, base URL)}`` once each wrote its URL file (RuntimeError if one exits first)."""
    from dflash_pipeline.features.colocate import hf_server_cmd, stop

    probe = {"drafter": {"target_layer_ids": LAYERS}, "num_hidden_layers": 4, "hidden_size": hidden}
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    started = {}
    for name, extra in (("a", []), ("b", []), ("hang", ["--hang-after", str(HANG_AFTER)])):
        scratch = root / "scratch" / name
        scratch.mkdir(parents=True, exist_ok=True)
        url_file = root / "scratch" / f"{name}.url"
        cmd = hf_server_cmd(
            sys.executable,
            target=str(target),
            probe=probe,
            stream={},
            scratch=scratch,
            url_file=url_file,
            gpus=0,
            target_dtype="auto",
            trust_remote_code=False,
        )
        with open(root / "scratch" / f"{name}.log", "wb") as fh:
            proc = subprocess.Popen(cmd + extra, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        started[name] = (proc, url_file)
    urls, deadline = {}, time.monotonic() + TIMEOUT_S
    while len(urls) < len(started):
        for name, (proc, url_file) in started.items():
            if name not in urls and url_file.is_file():
                urls[name] = url_file.read_text().strip()
            elif name not in urls and (proc.poll() is not None or time.monotonic() > deadline):
                stop([p for p, _ in started.values()])
                log = (root / "scratch" / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"feature server {name} not ready ({proc.returncode}):\n{log}")
        time.sleep(0.2)  # polling the URL files (no event to wait on across processes)
    return {name: (proc, urls[name]) for name, (proc, _) in started.items()}


def _last_step(path: Path) -> int:
    """``step`` of the last complete JSON line of ``path`` (``train_log.jsonl``, ``state/step.json``); 0 when
    there is none (yet)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue  # a line still being written
    return 0


def watch(proc: subprocess.Popen, out: Path, until, timeout_s: float = TIMEOUT_S) -> bool:
    """Poll the run in ``out`` every 10 ms until ``until(last logged step, last saved step)`` holds (True)
    or the run exits (False); TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if until(_last_step(out / "train_log.jsonl"), _last_step(out / "state" / "step.json")):
            return True
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise TimeoutError(f"{out.name}: the awaited step did not come in {timeout_s:.0f} s")
        time.sleep(0.01)  # polling: the trainer offers no event across processes
    return False


def trained(out: Path) -> Counter:
    """The records a run trained (record digest -> times), from ``trace/records0.jsonl``: the last traced
    batch of each step only (one micro-batch per step), since a killed run may have traced a step it never
    finished, and its rerun trains that step again (a line cut by the kill is joined to the next one: the
    next ``{"step"`` starts the rerun's)."""
    by_step = {}
    for line in (out / "trace" / "records0.jsonl").read_text().splitlines():
        t = json.loads(line[line.rfind('{"step"') :])
        by_step[t["step"]] = t["records"]
    return Counter(r for recs in by_step.values() for r in recs)


def compare(ref: Path, out: Path) -> tuple[int, int, bool]:
    """``(lost, duplicated, final weights equal)`` of the run in ``out`` against the reference run in ``ref``:
    record trainings of the reference missing from the run, trainings beyond the reference's count, and
    whether every tensor of ``final/model.safetensors`` is ``torch.equal`` to the reference's."""
    import torch
    from safetensors.torch import load_file

    a, b = trained(ref), trained(out)
    wa, wb = (load_file(d / "final" / "model.safetensors") for d in (ref, out))
    equal = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return sum((a - b).values()), sum((b - a).values()), equal


def _health(url: str) -> dict:
    """The hf server's ``GET /health`` (its request and hung counts)."""
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as r:
        return json.loads(r.read())


class Faults:
    """The fault runs of one bench: same data, train settings and stream client; each in a fresh process."""

    def __init__(self, root: Path, target: Path, tokens: list[Path], probe: dict, servers: dict):
        self.root, self.target, self.tokens, self.probe, self.servers = root, target, tokens, probe, servers
        self.steps = max(1, sum(_count(t) for t in tokens) // TRAIN["batch_size"])  # about: 2 % are held out
        self.cfg = {"log_every_steps": 1, "trace_batches": True, "save_every_steps": max(2, self.steps // 6)}
        self.ref = root / "reference"

    def launch(self, name: str, servers: list[str], fleet: dict = FLEET):
        """Start run ``name`` against the named servers: ``(process, out dir, log)``."""
        stream = {
            "endpoints": [{"base_url": self.servers[s][1]} for s in servers],
            "scratch_dir": str(self.root / "scratch"),
            "fleet": fleet,
        }
        return launch("stream", self.root, self.target, self.tokens, [], self.probe, stream, name=name, cfg=self.cfg)

    def reference(self) -> dict:
        """The uninterrupted stream run every fault run is compared with."""
        proc, _, log = self.launch("reference", ["a"])
        return result(proc, log, "reference")

    def server_killed(self) -> dict:
        """Two servers; ``b`` is SIGKILLed once a quarter of the steps are logged."""
        proc, out, log = self.launch("fault-server-kill", ["a", "b"])
        b = self.servers["b"][0]
        hit = watch(proc, out, lambda logged, saved: logged >= max(1, self.steps // 4))
        at = _last_step(out / "train_log.jsonl")
        if hit:
            os.killpg(b.pid, signal.SIGKILL)
            b.wait()
        r = result(proc, log, "server-kill")
        ran = hit and b.returncode == -signal.SIGKILL and at < r["steps"]
        detail = f"killed after step {at}/{r['steps']}, {r['retries']} request(s) retried"
        return {"fault": "server SIGKILLed mid-epoch", "ran": ran, "out": out, "detail": detail}

    def server_hangs(self) -> dict:
        """Two servers; ``hang`` answers its first :data:`HANG_AFTER` feature requests, then hangs."""
        proc, out, log = self.launch("fault-hang", ["a", "hang"], HANG_FLEET)
        r = result(proc, log, "hang")
        h = _health(self.servers["hang"][1])
        detail = f"{h['hung']} request(s) hung, {r['retries']} retried after {HANG_FLEET['request_timeout_s']} s"
        return {"fault": "server hangs", "ran": h["hung"] >= 1, "out": out, "detail": detail}

    def trainer_killed(self) -> dict:
        """The trainer SIGKILLed a few steps after a state save, then rerun (it resumes from ``state/``)."""
        half = max(1, self.cfg["save_every_steps"] // 2)
        proc, out, log = self.launch("fault-trainer-kill", ["a"])
        hit = watch(proc, out, lambda logged, saved: saved > 0 and logged >= saved + half)
        if hit:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        at, saved, mark = _last_step(out / "train_log.jsonl"), _last_step(out / "state" / "step.json"), 0
        if hit:
            mark = log.stat().st_size
            proc, out, log = self.launch("fault-trainer-kill", ["a"])
        result(proc, log, "trainer-kill rerun")
        rerun = log.read_text(errors="replace")[mark:]
        resumed = next((ln.split()[-1] for ln in rerun.splitlines() if ln.startswith("[train] resumed from ")), "-")
        ran = hit and resumed != "-" and int(resumed.split("/")[0]) > 0
        detail = f"killed after step {at} (state at {saved}), rerun resumed at {resumed}"
        return {"fault": "trainer SIGKILLed, rerun", "ran": ran, "out": out, "detail": detail}


def _count(tokens: Path) -> int:
    """Records in a token shard."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(tokens).metadata.num_rows


def run_faults(a) -> int:
    """``--faults``: the reference and the three fault runs; prints the fault table."""
    from dflash_pipeline.features.colocate import stop

    if a.smoke:
        a.records, a.seq = 80, 64
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-stream-faults-") as tmp:
        root = Path(tmp)
        target, tokens, _, probe = make_data(root, a.records, a.seq, a.hidden, features=False)
        servers = fault_servers(target, root, a.hidden)
        try:
            f = Faults(root, target, tokens, probe, servers)
            with ThreadPoolExecutor(4) as ex:  # the runs are independent: the reference and the faults at once
                runs = [ex.submit(m) for m in (f.reference, f.server_killed, f.server_hangs, f.trainer_killed)]
                ref, *rows = [r.result() for r in runs]
            for r in rows:
                r["lost"], r["duplicated"], r["equal"] = compare(f.ref, r["out"])
            reference_records = sum(trained(f.ref).values())
        finally:
            stop([p for p, _ in servers.values()], grace_s=5)
    print(
        f"\nfaults against an uninterrupted stream run: {a.records} records x <= {a.seq} tokens, hidden "
        f"{a.hidden}, {ref['steps']} steps, {reference_records} record trainings; save every "
        f"{f.cfg['save_every_steps']} steps; {time.monotonic() - t0:.0f} s"
    )
    print(f"{'fault':27}{'ran':5}{'lost':6}{'duplicated':12}{'final weights':15}detail")
    for r in rows:
        print(
            f"{r['fault']:27}{'yes' if r['ran'] else 'no':5}{r['lost']:<6}{r['duplicated']:<12}"
            f"{'equal' if r['equal'] else 'DIFFERENT':15}{r['detail']}"
        )
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200, help="base record count (1x)")
    p.add_argument("--seq", type=int, default=256, help="longest record (tokens)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--vllm", action="store_true", help="one vLLM CPU server instead of hf servers")
    p.add_argument(
        "--smoke", action="store_true", help="tiny: 40 records of <= 64 tokens, 1x only (--faults: 80 records)"
    )
    p.add_argument("--faults", action="store_true", help="the fault table instead (hf servers; see above)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.child)
        return 0
    if a.faults:
        return run_faults(a)
    if a.smoke:
        a.records, a.seq = 40, 64
    scales = (1,) if a.smoke else (1, 10)
    from dflash_pipeline.features.colocate import stop

    with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
        root = Path(tmp)
        rows = {}
        data = {s: make_data(root, a.records * s, a.seq, a.hidden) for s in scales}
        target = data[1][0]
        procs, eps = start_servers(target, root, 1 if a.vllm else a.servers, a.vllm, a.hidden)
        try:
            for s in scales:
                _, tokens, feats, probe = data[s]
                rows[("shards", s)] = run("shards", root, target, tokens, feats, probe)
                rows[("stream", s)] = run(
                    "stream",
                    root,
                    target,
                    tokens,
                    feats,
                    probe,
                    {"endpoints": eps, "scratch_dir": str(root / "scratch")},
                )
        finally:
            stop(procs)
    server = "1 vLLM CPU server" if a.vllm else f"{a.servers} hf server(s)"
    print(f"\nstream vs shards, {a.records} records x <= {a.seq} tokens (1x), hidden {a.hidden}, {server}")
    print(f"{'mode':8} {'scale':>5} {'tokens/s':>10} {'wait':>6} {'peak RSS MB':>12} {'peak scratch B':>15}")
    for (mode, s), r in rows.items():
        wait = f"{100 * r['wait_fraction']:.0f}%" if r["wait_fraction"] is not None else "-"
        print(
            f"{mode:8} {s:>4}x {r['tokens_per_s']:>10.0f} {wait:>6} {r['peak_rss_mb']:>12.0f} "
            f"{r['peak_scratch_bytes'] if r['peak_scratch_bytes'] is not None else '-':>15}"
        )
    for s in scales:
        ratio = rows[("stream", s)]["tokens_per_s"] / rows[("shards", s)]["tokens_per_s"]
        print(f"ratio stream/shards tokens/s at {s}x: {ratio:.2f}")
    if 10 in scales:
        st1, st10 = rows[("stream", 1)], rows[("stream", 10)]
        print(
            f"ratio 10x/1x stream peak RSS: {st10['peak_rss_mb'] / st1['peak_rss_mb']:.2f}; peak scratch: "
            f"{st10['peak_scratch_bytes'] / max(1, st1['peak_scratch_bytes']):.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
