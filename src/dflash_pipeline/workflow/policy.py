"""Light helpers for the Snakemake side (no torch import, so `snakemake -n` stays fast)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from dflash_pipeline.core.config import schema_defaults
from dflash_pipeline.core.console import CONSOLE_LOGGER, CONSOLE_PREFIXES, console  # noqa: F401 (used by the tee)
from dflash_pipeline.core.procs import free_port


def accelerate_launch_args(
    num_processes: int,
    mixed_precision: str = "no",
    *,
    num_machines: int = 1,
    machine_rank: int = 0,
    main_process_ip: Optional[str] = None,
    main_process_port: Optional[int] = None,
) -> list[str]:
    """Arguments for ``accelerate launch`` (reference/feasibility.md §3).

    ``num_processes`` is per machine (``train.num_processes``: the GPUs of one node); accelerate gets the
    total ``num_processes · num_machines``. One process in all: a plain single-process launch (GPU if
    present, else CPU). Several: ``--multi_gpu``, which on a CPU-only machine gives real gloo ranks because
    the training script builds ``Accelerator(cpu=not torch.cuda.is_available())`` (plain ``--cpu`` would
    silently run ONE process), on the given port or one free now. Several machines add ``--machine_rank``/``--main_process_ip``/
    ``--main_process_port`` (static rendezvous, torchrun ``--nnodes``); see :func:`launch_topology`.

    Raises:
        ValueError: several machines without a main process address, or a rank outside [0, num_machines).
    """
    total = int(num_processes) * int(num_machines)
    args = [
        "--num_machines",
        str(num_machines),
        "--num_processes",
        str(total),
        "--mixed_precision",
        mixed_precision,
        "--dynamo_backend",
        "no",
    ]
    if num_machines > 1:
        if not main_process_ip:
            raise ValueError(
                "multi-node training needs the main machine's address (train.main_process_ip, "
                "$DFLASH_MAIN_PROCESS_IP, or a SLURM allocation)"
            )
        if not 0 <= machine_rank < num_machines:
            raise ValueError(f"machine rank {machine_rank} is outside 0..{num_machines - 1}")
        args += [
            "--machine_rank",
            str(machine_rank),
            "--main_process_ip",
            str(main_process_ip),
            "--main_process_port",
            str(main_process_port or 29500),
        ]
    elif main_process_port or total > 1:
        # one machine, several ranks: a port free now, not torchrun's fixed 29500, which a second job on
        # this host (or a run still ending) holds
        args += ["--main_process_port", str(main_process_port or free_port())]
    if total > 1:
        args = ["--multi_gpu"] + args
    return args


def job_label(log_path: str | os.PathLike) -> str:
    """``results/logs/tokenize_completions/gsm8k/00000.log`` -> ``tokenize_completions gsm8k/00000``."""
    parts = Path(log_path).with_suffix("").parts
    if "logs" in parts:
        parts = parts[len(parts) - parts[::-1].index("logs") :]
    return " ".join(filter(None, [parts[0] if parts else "", "/".join(parts[1:])]))


class _ConsoleTee:
    """A text stream writing everything to the log file and echoing lines with :data:`CONSOLE_PREFIXES` to
    the console, prefixed with the job label."""

    def __init__(self, fh, term, label: str):
        self.fh, self.term, self.label, self.buf = fh, term, label, ""

    def write(self, s: str) -> int:
        self.fh.write(s)
        self.buf += s
        *lines, self.buf = self.buf.replace("\r", "\n").split("\n")  # tqdm redraws with \r
        for line in lines:
            if line.startswith(CONSOLE_PREFIXES):
                self.term.write(f"[{self.label}] {line}\n")
                self.term.flush()
        return len(s)

    def flush(self) -> None:
        self.fh.flush()

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):  # fileno, encoding, ... of the log file
        return getattr(self.fh, name)


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM hostlist (``SLURM_JOB_NODELIST``): ``gpu[03-05,9],cpu1`` → ``gpu03``
    (what ``scontrol show hostnames … | head -n1`` prints; no scontrol call, so it is a pure function).

    Raises:
        ValueError: an empty or malformed list.
    """
    import re

    m = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]+)\])?([^,]*)", nodelist or "")
    if not m or not m.group(1):
        raise ValueError(f"cannot read a host from SLURM nodelist {nodelist!r}")
    prefix, ranges, suffix = m.group(1), m.group(2), m.group(3) or ""
    if not ranges:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


@dataclass(frozen=True)
class LaunchTopology:
    """Where this launcher sits: ``num_machines`` nodes × ``processes_per_machine``; this one is
    ``machine_rank``; rank 0 listens on ``main_process_ip:main_process_port``."""

    num_machines: int
    machine_rank: int
    processes_per_machine: int
    main_process_ip: Optional[str]
    main_process_port: Optional[int]
    source: str  # "config", "env" or "slurm": where the machine count and rank came from

    def launch_args(self, mixed_precision: str = "no") -> list[str]:
        """:func:`accelerate_launch_args` for this topology."""
        return accelerate_launch_args(
            self.processes_per_machine,
            mixed_precision,
            num_machines=self.num_machines,
            machine_rank=self.machine_rank,
            main_process_ip=self.main_process_ip,
            main_process_port=self.main_process_port,
        )


def launch_topology(train_cfg: dict, env: Optional[dict] = None) -> LaunchTopology:
    """Resolve the multi-node layout on the machine that runs the launcher (pure: reads only ``env``).

    Machine count: ``train.num_machines``; null = the SLURM allocation's node count
    (``SLURM_JOB_NUM_NODES``/``SLURM_NNODES``) inside one, else 1. Rank: ``$DFLASH_MACHINE_RANK``, else
    ``SLURM_NODEID`` inside an allocation (one launcher per node: ``srun --ntasks-per-node=1``), else 0
    on a single machine. Main address: ``train.main_process_ip``, else ``$DFLASH_MAIN_PROCESS_IP``, else the
    allocation's first host; port ``train.main_process_port`` (``$DFLASH_MAIN_PROCESS_PORT`` overrides).

    Raises:
        ValueError: several machines and no rank or no main address, naming what to set; a SLURM
            allocation with a different node count than ``train.num_machines``.
    """
    env = dict(os.environ if env is None else env)
    train_cfg = {**schema_defaults("train"), **train_cfg}  # a partial section (tests): the schema's defaults
    slurm_nodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    in_slurm = bool(env.get("SLURM_JOB_ID")) and bool(slurm_nodes)
    configured = train_cfg["num_machines"]
    source = "config"
    if configured is None:
        num_machines, source = (int(slurm_nodes), "slurm") if in_slurm else (1, "config")
    else:
        num_machines = int(configured)
        if in_slurm and num_machines > 1 and int(slurm_nodes) != num_machines:
            raise ValueError(
                f"train.num_machines is {num_machines} but the SLURM allocation has {slurm_nodes} node(s) "
                f"(SLURM_JOB_ID {env.get('SLURM_JOB_ID')}); set it to null to follow the allocation"
            )
    rank = 0
    if num_machines > 1:
        if env.get("DFLASH_MACHINE_RANK") not in (None, ""):
            rank, source = int(env["DFLASH_MACHINE_RANK"]), "env"
        elif in_slurm and env.get("SLURM_NODEID") not in (None, ""):
            rank, source = int(env["SLURM_NODEID"]), "slurm"
        else:
            raise ValueError(
                f"train.num_machines is {num_machines}: set DFLASH_MACHINE_RANK on each machine "
                f"(0 on the main one) or run inside a SLURM allocation (srun --ntasks-per-node=1)"
            )
    ip = train_cfg["main_process_ip"] or env.get("DFLASH_MAIN_PROCESS_IP")
    if not ip and num_machines > 1 and in_slurm:
        ip = first_slurm_host(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    port = env.get("DFLASH_MAIN_PROCESS_PORT") or train_cfg["main_process_port"]
    return LaunchTopology(
        num_machines=num_machines,
        machine_rank=rank,
        processes_per_machine=int(train_cfg["num_processes"]),
        main_process_ip=ip,
        main_process_port=int(port) if port else None,
        source=source,
    )


def run_accelerate(argv: list[str]) -> int:
    """``python -m dflash_pipeline.workflow launch TRAIN_JSON -- ARGS…``: resolve :func:`launch_topology`
    here (on this machine, at run time) and run ``accelerate launch <topology args> ARGS…``."""
    import json
    import subprocess

    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m dflash_pipeline.workflow launch TRAIN_CONFIG_JSON -- ARGS...", file=sys.stderr)
        return 2
    cfg = json.loads(argv[0])
    topo = launch_topology(cfg)
    args = topo.launch_args({**schema_defaults("train"), **cfg}["mixed_precision"])
    print(
        f"[launch] machines={topo.num_machines} rank={topo.machine_rank} ({topo.source}) main={topo.main_process_ip}:"
        f"{topo.main_process_port} processes/machine={topo.processes_per_machine}",
        file=sys.stderr,
        flush=True,
    )
    from dflash_pipeline.features import colocated_servers

    with colocated_servers(argv[2:]):  # train.target_features: stream without endpoints: servers beside the trainer
        return subprocess.call([sys.executable, "-m", "accelerate.commands.launch", *args, *argv[2:]])


@contextlib.contextmanager
def log_to(path: Optional[str | os.PathLike], threads: Optional[int] = None) -> Iterator[None]:
    """Send stdout/stderr and the ``logging`` root to ``path`` (a Snakemake ``log:`` file) for a block,
    and cap torch's intra-op threads at ``threads`` (the rule's ``threads``).

    What a user needs to see while it works still reaches the console (the stderr of the job, which
    Snakemake shows): :func:`console` records and printed lines starting with :data:`CONSOLE_PREFIXES`,
    as ``[<rule> <wildcards>] <line>``."""
    if threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(int(threads))
    if not path:
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    term = sys.stderr
    label = job_label(path)
    with open(path, "w", encoding="utf-8", buffering=1) as fh:
        handler = logging.StreamHandler(fh)
        to_console = logging.StreamHandler(term)
        to_console.setFormatter(logging.Formatter(f"[{label}] %(message)s"))
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        logging.getLogger(CONSOLE_LOGGER).addHandler(to_console)
        tee = _ConsoleTee(fh, term, label)
        with contextlib.redirect_stdout(tee), contextlib.redirect_stderr(tee):
            try:
                yield
            except BaseException:
                import traceback

                traceback.print_exc(file=fh)  # the log shows the failure, not an empty file
                raise
            finally:
                logging.getLogger().removeHandler(handler)
                logging.getLogger(CONSOLE_LOGGER).removeHandler(to_console)


def tee_log(argv: list[str], stdin=None, term=None) -> int:
    """``CMD 2>&1 | python -m dflash_pipeline.workflow tee LOG``: copy a shell rule's output to its log file
    and echo the :data:`CONSOLE_PREFIXES` lines (``[train] step ...``) to the console. Returns 0 (the
    pipeline's status is the command's: Snakemake runs shell rules with ``pipefail``)."""
    stdin = sys.stdin if stdin is None else stdin
    term = sys.stderr if term is None else term
    Path(argv[0]).parent.mkdir(parents=True, exist_ok=True)
    with open(argv[0], "w", encoding="utf-8", buffering=1) as fh:
        tee = _ConsoleTee(fh, term, job_label(argv[0]))
        for line in stdin:
            tee.write(line)
    return 0


# --- GPUs -------------------------------------------------------------------------------------------
# Snakemake counts a `gpu` resource but never says *which* devices a job gets. SLURM (`--gpus=N`) and the
# ssh profile (cluster/ssh_submit.py) export CUDA_VISIBLE_DEVICES per job; for local runs `claim_gpus`
# picks free devices with host-local lock files, so two concurrent GPU jobs never share one.
# One way for every GPU rule: `job_gpus` decides its `resources.gpu`, and `claim_gpus` claims them. The
# script rules (generate_completions, evaluate_acceptance, evaluate_engine) call it as a context manager;
# the shell rules (train_drafter, extract_features: `accelerate launch` and the vLLM environment's python
# need the devices before they start) call the same function through this module's command line,
# `python -m dflash_pipeline.workflow gpus N -- CMD`. Two call sites, one function: a script rule cannot
# wrap its own interpreter, and a shell rule has no Python to open a context in.

#: Rules that run models on GPUs when the run is a GPU run (see `job_gpus`).
GPU_RULES = ("train_drafter", "evaluate_acceptance", "generate_completions", "evaluate_engine")


def job_gpus(config: dict, rule: str) -> int:
    """GPUs one job of ``rule`` asks for (the rule's ``gpu`` resource; SLURM maps it to ``--gpus=N``).

    A run is a GPU run when ``train.mixed_precision`` is not ``"no"`` (bf16/fp16 are GPU settings; CPU
    runs use fp32), unless ``train.device: cpu`` (bf16 on a CPU box: no GPU claimed). Then training takes ``train.num_processes`` GPUs (one per accelerate process), eval one,
    and in-process generation (``generation.backend: transformers``) one; server-backed generation none.
    ``extract_features`` takes ``features.gpus`` whatever the run's precision (0 = CPU).
    Override per rule with ``--set-resources RULE:gpu=N`` (or ``set-resources`` in a profile).
    """
    if rule == "extract_features":
        return int(config["features"]["gpus"])
    if config["train"]["mixed_precision"] == "no" or config["train"]["device"] == "cpu" or rule not in GPU_RULES:
        return 0
    if rule == "train_drafter":  # + the colocated feature servers' GPUs (train.target_features: stream)
        stream = (config.get("features") or {}).get("stream") or {}  # partial configs have none
        colocated = config["train"].get("target_features") == "stream" and not stream.get("endpoints")
        return int(config["train"]["num_processes"]) + (
            int(stream.get("servers", 1)) * int(stream.get("gpus_per_server", 0)) if colocated else 0
        )
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
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=60
    )
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


@contextlib.contextmanager
def claim_gpus(
    n: int,
    *,
    pool: Optional[list[str]] = None,
    lock_dir: Optional[str | os.PathLike] = None,
    poll_s: float = 2.0,
    timeout_s: Optional[float] = None,
) -> Iterator[list[str]]:
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
    """``python -m dflash_pipeline.workflow gpus N -- CMD …``: run CMD holding N GPUs (see `claim_gpus`);
    also ``launch TRAIN_CONFIG_JSON -- ARGS`` (:func:`run_accelerate`) and ``tee LOG`` (:func:`tee_log`).
    Returns CMD's exit status; 0 with the usage lines for ``-h``/``--help``, 2 with them for anything else."""
    import subprocess

    argv = list(sys.argv[1:] if argv is None else argv)
    asked = argv[:1] in (["-h"], ["--help"])
    if len(argv) == 2 and argv[0] == "tee":
        return tee_log(argv[1:])
    if argv[:1] == ["launch"]:
        return run_accelerate(argv[1:])
    if len(argv) < 4 or argv[0] != "gpus" or argv[2] != "--":
        print(
            "usage: python -m dflash_pipeline.workflow gpus N -- CMD [ARGS...]\n"
            "       python -m dflash_pipeline.workflow launch TRAIN_CONFIG_JSON -- ARGS...\n"
            "       python -m dflash_pipeline.workflow tee LOG",
            file=sys.stdout if asked else sys.stderr,
        )
        return 0 if asked else 2
    with claim_gpus(int(argv[1])):
        return subprocess.call(argv[3:])


# --- plan-time values -----------------------------------------------------------------------------------
# The rules' input functions and params functions run once per job: a value that is the same for every job
# of a plan (the target dir, the shard list of the manifest) is computed once per process here.


@functools.lru_cache(maxsize=64)
def target_dir_of(target_input: str) -> str:
    """The target directory of a rule's ``target`` input (``params.target``): the demo dir as it is, the
    directory of a real target's ``config.json`` (``/models/qwen/config.json`` -> ``/models/qwen``).
    Every job of a run has the same input, so it is computed once."""
    path = Path(target_input)
    return str(path.parent) if path.name == "config.json" else str(path)


def shard_list(manifest_path: str | os.PathLike) -> list[tuple[str, str]]:
    """``(dataset, shard)`` pairs of the prompts manifest (:func:`dflash_pipeline.prompts.list_shards`),
    parsed once per version of the file (path, inode, mtime, size) however many input functions ask: the
    plan asks once per aggregate rule, each time for every shard. A new list each call.

    Raises:
        FileNotFoundError: no manifest at ``manifest_path``.
    """
    st = os.stat(manifest_path)
    return list(_shard_list(os.fspath(manifest_path), st.st_ino, st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=8)
def _shard_list(path: str, inode: int, mtime_ns: int, size: int) -> tuple[tuple[str, str], ...]:
    from dflash_pipeline.prompts import list_shards

    return tuple(list_shards(path))


# --- rerun policy -------------------------------------------------------------------------------------
# Snakemake's params trigger compares the repr of every `params` value with the one recorded when the
# output was made, so what a param holds (and how it is written) decides what reruns. The rules draw
# those values from here, so the policy has unit tests (tests/unit/workflow/test_workflow.py) besides the e2e runs.

#: generation keys that change what is generated: the generate_completions rerun trigger (params). The
#: others (endpoints, concurrency, client_processes, timeouts, retries, breaker, batch_size) are
#: operational: adding a server or raising a timeout must not regenerate finished shards, so the script
#: reads them from the config.
GENERATION_OUTPUT_KEYS = (
    "backend",
    "api",
    "model",
    "thinking",
    "temperature",
    "top_p",
    "top_k",
    "max_tokens",
    "seed",
    "extra_body",
)

#: Baseline drafters (config `eval.baselines`) train as run `<run>.<baseline>` with these train.py flags.
BASELINE_TRAIN_FLAGS = {"zero_features": "--zero-target-features"}


def canonical(obj, keep_order: bool = False):
    """``obj`` with the keys of every mapping sorted, recursively. Snakemake's params rerun trigger compares
    ``repr``s, so without this the key order of a YAML file (or of a config written by a script) would
    rerun jobs. ``keep_order`` keeps the top level in config order where it means something
    (``datasets``: the first source wins a duplicate; ``eval.sets``: the order of the eval table)."""
    if isinstance(obj, dict):
        items = obj.items() if keep_order else sorted(obj.items(), key=lambda kv: str(kv[0]))
        return {k: canonical(v) for k, v in items}
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    return obj


def as_json(obj) -> str:
    """``obj`` as JSON with sorted keys (a param handed to a shell command as one argument)."""
    import json

    return json.dumps(obj, sort_keys=True)


#: Keys added after results directories existed whose default changes no output the rule's params fingerprint:
#: left out of the params while at their default, so those directories rerun nothing (the code reading the
#: section fills the schema default back in).
LEFT_OUT_AT_DEFAULT = {
    "eval": ("context_length_buckets",),
    "train": ("validation_length_buckets", "optimizer", "gradient_checkpointing", "loss_chunk_tokens"),
}


def without_new_defaults(section: str, values: dict) -> dict:
    """``values`` (a validated config section) without the :data:`LEFT_OUT_AT_DEFAULT` keys of ``section``
    that hold their schema default."""
    from dflash_pipeline.core.config import schema_default

    drop = {k for k in LEFT_OUT_AT_DEFAULT.get(section, ()) if k in values and values[k] == schema_default(section, k)}
    return {k: v for k, v in values.items() if k not in drop}


def generation_output_params(gen: dict) -> dict:
    """The output-affecting subset of a validated ``generation`` section (:data:`GENERATION_OUTPUT_KEYS`;
    ``api`` only when not its default, so configs from before the key existed rerun nothing),
    canonical."""
    from dflash_pipeline.core.config import schema_default

    out = {k: gen[k] for k in GENERATION_OUTPUT_KEYS if k in gen}
    if out.get("api") == schema_default("generation", "api"):
        del out["api"]
    return canonical(out)


def baseline_runs(run: str, baselines) -> dict[str, str]:
    """Label -> run name of each baseline drafter of ``run``: ``{"zero_features": "demo.zero_features"}``."""
    return {b: f"{run}.{b}" for b in baselines}


def baseline_train_flags(run: str) -> str:
    """Extra train.py flags for a baseline run name (``demo.zero_features``), "" for a regular run."""
    base, _, suffix = run.rpartition(".")
    return BASELINE_TRAIN_FLAGS.get(suffix, "") if base else ""


#: Revision of the token-shard bytes, the ``code`` param of rules/tokens.smk: a new value re-tokenizes every
#: workdir (and so retrains and re-evaluates), never regenerates completions. ``"10a26998a0e76dbe"`` is the
#: code fingerprint (sha256 of the sources of tokens.py, spans.py, chat.py, shards.py and contracts.py's
#: token-shard part) that wrote the token shards of every existing workdir. Bump it (to any new value)
#: whenever a change alters the bytes of a token shard (in those modules or in loss_masks.py, split out of
#: tokens.py since); a change that keeps them (a refactor, a docstring, a new helper) keeps it, so no
#: workdir reruns. A tokenizers/transformers upgrade that alone changes the bytes is not a bump: existing
#: workdirs keep the shards they have (as before), and the golden is regenerated. ``tests/unit/tokens/test_tokenization_golden.py`` guards it: it
#: tokenizes fixed conversations with several chat templates and fails when their token shards differ
#: from the golden made at this revision (it says how to regenerate). Revisions: ``"10a26998a0e76dbe"`` (the
#: first); ``"7476b443b5dd66cc"``: the shard metadata's ``server_ids_used`` counts the turns (rows) built from the
#: server's token ids, not the records; token ids and loss masks are unchanged. ``"3b1f0c9e5a7d2e48"``: an
#: answer whose text holds a control-token string the model could emit as one token (``<think>``,
#: ``<tool_call>``, ...) and that has no output ids is refused (``markup_without_ids`` drop reason in the
#: shard metadata) instead of being supervised as text pieces; records with tool calls render with ``tools``.
TOKENIZATION_REVISION = "3b1f0c9e5a7d2e48"


if __name__ == "__main__":
    sys.exit(run_with_gpus())
