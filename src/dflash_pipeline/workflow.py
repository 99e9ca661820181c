"""Light helpers for the Snakemake side (no torch import, so `snakemake -n` stays fast)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator, Optional


def accelerate_launch_args(num_processes: int, mixed_precision: str = "no") -> list[str]:
    """Arguments for ``accelerate launch`` (reference/feasibility.md §3).

    One process: a plain single-process launch (GPU if present, else CPU). Several: ``--multi_gpu``,
    which on a CPU-only machine gives real gloo ranks because the training script builds
    ``Accelerator(cpu=not torch.cuda.is_available())`` (plain ``--cpu`` would silently run ONE process).
    """
    args = ["--num_machines", "1", "--num_processes", str(num_processes), "--mixed_precision", mixed_precision, "--dynamo_backend", "no"]
    if num_processes > 1:
        args = ["--multi_gpu"] + args
    return args


@contextlib.contextmanager
def log_to(path: Optional[str | os.PathLike], threads: Optional[int] = None) -> Iterator[None]:
    """Send stdout/stderr and the ``logging`` root to ``path`` (a Snakemake ``log:`` file) for a block,
    and cap torch's intra-op threads at ``threads`` (the rule's ``threads``)."""
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
    if not path:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", buffering=1) as fh:
        handler = logging.StreamHandler(fh)
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        with contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
            try:
                yield
            except BaseException:
                import traceback

                traceback.print_exc(file=fh)  # the log shows the failure, not an empty file
                raise
            finally:
                logging.getLogger().removeHandler(handler)


# --- GPUs -------------------------------------------------------------------------------------------
# Snakemake counts a `gpu` resource but never says *which* devices a job gets. SLURM (`--gpus=N`) and the
# ssh profile (cluster/ssh_submit.py) export CUDA_VISIBLE_DEVICES per job; for local runs `claim_gpus`
# picks free devices with host-local lock files, so two concurrent GPU jobs never share one.

#: Rules that run models on GPUs when the run is a GPU run (see `job_gpus`).
GPU_RULES = ("train_drafter", "evaluate_acceptance", "generate_completions", "evaluate_engine")


def job_gpus(config: dict, rule: str) -> int:
    """GPUs one job of ``rule`` asks for (the rule's ``gpu`` resource; SLURM maps it to ``--gpus=N``).

    A run is a GPU run when ``train.mixed_precision`` is not ``"no"`` (bf16/fp16 are GPU settings; CPU
    runs use fp32). Then training takes ``train.num_processes`` GPUs (one per accelerate process), eval one,
    and in-process generation (``generation.backend: transformers``) one; server-backed generation none.
    Override per rule with ``--set-resources RULE:gpu=N`` (or ``set-resources`` in a profile).
    """
    if config["train"]["mixed_precision"] == "no" or rule not in GPU_RULES:
        return 0
    if rule == "train_drafter":
        return int(config["train"]["num_processes"])
    if rule == "generate_completions" and config["generation"]["backend"] != "transformers":
        return 0
    return 1


def _visible_pool() -> Optional[list[str]]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d for d in env.split(",") if d.strip()]
    return None


def _detect_gpus() -> list[str]:
    """Device indices from ``nvidia-smi`` (no torch import, no CUDA context); empty without one."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60)
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


@contextlib.contextmanager
def claim_gpus(n: int, *, pool: Optional[list[str]] = None, lock_dir: Optional[str | os.PathLike] = None,
               poll_s: float = 2.0, timeout_s: Optional[float] = None) -> Iterator[list[str]]:
    """Hold ``n`` GPUs for a block and export ``CUDA_VISIBLE_DEVICES`` to them (restored afterwards).

    - ``n == 0``: nothing to do.
    - ``CUDA_VISIBLE_DEVICES`` already lists exactly ``n`` devices: a scheduler assigned them (SLURM, the
      ssh profile); used as they are, no locks.
    - otherwise the pool is ``pool``, else ``CUDA_VISIBLE_DEVICES`` (when set), else every device
      ``nvidia-smi`` lists, and
      ``n`` of them are claimed with ``flock`` on ``<lock_dir>/gpu-<id>.lock`` (``$DFLASH_GPU_LOCK_DIR``,
      default ``/tmp/dflash-gpu-locks``): all-or-nothing, waiting ``poll_s`` between tries while other
      jobs hold them. Locks die with the process, so a killed job frees its GPUs.
    """
    import fcntl
    import time

    if n <= 0:
        yield []
        return
    if pool is None:
        pool = _visible_pool()
        if pool is not None and len(pool) == n:
            yield pool
            return
        if pool is None:
            pool = _detect_gpus()
    if len(pool) < n:
        raise RuntimeError(
            f"this job asks for {n} GPU(s) but only {len(pool)} are visible ({','.join(pool) or 'none'}); "
            f"lower the rule's gpu resource (--set-resources RULE:gpu=N) or train.num_processes, or set "
            f"train.mixed_precision: 'no' for a CPU run"
        )
    lock_dir = Path(lock_dir or os.environ.get("DFLASH_GPU_LOCK_DIR", "/tmp/dflash-gpu-locks"))
    lock_dir.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        held: list[tuple[str, int]] = []
        for dev in pool:
            fd = os.open(lock_dir / f"gpu-{dev}.lock", os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            held.append((dev, fd))
            if len(held) == n:
                break
        if len(held) == n:
            break
        for _, fd in held:
            os.close(fd)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no {n} free GPU(s) among {','.join(pool)} after {timeout_s}s (locks in {lock_dir})")
        time.sleep(poll_s)
    devices = [d for d, _ in held]
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    try:
        yield devices
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
        for _, fd in held:
            os.close(fd)


def run_with_gpus(argv: Optional[list[str]] = None) -> int:
    """``python -m dflash_pipeline.workflow gpus N -- CMD …``: run CMD holding N GPUs (see `claim_gpus`)."""
    import subprocess

    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[0] != "gpus" or argv[2] != "--":
        print("usage: python -m dflash_pipeline.workflow gpus N -- CMD [ARGS...]", file=sys.stderr)
        return 2
    with claim_gpus(int(argv[1])):
        return subprocess.call(argv[3:])


if __name__ == "__main__":
    sys.exit(run_with_gpus())


#: Modules whose code decides the bytes of a token shard (rules/tokens.smk reruns when they change).
TOKENIZATION_MODULES = ("dflash_pipeline.tokens", "dflash_pipeline.spans", "dflash_pipeline.chat", "dflash_pipeline.contracts", "dflash_pipeline.shards")


def code_fingerprint(modules=TOKENIZATION_MODULES) -> str:
    """sha256 (first 16 hex) over the source files of ``modules`` as they would be imported (located with
    ``importlib.util.find_spec``, not imported). Used as a rule ``param`` so that a code change reruns the
    rule (Snakemake's ``code`` trigger only sees the rule's script, not the library it calls)."""
    import hashlib
    import importlib.util

    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise ImportError(f"cannot locate module {name}; is dflash_pipeline installed (pip install -e .)?")
        h.update(name.encode() + b"\0" + Path(spec.origin).read_bytes() + b"\0")
    return h.hexdigest()[:16]
