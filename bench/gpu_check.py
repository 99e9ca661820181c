"""The GPU check (``bench/gpu_check.sh`` runs it): every part in its own process under a time limit, one table.

Parts, in the order they run (the ones whose figures matter most first; ``--skip PART`` leaves one out, with the
reason in the table):

- ``steps``: a Qwen3-8B-sized and a Kimi-K2.6-width drafter step (bf16 autocast, flex attention on CUDA; tiny
  sdpa steps on CPU): tokens/s, MFU and peak memory against the memory plan's prediction
  (:mod:`dflash_pipeline.train.memory`).
- ``workflow``: the demo target through the whole workflow under Snakemake on a reduced config
  (``bench/gpu_check_workflow.yaml``; ``train.device: auto``, bf16 mixed precision on a GPU), its τ per eval set;
  ``--workflow-workdir DIR`` reuses a workdir (a finished one costs a dry run).
- ``zoo``: the model zoo's stages (twin build, probe, completions, tokens, fp32 and bf16 training, eval τ) on
  several families (``--family``; one process per family; bf16 training and eval on the GPU with
  ``--device cuda``/``auto``).
- ``stream``: an hf feature server (``python -m dflash_pipeline.features serve``, on the GPU) and a training run
  fed by it (``train.target_features: stream``).
- ``fsdp``: one FSDP2 rank (``fully_shard`` per draft layer, nccl on CUDA, gloo on CPU): three optimizer steps
  with AdamW and with Muon, the loss against the unsharded drafter's.

A part over its limit is killed with every process it started; its row says how far it got (the last progress
line it printed). ``--logs DIR`` keeps each part's output as ``DIR/<part>.log``.

    python bench/gpu_check.py --device cuda            # the H200 (bench/gpu_check.sh)
    python bench/gpu_check.py --device cpu --skip workflow   # tiny sizes, the suite's smoke run

Checks that need vLLM or SGLang: ``bench/gpu_check_engines.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("steps", "workflow", "zoo", "stream", "fsdp")
#: Seconds per part on a GPU (docs/explanation/gpu-check.md gives the estimate behind each). 460 s together.
LIMITS = {"steps": 140, "workflow": 160, "zoo": 80, "stream": 55, "fsdp": 25}
#: The whole check's bound on a GPU (s): a part gets what is left of it when that is less than its own limit, so
#: the check ends within 8 minutes (one device command may take 10) whatever the parts do.
BUDGET = 460
#: CPU limits are these times the GPU ones (the suite's 2 loaded cores: tiny sizes, but no accelerator).
CPU_SCALE = 2.0
#: The workflow part's config: the demo target and the demo's drafter on a reduced data set and eval.
WORKFLOW_CONFIG = REPO / "bench" / "gpu_check_workflow.yaml"
#: Dense bf16 peak of one H200 (NVIDIA data sheet, SXM: 989.5 TFLOP/s without sparsity), for MFU.
H200_BF16_FLOPS = 989.5e12
ZOO_FAMILIES = ("Qwen3.5-35B-A3B", "gpt-oss-20b", "Kimi-K2.5")
#: A part's progress lines (the driver echoes them and quotes the last when the part runs out of time) and its row.
PARTIAL, ROW = "[gpu-check:partial] ", "[gpu-check:row] "


def _partial(text: str) -> None:
    """Report how far a part got (the row of a part killed at its limit quotes the last such line)."""
    print(PARTIAL + text.replace("\n", " "), file=sys.stderr, flush=True)


def _kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """End the process group `proc` leads (started with ``start_new_session``), so a part's Snakemake jobs, servers
    and zoo processes end with it (`core.procs.end_process_group`)."""
    from dflash_pipeline.core.procs import end_process_group

    end_process_group(proc, grace)


def _models_dir(given: str | None) -> Path | None:
    """The model-config corpus: ``--models``, ``$DFLASH_MODELS_DIR``, ``bench/gpu_carry/models`` (what
    ``bench/gpu_prepare.sh`` carries), ``../shared/data/models``; None when none exists."""
    for cand in (
        given,
        os.environ.get("DFLASH_MODELS_DIR"),
        REPO / "bench/gpu_carry/models",
        REPO / "../shared/data/models",
    ):
        if cand and Path(cand).is_dir():
            return Path(cand).resolve()
    return None


def _device(spec: str) -> str:
    import torch

    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    return spec


# ---------------------------------------------------------------------------------------------------
# Parts (each runs in its own process: python bench/gpu_check.py --part NAME ...; prints one JSON row last)
# ---------------------------------------------------------------------------------------------------


def _zoo_progress(err: str, fam: str) -> str:
    """How far the zoo got with `fam`: the last stage it finished, from its ``[zoo] <family> <stage>: ok`` lines."""
    done = re.findall(rf"^\[zoo\] {re.escape(fam)} (\w+): ok", err, re.M)
    return f"{done[-1]} done" if done else "building its twin"


def part_zoo(a) -> dict:
    models = _models_dir(a.models)
    if models is None:
        return {
            "status": "skipped",
            "figures": "no model configs (--models, $DFLASH_MODELS_DIR or bench/gpu_carry/models)",
        }
    fams = a.family or (ZOO_FAMILIES if a.device == "cuda" else ZOO_FAMILIES[:1])
    base = [sys.executable, "-m", "dflash_pipeline.testing.zoo", "--table", "--no-engine", "--models", str(models)]
    base += ["--device", "auto" if a.device == "cuda" else "cpu"]
    # one process per family, side by side: each is mostly CPU work (tokenizer, twin, Python) on small GPU kernels
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // len(fams)))}
    logs = Path(tempfile.mkdtemp(prefix="gpu-check-zoo-"))
    procs = {}
    for f in fams:
        out, err = open(logs / f"{f}.out", "w"), open(logs / f"{f}.err", "w")
        procs[f] = subprocess.Popen(base + ["--family", f], cwd=REPO, stdout=out, stderr=err, env=env)
        out.close()
        err.close()
    t0, deadline, finished = time.time(), time.time() + max(a.limit - 5, 5), {}
    while len(finished) < len(fams) and time.time() < deadline:
        for f, proc in procs.items():
            if f not in finished and proc.poll() is not None:
                finished[f] = time.time() - t0
                _partial("; ".join(f"{g} finished in {s:.0f} s" for g, s in finished.items()))
        time.sleep(0.5)
    cells, notes = {}, []
    for f, proc in procs.items():
        err = (logs / f"{f}.err").read_text(errors="replace")
        if f not in finished:
            proc.kill()
            proc.wait()
            notes.append(f"{f}: not finished in {a.limit - 5:.0f} s ({_zoo_progress(err, f)})")
            continue
        rows = [x for x in (logs / f"{f}.out").read_text().splitlines() if x.startswith(f"| {f} |")]
        if rows:
            cells[f] = [c.strip() for c in rows[-1].split("|")[2:-1]]
        if proc.returncode or not rows:
            notes.append(f"{f}: exit {proc.returncode}: {err.strip().splitlines()[-1:]}")
    bad = {f: c for f, c in cells.items() if any(x != "ok" for x in c)}
    for f in fams:  # the part's log (--logs) keeps the zoo's own log of a family that failed
        if f in bad or f not in cells or any(n.startswith(f"{f}:") for n in notes):
            print(f"--- {f}\n" + (logs / f"{f}.err").read_text(errors="replace")[-20000:])
    ok = len(cells) == len(fams) and not bad and not notes
    figures = f"{len(cells) - len(bad)}/{len(fams)} families through build..eval ({', '.join(fams)})"
    if finished:
        figures += (
            (" side by side" if len(fams) > 1 else "") + " in " + ", ".join(f"{s:.0f}" for s in finished.values())
        )
        figures += " s"
    if bad:
        figures += "; " + "; ".join(f"{f}: {next(x for x in c if x != 'ok')}" for f, c in bad.items())
    if notes:
        figures += "; " + "; ".join(notes)
    return {"status": "ok" if ok else "FAIL", "figures": figures}


def _snakemake_progress(log: Path, t0: float) -> str:
    """``k of n steps done, running: rule, rule (s)`` from a Snakemake log."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    done = re.findall(r"^(\d+) of (\d+) steps \(\S+\) done", text, re.M)
    started = re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):", text, re.M)
    finished_ids = set(re.findall(r"^Finished jobid: (\d+)", text, re.M))
    job_rules = re.findall(r"^(?:local)?(?:rule|checkpoint) (\w+):\n(?:    .*\n)*?    jobid: (\d+)", text, re.M)
    running = [r for r, j in job_rules if j not in finished_ids] or started[-1:]
    where = f"{done[-1][0]} of {done[-1][1]} steps done" if done else "0 steps done"
    return f"{where} after {time.time() - t0:.0f} s" + (f", running: {', '.join(running)}" if running else "")


def _job_seconds(work: Path, top: int = 3) -> str:
    """The `top` longest jobs of a finished run, from their ``benchmark:`` files (``rule N s``)."""
    secs = []
    for tsv in (work / "results" / "benchmarks").rglob("*.tsv"):
        lines = tsv.read_text().splitlines()
        if len(lines) >= 2:
            row = dict(zip(lines[0].split("\t"), lines[1].split("\t")))
            rule = tsv.relative_to(work / "results" / "benchmarks").with_suffix("").parts[0]  # RULE.tsv, RULE/...
            secs.append((float(row.get("s", 0) or 0), rule))
    return ", ".join(f"{rule} {s:.0f} s" for s, rule in sorted(secs, reverse=True)[:top])


def part_workflow(a) -> dict:
    try:
        import snakemake  # noqa: F401
    except ImportError:
        return {"status": "FAIL", "figures": "snakemake is not installed (bench/gpu_prepare.sh carries its wheels)"}
    import yaml

    work = Path(a.workflow_workdir) if a.workflow_workdir else Path(tempfile.mkdtemp(prefix="gpu-check-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    mp = "bf16" if a.device == "cuda" else "no"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work)]
    cmd += ["--configfile", str(WORKFLOW_CONFIG), "--profile"]
    cmd += [str(REPO / "profiles/local"), "--cores", str(os.cpu_count() or 2), "--scheduler", "greedy"]
    cmd += ["--config", f"train={{device: auto, mixed_precision: {mp}}}"]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # shell jobs' `python` is this one
    log = work / "gpu-check-snakemake.log"
    t0, budget, shown = time.time(), max(a.limit - 10, 10), ""
    with open(log, "w") as fh:  # its own process group: killed with its jobs at the part's limit
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    signal.signal(signal.SIGTERM, lambda *_: (_kill_group(proc, grace=2), sys.exit(143)))  # the driver's kill
    while proc.poll() is None:
        progress = _snakemake_progress(log, t0)
        if re.sub(r" after \d+ s", "", progress) != re.sub(r" after \d+ s", "", shown):  # a step done or begun
            _partial(progress)
            shown = progress
        if time.time() - t0 > budget:
            _kill_group(proc)
            print(log.read_text(errors="replace")[-20000:])  # the part's log (--logs) keeps where it stood
            jobs = _job_seconds(work)
            return {
                "status": "FAIL",
                "figures": f"not finished in {budget:.0f} s: {progress}" + (f"; done: {jobs}" if jobs else ""),
            }
        time.sleep(1)
    out = log.read_text(errors="replace")
    if proc.returncode:
        print(out[-20000:])  # the part's log (--logs) keeps Snakemake's account of the failure
        tail = " ".join(out.strip().splitlines()[-3:])[:300]
        return {"status": "FAIL", "figures": f"snakemake exit {proc.returncode}: {tail}"}
    run = yaml.safe_load(WORKFLOW_CONFIG.read_text())["run"]
    acc = json.loads((work / "results" / "eval" / run / "acceptance.json").read_text())
    summary = json.loads((work / "results" / "checkpoints" / run / "train_summary.json").read_text())
    tau = acc["tau"]["trained"]
    floor = acc["tau"].get("untrained", {})
    plan = re.search(r"\[plan\] device memory[^:]*: ([^(\n]+)", out)
    # a drafter trained on the GPU drafts: on average above the untrained floor (τ 1 when it never drafts right)
    ok = not floor or sum(tau.values()) / len(tau) > sum(floor.values()) / len(floor)
    figures = (
        f"{os.path.relpath(WORKFLOW_CONFIG, REPO)} ({summary['records']} records, {summary['steps']} steps) in "
        f"{time.time() - t0:.0f} s; trained on {summary['provenance']['device']} ({summary['attention_backend']}, "
        f"{summary['provenance']['dtype']}), eval on {acc['settings']['device']} {acc['settings']['dtype']}; τ "
        + ", ".join(f"{name} {t:.2f}" for name, t in tau.items())
        + (f" (untrained {min(floor.values()):.2f}-{max(floor.values()):.2f})" if floor else "")
        + (f"; plan {plan.group(1).strip()}" if plan else "")
        + f"; longest jobs: {_job_seconds(work)}"
        + ("" if ok else "; the trained drafter is not above the untrained floor")
    )
    return {"status": "ok" if ok else "FAIL", "figures": figures, "tau": tau}


def _tiny_target(root: Path):
    """The tests' counting target and token shard (tests/conftest.py), built under ``root``."""
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import counting_train_setup

    return counting_train_setup(root, min_len=20, max_position_embeddings=128, unsupervised_record=5)


def part_stream(a) -> dict:
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import FAST_FLEET, FeatureServer

    from dflash_pipeline.train.run import train

    root = Path(tempfile.mkdtemp(prefix="gpu-check-stream-"))
    root, probe = _tiny_target(root)
    probe = {**probe, "hidden_size": 32, "num_hidden_layers": 4, "tie_word_embeddings": False}  # the probe's facts
    extra = ("--gpus", "1") if a.device == "cuda" else ()
    server = FeatureServer(root / "target", root / "scratch", layers=probe["drafter"]["target_layer_ids"], extra=extra)
    try:
        t0 = time.time()
        summary = train(
            token_shards=[root / "tokens.parquet"],
            probe=probe,
            target_dir=root / "target",
            out_dir=root / "run",
            cfg={
                "epochs": 1,
                "batch_size": 4,
                "num_anchors": 8,
                "target_features": "stream",
                "trackers": [],
                "validation_fraction": 0.0,
                "mixed_precision": "bf16" if a.device == "cuda" else "no",
            },
            device="auto" if a.device == "cuda" else "cpu",
            stream={"endpoints": [{"base_url": server.url}], "scratch_dir": str(root / "scratch"), "fleet": FAST_FLEET},
        )
    finally:
        server.kill()
    st = summary.get("stream", {})
    ok = summary["steps"] > 0 and (root / "run/final/model.safetensors").is_file()
    return {
        "status": "ok" if ok else "FAIL",
        "figures": f"{summary['steps']} steps in {time.time() - t0:.1f} s from an hf server ({'GPU' if extra else 'CPU'}); "
        + ", ".join(f"{k} {v:.3g}" for k, v in st.items() if isinstance(v, (int, float)) and v is not None)[:200],
    }


def part_fsdp(a) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from dflash_pipeline.drafter.build import build_drafter
    from dflash_pipeline.train import optim as OPT
    from dflash_pipeline.train.data import ConfigOnly

    dev = torch.device(a.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        from transformers import Qwen3Config

        tc = Qwen3Config(
            vocab_size=256,
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
        )
        probe = {"drafter": {"block_size": 4, "num_draft_layers": 2, "target_layer_ids": [0, 1], "mask_token_id": 0}}
        torch.manual_seed(0)
        x, y = torch.randn(2, 8, 128, device=dev), torch.randn(2, 8, 128, device=dev)
        ctx = torch.randn(2, 24, 256, device=dev)
        pos_c, pos_b = torch.arange(24, device=dev).expand(2, -1), torch.arange(24, 32, device=dev).expand(2, -1)
        out = []
        for name in ("adamw", "muon"):
            losses = {}
            for sharded in (False, True):
                d = build_drafter(ConfigOnly(tc), probe, seed=1).to(dev)
                if sharded:
                    for layer in d.layers:
                        fully_shard(layer)
                    fully_shard(d)
                opt = OPT.make_optimizer(d, name, lr=1e-3, weight_decay=0.0)
                curve = []
                for _ in range(3):
                    loss = (d(x, ctx, pos_c, pos_b).float() - y).square().mean()
                    curve.append(float(loss))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                losses[sharded] = float(loss)
            rel = abs(losses[True] - losses[False]) / max(abs(losses[False]), 1e-12)
            out.append((name, curve[0], losses[True], rel))
    finally:
        dist.destroy_process_group()
    ok = all(rel < 1e-3 and last < first for _, first, last, rel in out)
    return {
        "status": "ok" if ok else "FAIL",
        "figures": "1 rank, fully_shard per draft layer, 3 steps: "
        + "; ".join(f"{n} loss {f:.4f} -> {v:.4f} (unsharded: rel. diff {r:.1e})" for n, f, v, r in out),
    }


#: Timed drafter sizes: (label, target text config, tokens, anchors, block size, draft layers, K).
STEP_SIZES = {
    "cuda": [
        (
            "Qwen3-8B-sized",
            dict(
                vocab_size=151936,
                hidden_size=4096,
                intermediate_size=12288,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
            ),
            3072,
            512,
            16,
            5,
            5,
        ),
        (
            "Kimi-K2.6-width",
            dict(
                vocab_size=163840,
                hidden_size=7168,
                intermediate_size=18432,
                num_attention_heads=64,
                num_key_value_heads=64,  # MLA: the drafter gets one KV head per head
                head_dim=112,
            ),
            4096,
            256,
            16,
            5,
            5,
        ),
    ],
    "cpu": [
        (
            "tiny (Qwen3-8B shape)",
            dict(
                vocab_size=512,
                hidden_size=64,
                intermediate_size=192,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
            ),
            128,
            8,
            4,
            2,
            3,
        ),
        (
            "tiny (Kimi shape)",
            dict(
                vocab_size=640,
                hidden_size=112,
                intermediate_size=288,
                num_attention_heads=8,
                num_key_value_heads=2,
                head_dim=14,
            ),
            96,
            6,
            4,
            2,
            3,
        ),
    ],
}


class _Frozen:
    """A frozen embedding or LM head as the trainer hands it to a step (a weight, called on token ids)."""

    def __init__(self, w):
        self.weight = w

    def __call__(self, ids):
        import torch.nn.functional as F

        return F.embedding(ids, self.weight)


def _count_step_flops(tc, probe: dict, batch: dict, num_anchors: int, block: int) -> tuple[float, float]:
    """Model FLOPs of one training step's forward and backward on `batch` as ``(dense, masked)``, counted by
    torch's ``FlopCounterMode`` on a twin of the drafter made of fake tensors (``FakeTensorMode``: shapes only,
    nothing computed or allocated, so the count costs no device memory) that samples the same anchors (real
    integer bookkeeping, the same generator seed as the timed step).

    The twin runs SDPA's math kernel with the dense training mask: the fused kernels' FLOP formulas refuse
    grouped-query shapes (torch 2.11: "query/key/value shapes are incompatible"), the math kernel's batched
    matmuls count them as the attention they compute. ``dense`` counts every query-key pair; ``masked`` scales
    the attention matmuls (``aten.bmm``: the only batched matmuls of a drafter step) by the share of pairs the
    mask lets attend, the work FlexAttention does (it skips fully masked tiles)."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.overrides import TorchFunctionMode
    from torch.utils.flop_counter import FlopCounterMode

    from dflash_pipeline.drafter import model as M
    from dflash_pipeline.drafter.build import build_drafter
    from dflash_pipeline.train.data import ConfigOnly
    from dflash_pipeline.train.step import StepContext, step_objective

    class MaskDensity(TorchFunctionMode):
        """Share of True in each dense attention mask SDPA is called with (the masks are real tensors)."""

        def __init__(self):
            super().__init__()
            self.shares = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention:
                mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
                self.shares.append(1.0 if mask is None else float(mask.float().mean()))
            return func(*args, **kwargs)

    h, v = tc.hidden_size, tc.vocab_size
    with FakeTensorMode(allow_non_fake_inputs=True):
        twin = build_drafter(ConfigOnly(tc), probe).train()
        embed, head = torch.zeros(v, h), torch.zeros(v, h)
        feats = torch.zeros(batch["features"].shape)
    real = {key: batch[key].cpu() for key in ("input_ids", "loss_mask", "attention_mask")}
    ctx = StepContext(
        drafter=twin,
        target=None,
        probe=probe,
        num_anchors=num_anchors,
        block_size=block,
        gamma=M.loss_decay_gamma(block),
        generator=torch.Generator().manual_seed(0),
        embed=_Frozen(embed),
        lm_head=_Frozen(head),
        backend="sdpa",
    )
    counter, density = FlopCounterMode(display=False), MaskDensity()
    with counter, density, sdpa_kernel(SDPBackend.MATH):
        step_objective(ctx, {**real, "features": feats}).total.backward()
    dense = float(counter.get_total_flops())
    attention = float(sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op) == "aten.bmm"))
    share = sum(density.shares) / len(density.shares) if density.shares else 1.0
    return dense, dense - attention * (1.0 - share)


def _timed_step(label, tcfg, seq, anchors, block, layers, k, device, steps, progress) -> dict:
    """Tokens/s, MFU and peak memory of ``steps`` training steps of one drafter (features given, as from shards
    or a stream: the target never runs), and the memory plan of the same step. ``progress(text)`` is told each
    phase. The peak counts what this step allocates (memory held before it, by an earlier size, is taken off)."""
    import contextlib
    import gc

    import torch
    from transformers import Qwen3Config

    from dflash_pipeline.drafter import model as M
    from dflash_pipeline.drafter.build import build_drafter
    from dflash_pipeline.train import memory as MP
    from dflash_pipeline.train import optim as OPT
    from dflash_pipeline.train.data import ConfigOnly
    from dflash_pipeline.train.step import StepContext, step_objective

    cuda = device == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated() if cuda else 0
    tc = Qwen3Config(num_hidden_layers=k + 1, max_position_embeddings=max(8192, seq), **tcfg)
    dt = torch.bfloat16 if cuda else torch.float32
    st = MP.StepSettings(
        batch_size=1,
        seq_len=seq,
        num_anchors=anchors,
        block_size=block,
        num_draft_layers=layers,
        num_target_features=k,
        mixed_precision="bf16" if cuda else "no",
        head_dtype=str(dt)[6:],
        backend="flex" if cuda else "sdpa",
    )
    progress("planning")
    t0 = time.time()
    plan = MP.plan_step_memory(tc, st)
    plan_s = time.time() - t0

    probe = {
        "drafter": {
            "block_size": block,
            "num_draft_layers": layers,
            "target_layer_ids": list(range(k)),
            "mask_token_id": 0,
        }
    }
    progress("building")
    with torch.device(device):  # initialised where it trains: billions of weights are slow to draw on the CPU
        drafter = build_drafter(ConfigOnly(tc), probe).train()
    h, v = tc.hidden_size, tc.vocab_size
    embed, head = torch.randn(v, h, dtype=dt, device=device), torch.randn(v, h, dtype=dt, device=device) * 0.02
    lmask = torch.ones(1, seq, dtype=torch.uint8, device=device)
    lmask[:, : seq // 8] = 0
    batch = {
        "input_ids": torch.randint(1, v, (1, seq), device=device),
        "loss_mask": lmask,
        "attention_mask": torch.ones(1, seq, dtype=torch.long, device=device),
        "features": torch.randn(1, seq, k * h, dtype=dt, device=device),
    }
    opt = OPT.make_optimizer(drafter, "adamw", lr=1e-4, weight_decay=0.0)
    forward = drafter.forward
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def fwd(*args, **kw):
        with autocast:
            return forward(*args, **kw)

    drafter.forward = fwd  # as Accelerate's autocast wraps it

    def ctx(backend):
        return StepContext(
            drafter=drafter,
            target=None,
            probe=probe,
            num_anchors=anchors,
            block_size=block,
            gamma=M.loss_decay_gamma(block),
            generator=torch.Generator().manual_seed(0),
            embed=_Frozen(embed),
            lm_head=_Frozen(head),
            backend=backend,
        )

    def step(c):
        step_objective(c, batch).total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    progress("counting FLOPs")
    flops_dense, flops = _count_step_flops(tc, probe, batch, anchors, block)
    timed = ctx("flex" if cuda else "sdpa")
    progress("first step (flex compile)" if cuda else "first step")
    t0 = time.time()
    step(timed)  # compile (flex) and allocator warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    first_s = time.time() - t0
    progress(f"{steps} timed steps")
    t0 = time.time()
    for _ in range(steps):
        step(timed)
    if cuda:
        torch.cuda.synchronize()
    sec = (time.time() - t0) / steps
    peak = torch.cuda.max_memory_allocated() - held if cuda else None
    drafter.forward = forward  # no cycle through the wrapper: the next size starts with this one freed
    return {
        "label": label,
        "tokens_per_s": seq / sec,
        "slots_per_s": anchors * block / sec,
        "step_s": sec,
        "first_step_s": first_s,
        "plan_s": plan_s,
        "tflop_per_step": flops / 1e12,
        "tflop_per_step_dense": flops_dense / 1e12,
        "mfu": flops / sec / H200_BF16_FLOPS if cuda else None,
        "mfu_dense": flops_dense / sec / H200_BF16_FLOPS if cuda else None,
        "peak_gb": peak / 1e9 if peak is not None else None,
        "plan_gb": plan.peak_gb,
    }


def _step_figure(r: dict) -> str:
    f = f"{r['label']}: {r['tokens_per_s']:.0f} tok/s ({r['slots_per_s']:.0f} slots/s, {r['step_s']:.3f} s/step"
    f += f", first step {r['first_step_s']:.1f} s)"
    if r["mfu"] is not None:
        f += f", MFU {100 * r['mfu']:.1f} % ({r['tflop_per_step']:.1f} TFLOP/step; dense attention"
        f += f" {r['tflop_per_step_dense']:.1f}, {100 * r['mfu_dense']:.1f} %)"
    else:
        f += f", {r['tflop_per_step'] * 1e3:.3g} GFLOP/step"
    if r["peak_gb"] is not None:
        f += f", peak {r['peak_gb']:.2f} GB vs plan {r['plan_gb']:.2f} GB (plan/peak {r['plan_gb'] / r['peak_gb']:.3f})"
    else:
        f += f", plan {r['plan_gb']:.3f} GB"
    return f


def part_steps(a) -> dict:
    rows, figs = [], []
    for size in STEP_SIZES[a.device]:

        def progress(phase, label=size[0]):
            _partial("; ".join([*figs, f"{label}: {phase}"]))

        rows.append(_timed_step(*size, a.device, 5 if a.device == "cuda" else 1, progress))
        figs.append(_step_figure(rows[-1]))
        _partial("; ".join(figs))
    # the plan's promise, as on the CPU (tests/unit/train/test_memory_plan.py): within 10 % of the real peak
    off = [r["label"] for r in rows if r["peak_gb"] is not None and abs(r["plan_gb"] / r["peak_gb"] - 1) > 0.10]
    figures = "; ".join(figs) + (f"; the plan is off by more than 10 % for {', '.join(off)}" if off else "")
    return {"status": "FAIL" if off else "ok", "figures": figures, "rows": rows}


# ---------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------


def _run_part(name: str, a, limit: float, logs: Path | None) -> dict:
    """One part in its own process group under `limit` seconds: its row, with ``seconds`` and ``limit_s``. Its
    progress lines are echoed to stderr as they come, and all its output goes to ``logs/<name>.log``."""
    cmd = [sys.executable, __file__, "--part", name, "--device", a.device, "--limit", f"{limit:.0f}"]
    for f in a.family or ():
        cmd += ["--family", f]
    if a.models:
        cmd += ["--models", a.models]
    if a.workflow_workdir:
        cmd += ["--workflow-workdir", a.workflow_workdir]
    env = {
        **os.environ,
        "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "PYTHONUNBUFFERED": "1",
    }
    t0 = time.time()
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines: list[str] = []
    log = open(logs / f"{name}.log", "w") if logs else None

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if log:
                log.write(line)
                log.flush()
            if line.startswith(PARTIAL):
                print(f"[gpu-check] {name}: {line[len(PARTIAL) :].strip()}", file=sys.stderr, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    over = False
    try:
        proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        over = True
    finally:  # over the limit or interrupted: the part and all it started; else what it left behind (a server)
        _kill_group(proc)
    reader.join(timeout=10)
    if log:
        log.close()
    out = {"seconds": time.time() - t0, "limit_s": limit}
    partial = [x[len(PARTIAL) :].strip() for x in lines if x.startswith(PARTIAL)]
    rows = [x[len(ROW) :] for x in lines if x.startswith(ROW)]
    if over:
        return {
            "status": "FAIL",
            "figures": f"over its {limit:.0f} s limit" + (f"; {partial[-1]}" if partial else ""),
            **out,
        }
    if proc.returncode or not rows:
        tail = " ".join("".join(x for x in lines if not x.startswith(PARTIAL)).strip().splitlines()[-2:])[:300]
        return {"status": "FAIL", "figures": f"exit {proc.returncode}: {tail}", **out}
    return {**json.loads(rows[-1]), **out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--skip", action="append", default=[], choices=PARTS, help="leave a part out (repeat)")
    p.add_argument(
        "--family", action="append", help=f"zoo families (default: {', '.join(ZOO_FAMILIES)}; CPU: the first)"
    )
    p.add_argument(
        "--models",
        help="model-config corpus (default: $DFLASH_MODELS_DIR, bench/gpu_carry/models, ../shared/data/models)",
    )
    p.add_argument(
        "--workflow-workdir",
        default=os.environ.get("DFLASH_GPU_CHECK_WORKDIR"),
        help="the workflow part's workdir (default: a fresh one; $DFLASH_GPU_CHECK_WORKDIR)",
    )
    p.add_argument("--json", help="also write the table's rows here")
    p.add_argument("--logs", help="keep each part's output as LOGS/<part>.log")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    p.add_argument("--limit", type=float, default=600.0, help=argparse.SUPPRESS)  # a part's seconds
    a = p.parse_args(argv)
    a.device = _device(a.device)
    if a.part:  # a child: one part, its row as the last line of stdout
        print(ROW + json.dumps(globals()[f"part_{a.part}"](a)), flush=True)
        return 0
    logs = Path(a.logs) if a.logs else None
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
    scale = 1.0 if a.device == "cuda" else CPU_SCALE
    rows = {}
    t0 = time.time()
    deadline = t0 + BUDGET * scale
    todo = [x for x in PARTS if x not in a.skip]
    print(
        f"[gpu-check] {a.device}: limits "
        + ", ".join(f"{x} {LIMITS[x] * scale:.0f} s" for x in todo)
        + f"; the whole check within {BUDGET * scale:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    for name in PARTS:
        if name in a.skip:
            reason = (
                "--skip workflow (the suite: a Snakemake run per test is too slow; tests/e2e runs the demo)"
                if name == "workflow"
                else f"--skip {name}"
            )
            rows[name] = {"status": "skipped", "figures": reason, "seconds": 0.0}
            continue
        limit = min(LIMITS[name] * scale, deadline - time.time())
        if limit < 10:
            rows[name] = {"status": "FAIL", "figures": "no time left in the check's budget", "seconds": 0.0}
            continue
        print(f"[gpu-check] {name} (limit {limit:.0f} s) ...", file=sys.stderr, flush=True)
        rows[name] = _run_part(name, a, limit, logs)
        r = rows[name]
        print(f"[gpu-check] {name}: {r['status']} ({r['seconds']:.0f} s of {limit:.0f})", file=sys.stderr, flush=True)
    import torch

    where = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    print(f"\nGPU check on {where}, torch {torch.__version__}, {time.time() - t0:.0f} s\n")
    print("| check | status | s | limit s | figures |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        limit = f"{r['limit_s']:.0f}" if "limit_s" in r else "-"
        print(f"| {name} | {r['status']} | {r['seconds']:.0f} | {limit} | {r['figures']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
