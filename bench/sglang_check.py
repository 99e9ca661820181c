"""The real SGLang check (``bench/gpu_check.sh``; needs CUDA and SGLang >= v0.5.18 in ``--python``'s environment):
against SGLang itself, what the unit tests check on the SGLang-shaped test server
(``dflash_pipeline.testing.server``, ``--flavor sglang``; tests/unit/completions/test_completions_sglang.py,
tests/unit/testing/test_server_sglang.py, tests/unit/evaluate/test_engine_sglang.py).

1. SGLang serving the target (``--reasoning-parser qwen3``): the completions stage with
   ``extra_body: {return_token_ids: true}`` in each thinking mode. Every turn carries the server's ids, its
   prompt ids equal our render of the regenerated history, its output ids decode to what the record keeps
   (reasoning and answer), and the tokens stage builds one row per turn from them (``server_ids_used``).
2. A streamed chat asking for ``return_token_ids`` is refused with HTTP 400 and the message the test server
   copies (:data:`dflash_pipeline.testing.server.sglang.STREAM_REFUSALS`).
3. SGLang serving the target with a DFlash drafter (``--speculative-algorithm DFLASH``, the line of the
   export's ``serve.md``): engine τ, per-position acceptance and the histogram from each answer's
   ``meta_info`` on a few gsm8k prompts (:func:`dflash_pipeline.evaluate.engine_acceptance.server_acceptance`).

``--target`` defaults to ``resources/demo-target`` (built here with a short training when missing);
``--drafter`` to an untrained drafter exported for the target (τ near 1: the plumbing, not the drafter).
Prints one line per check and exits non-zero on the first failure.

    python bench/sglang_check.py --python /opt/sglang/bin/python [--target DIR] [--drafter DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from dflash_pipeline.core import contracts, shards
from dflash_pipeline.core.config import validate_config
from dflash_pipeline.evaluate.vllm_server import free_port, serve_commands

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "user", "content": "And times 4?"},
    ],
    [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}],
]


class SGLang:
    """``python -m sglang.launch_server`` in its own process group; ``base_url`` once ``/v1/models`` answers."""

    def __init__(self, python: str, argv: list[str], log: Path, timeout_s: float = 900):
        self.port = free_port()
        cmd = [
            python,
            "-m",
            "sglang.launch_server",
            *argv,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--mem-fraction-static",
            "0.5",
        ]
        self.log = log
        with open(log, "w", encoding="utf-8") as fh:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            self.proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"SGLang exited with {self.proc.returncode}; end of {log}:\n{log.read_text()[-4000:]}")
            try:
                urllib.request.urlopen(f"{self.base_url}/models", timeout=5).read()
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(
                        f"SGLang not ready after {timeout_s:.0f} s; end of {log}:\n{log.read_text()[-4000:]}"
                    )
                time.sleep(1.0)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)


def check(ok: bool, what: str) -> None:
    print(f"[sglang-check] {'ok  ' if ok else 'FAIL'} {what}", flush=True)
    if not ok:
        raise SystemExit(1)


def completions_in_each_mode(base_url: str, target: Path, work: Path) -> None:
    """Check 1: the completions and tokens stages on SGLang's ids, thinking disable / save / none."""
    from dflash_pipeline.completions import generate_shard
    from dflash_pipeline.target.chat import load_tokenizer, render
    from dflash_pipeline.tokens import tokenize_shard

    tok = load_tokenizer(target)
    prompts = [
        {"prompt_id": contracts.prompt_id(m), "dataset": "t", "messages": m, "metadata": "{}"} for m in CONVERSATIONS
    ]
    shards.write_parquet(work / "p.parquet", shards.table_from_records(prompts, contracts.PROMPT_SCHEMA))
    for thinking in ("disable", "save", "none"):
        # a target that does not think (the demo's) answers thinking=save without reasoning: those rows are
        # errors (counted below), the others must carry the ids
        gen = validate_config(
            {
                "generation": {
                    "backend": "openai",
                    "endpoints": [{"base_url": base_url, "max_concurrency": 2}],
                    "thinking": thinking,
                    "max_tokens": 48,
                    "temperature": 0.0,
                    "extra_body": {"return_token_ids": True},
                    "max_error_fraction": 1.0 if thinking == "save" else 0.0,
                }
            }
        )["generation"]
        out = work / f"c-{thinking}.parquet"
        generate_shard(work / "p.parquet", out, target_dir=target, gen_cfg=gen)
        every = shards.read_parquet(out).to_pylist()
        records = [r for r in every if r["status"] != "error"]
        if len(records) < len(every):
            print(
                f"[sglang-check] note thinking={thinking}: {len(every) - len(records)} of {len(every)} conversations "
                f"without reasoning (the target did not think): {every[0]['error']}",
                flush=True,
            )
        turns = [t for r in records for t in r["turns"]]
        check(
            all(t["prompt_token_ids"] and t["output_token_ids"] for t in turns),
            f"thinking={thinking}: every turn carries SGLang's prompt and output ids ({len(turns)} turns)",
        )
        for r in records:
            history, k = [], 0
            for m in r["messages"]:
                if m["role"] == "assistant":
                    t = r["turns"][k]
                    mine = render(tok, history, thinking=thinking, add_generation_prompt=True, tokenize=True)
                    text = tok.decode(t["output_token_ids"], skip_special_tokens=True)
                    where = f"thinking={thinking}, {r['prompt_id'][:8]} turn {k}"
                    check(t["prompt_token_ids"] == mine, f"{where}: prompt ids = our render")
                    check(
                        m["content"].strip() in text and (m["reasoning_content"] or "").strip() in text,
                        f"{where}: output ids decode to the answer kept",
                    )
                    reasoning = {"reasoning_content": m["reasoning_content"]} if m["reasoning_content"] else {}
                    history.append({"role": "assistant", "content": m["content"], **reasoning})
                    k += 1
                else:
                    history.append({"role": m["role"], "content": m["content"]})
        stats = tokenize_shard(
            out,
            work / f"t-{thinking}.parquet",
            target_dir=target,
            tokens_cfg={"max_length": 4096, "last_turn_only": False, "use_server_token_ids": True},
        )
        check(stats["server_ids_used"] == len(turns), f"thinking={thinking}: every token row from the server's ids")


def streamed_chat_refusal(base_url: str) -> None:
    """Check 2: SGLang refuses ids on a streamed chat with the 400 the test server copies."""
    from dflash_pipeline.testing.server.sglang import STREAM_REFUSALS

    model = json.loads(urllib.request.urlopen(f"{base_url}/models", timeout=30).read())["data"][0]["id"]
    body = {"model": model, "messages": CONVERSATIONS[1][:1], "stream": True, "return_token_ids": True}
    req = urllib.request.Request(
        f"{base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        urllib.request.urlopen(req, timeout=60).read()
        status, answer = 200, {}
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, json.loads(exc.read() or b"{}")
    check(
        status == 400 and answer.get("message") == dict(STREAM_REFUSALS)["return_token_ids"],
        f"streamed chat with return_token_ids: HTTP {status} {answer.get('message')!r}",
    )


def untrained_drafter(target: Path, out: Path, block_size: int = 4) -> Path:
    """A random-init DFlash drafter exported for ``target`` (the probe's layer ids and mask token)."""
    from transformers import AutoConfig

    from dflash_pipeline.drafter.model import (
        DFlashDrafter,
        drafter_config_from_target,
        save_drafter,
    )
    from dflash_pipeline.probe import probe_target

    d = probe_target(target, block_size=block_size, num_draft_layers=1)["drafter"]
    cfg = drafter_config_from_target(
        AutoConfig.from_pretrained(target),
        block_size=block_size,
        num_draft_layers=1,
        target_layer_ids=d["target_layer_ids"],
        mask_token_id=d["mask_token_id"],
    )
    save_drafter(DFlashDrafter(cfg), out)
    return out


def engine_tau(python: str, target: Path, drafter: Path, work: Path) -> None:
    """Check 3: SGLang with the drafter; τ from each answer's meta_info."""
    import shlex

    from dflash_pipeline.evaluate.engine_acceptance import server_acceptance
    from dflash_pipeline.prompts import load_eval_prompts

    bs = int(json.loads((drafter / "config.json").read_text())["block_size"])
    argv = shlex.split(serve_commands(drafter, target, bs)["sglang"])[3:]  # after `python -m sglang.launch_server`
    argv = [a for i, a in enumerate(argv) if a != "--port" and (i == 0 or argv[i - 1] != "--port")]
    srv = SGLang(python, [*argv, "--speculative-draft-attention-backend", "flashinfer"], work / "sglang-dflash.log")
    try:
        prompts = load_eval_prompts(REPO / "data" / "gsm8k" / "test.jsonl", fmt="auto", num_samples=8, seed=0)
        r = server_acceptance(srv.base_url, prompts, max_tokens=64, block_size=bs, meta_info=True, max_concurrency=4)
    finally:
        srv.stop()
    check(
        r["source"] == "meta_info" and r["num_steps"] > 0 and len(r["per_position_acceptance"]) == bs - 1,
        f"engine τ {r['tau']:.3f} pooled over {r['num_steps']} verify steps (mean of answers "
        f"{r['tau_mean_response']:.3f}), per-position {[round(p, 3) for p in r['per_position_acceptance']]}",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter of the SGLang environment")
    ap.add_argument("--target", type=Path, default=REPO / "resources" / "demo-target")
    ap.add_argument("--drafter", type=Path, default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sglang-check-"))
    if not (a.target / "config.json").is_file():
        from dflash_pipeline.demo import build_demo_target

        a.target = build_demo_target(work / "demo-target", seed=0, train_steps=100)
    srv = SGLang(a.python, ["--model-path", str(a.target), "--reasoning-parser", "qwen3"], work / "sglang.log")
    try:
        completions_in_each_mode(srv.base_url, a.target, work)
        streamed_chat_refusal(srv.base_url)
    finally:
        srv.stop()
    engine_tau(a.python, a.target, a.drafter or untrained_drafter(a.target, work / "drafter"), work)
    print(f"[sglang-check] all checks passed (logs in {work})", flush=True)


if __name__ == "__main__":
    main()
