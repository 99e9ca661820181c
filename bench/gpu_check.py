"""The GPU check (``bench/gpu_check.sh`` runs it): every part in its own process under a time limit, one table.

Parts (``--skip PART`` leaves one out, with the reason in the table):

- ``zoo``: the model zoo's stages (twin build, probe, completions, tokens, fp32 and bf16 training, eval τ) on
  several families (``--family``; bf16 training and eval on the GPU with ``--device cuda``/``auto``).
- ``workflow``: the demo workflow through Snakemake (``train.device: auto``, bf16 mixed precision on a GPU), its
  τ from the eval stage; ``--workflow-workdir DIR`` reuses a workdir (a finished one costs a dry run).
- ``stream``: an hf feature server (``python -m dflash_pipeline.features serve``, on the GPU) and a training run
  fed by it (``train.target_features: stream``).
- ``fsdp``: one FSDP2 rank (``fully_shard`` per draft layer, nccl on CUDA, gloo on CPU): two optimizer steps with
  AdamW and with Muon, the loss against the unsharded drafter's.
- ``steps``: a Qwen3-8B-sized and a Kimi-K2.6-width drafter step (bf16 autocast, flex attention on CUDA; tiny
  sdpa steps on CPU), tokens/s, MFU and peak memory against the memory plan's prediction
  (:mod:`dflash_pipeline.train.memory`).

    python bench/gpu_check.py --device cuda            # the H200 (bench/gpu_check.sh)
    python bench/gpu_check.py --device cpu --skip workflow   # tiny sizes, the suite's smoke run

Checks that need vLLM or SGLang: ``bench/gpu_check_engines.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PARTS = ("zoo", "workflow", "stream", "fsdp", "steps")
#: Seconds per part on a GPU (the whole check stays under 8 minutes, one command under 10).
LIMITS = {"zoo": 110, "workflow": 150, "stream": 50, "fsdp": 30, "steps": 120}  # 460 s at most
#: Dense bf16 peak of one H200 (NVIDIA data sheet, SXM: 989.5 TFLOP/s without sparsity), for MFU.
H200_BF16_FLOPS = 989.5e12
ZOO_FAMILIES = ("Qwen3.5-35B-A3B", "gpt-oss-20b", "Kimi-K2.5")


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


def part_zoo(a) -> dict:
    models = _models_dir(a.models)
    if models is None:
        return {
            "status": "skipped",
            "figures": "no model configs (--models, $DFLASH_MODELS_DIR or bench/gpu_carry/models)",
        }
    fams = a.family or (ZOO_FAMILIES if a.device == "cuda" else ZOO_FAMILIES[:1])
    cmd = [sys.executable, "-m", "dflash_pipeline.testing.zoo", "--table", "--no-engine", "--models", str(models)]
    cmd += ["--device", "auto" if a.device == "cuda" else "cpu"]
    for f in fams:
        cmd += ["--family", f]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    rows = [x for x in proc.stdout.splitlines() if x.startswith("| ") and not x.startswith("| family")]
    cells = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in rows}
    bad = {f: c for f, c in cells.items() if any(x != "ok" for x in c)}
    ok = proc.returncode == 0 and len(cells) == len(fams) and not bad
    figures = f"{len(cells) - len(bad)}/{len(fams)} families through build..eval ({', '.join(fams)})"
    if bad:
        figures += "; " + "; ".join(f"{f}: {next(x for x in c if x != 'ok')}" for f, c in bad.items())
    if proc.returncode:
        figures += f"; exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
    return {"status": "ok" if ok else "FAIL", "figures": figures}


def part_workflow(a) -> dict:
    try:
        import snakemake  # noqa: F401
    except ImportError:
        return {"status": "FAIL", "figures": "snakemake is not installed (bench/gpu_prepare.sh carries its wheels)"}
    work = Path(a.workflow_workdir) if a.workflow_workdir else Path(tempfile.mkdtemp(prefix="gpu-check-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    mp = "bf16" if a.device == "cuda" else "no"
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(work)]
    cmd += ["--configfile", str(REPO / "config/config.yaml"), "--profile"]
    cmd += [str(REPO / "profiles/local"), "--cores", str(os.cpu_count() or 2), "--scheduler", "greedy"]
    cmd += ["--config", f"train={{device: auto, mixed_precision: {mp}}}"]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        tail = " ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])[:300]
        return {"status": "FAIL", "figures": f"snakemake exit {proc.returncode}: {tail}"}
    taus = {}
    for acc in (work / "results/eval").glob("*/acceptance.json"):  # τ per drafter and eval set
        for drafter, per_set in json.loads(acc.read_text()).get("tau", {}).items():
            for name, tau in per_set.items():
                taus[f"{drafter} {name}"] = round(float(tau), 2)
    plan = next((x for x in (proc.stdout + proc.stderr).splitlines() if "[plan] device memory" in x), "")
    return {
        "status": "ok",
        "figures": f"demo workflow {time.time() - t0:.0f} s, train.device auto, mixed precision {mp}; τ {taus or 'n/a'}"
        + (f"; {plan.split(':', 1)[1].split('(')[0].strip()} planned" if plan else ""),
    }


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


def _timed_step(label, tcfg, seq, anchors, block, layers, k, device, steps) -> dict:
    """Tokens/s, MFU and peak memory of ``steps`` training steps of one drafter (features given, as from shards
    or a stream: the target never runs), and the memory plan of the same step."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3Config

    from dflash_pipeline.drafter import model as M
    from dflash_pipeline.drafter.build import build_drafter
    from dflash_pipeline.train import memory as MP
    from dflash_pipeline.train import optim as OPT
    from dflash_pipeline.train.data import ConfigOnly
    from dflash_pipeline.train.step import StepContext, step_objective

    cuda = device == "cuda"
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
    plan = MP.plan_step_memory(tc, st)

    class Frozen:
        def __init__(self, w):
            self.weight = w

        def __call__(self, ids):
            return F.embedding(ids, self.weight)

    probe = {
        "drafter": {
            "block_size": block,
            "num_draft_layers": layers,
            "target_layer_ids": list(range(k)),
            "mask_token_id": 0,
        }
    }
    drafter = build_drafter(ConfigOnly(tc), probe).to(device).train()
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
            embed=Frozen(embed),
            lm_head=Frozen(head),
            backend=backend,
        )

    def step(c):
        step_objective(c, batch).total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # model FLOPs of one step, the dense (sdpa) attention counted through its math kernel: the fused CUDA kernels'
    # FLOP formulas refuse grouped-query shapes (torch 2.11: "query/key/value shapes are incompatible"), the math
    # kernel's matmuls count them as the attention they compute
    from torch.nn.attention import SDPBackend, sdpa_kernel

    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        step(ctx("sdpa"))
    flops = counter.get_total_flops()
    timed = ctx("flex" if cuda else "sdpa")
    step(timed)  # compile (flex) and allocator warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(steps):
        step(timed)
    if cuda:
        torch.cuda.synchronize()
    sec = (time.time() - t0) / steps
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {
        "label": label,
        "tokens_per_s": seq / sec,
        "slots_per_s": anchors * block / sec,
        "step_s": sec,
        "mfu": flops / sec / H200_BF16_FLOPS if cuda else None,
        "peak_gb": peak / 1e9 if peak is not None else None,
        "plan_gb": plan.peak_gb,
    }


def part_steps(a) -> dict:
    rows = [_timed_step(*size, a.device, 3 if a.device == "cuda" else 1) for size in STEP_SIZES[a.device]]
    figs, ok = [], True
    for r in rows:
        f = f"{r['label']}: {r['tokens_per_s']:.0f} tok/s ({r['slots_per_s']:.0f} slots/s, {r['step_s']:.2f} s/step)"
        if r["mfu"] is not None:
            f += f", MFU {100 * r['mfu']:.1f} %"
        if r["peak_gb"] is not None:
            err = (r["plan_gb"] - r["peak_gb"]) / r["peak_gb"]
            f += f", peak {r['peak_gb']:.2f} GB vs plan {r['plan_gb']:.2f} GB ({100 * err:+.0f} %)"
        else:
            f += f", plan {r['plan_gb']:.3f} GB"
        figs.append(f)
    return {"status": "ok" if ok else "FAIL", "figures": "; ".join(figs), "rows": rows}


# ---------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------


def _run_part(name: str, a, limit: float) -> dict:
    cmd = [sys.executable, __file__, "--part", name, "--device", a.device]
    for f in a.family or ():
        cmd += ["--family", f]
    if a.models:
        cmd += ["--models", a.models]
    if a.workflow_workdir:
        cmd += ["--workflow-workdir", a.workflow_workdir]
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "FAIL", "figures": f"over its {limit:.0f} s limit", "seconds": time.time() - t0}
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode or not lines:
        tail = " ".join((proc.stdout + proc.stderr).strip().splitlines()[-2:])[:300]
        return {"status": "FAIL", "figures": f"exit {proc.returncode}: {tail}", "seconds": time.time() - t0}
    return {**json.loads(lines[-1]), "seconds": time.time() - t0}


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
        help="the demo workflow's workdir (default: a fresh one; $DFLASH_GPU_CHECK_WORKDIR)",
    )
    p.add_argument("--json", help="also write the table's rows here")
    p.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.device = _device(a.device)
    if a.part:  # a child: one part, its row as the last line of stdout
        print(json.dumps(globals()[f"part_{a.part}"](a)), flush=True)
        return 0
    scale = 1.0 if a.device == "cuda" else 2.0  # CPU sizes are tiny but the zoo is slower there
    rows = {}
    t0 = time.time()
    for name in PARTS:
        if name in a.skip:
            reason = (
                "--skip workflow (the suite: a Snakemake run per test is too slow; tests/e2e runs the demo)"
                if name == "workflow"
                else f"--skip {name}"
            )
            rows[name] = {"status": "skipped", "figures": reason, "seconds": 0.0}
            continue
        print(f"[gpu-check] {name} ...", file=sys.stderr, flush=True)
        rows[name] = _run_part(name, a, LIMITS[name] * scale)
        print(
            f"[gpu-check] {name}: {rows[name]['status']} ({rows[name]['seconds']:.0f} s)", file=sys.stderr, flush=True
        )
    import torch

    where = torch.cuda.get_device_name(0) if a.device == "cuda" else "CPU"
    print(f"\nGPU check on {where}, torch {torch.__version__}, {time.time() - t0:.0f} s\n")
    print("| check | status | s | figures |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['status']} | {r['seconds']:.0f} | {r['figures']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": where, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0 if all(r["status"] in ("ok", "skipped") for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
