"""Colocated streaming: start `features.stream.servers` feature servers, run the trainer, stop them.

`python -m dflash_pipeline.features colocate --stream-config JSON --probe P --target DIR -- CMD...` runs a
`train.target_features: stream` job without `features.stream.endpoints`: the first
`servers * gpus_per_server` of the job's GPUs go to the servers, the rest to the trainer, which gets the
endpoints in `$DFLASH_STREAM_ENDPOINTS`; the servers stop when it exits. A server that dies before it is
ready fails the job with its log tail. The servers share a random per-job key, passed only through the
environment (`$DFLASH_FEATURES_API_KEY` / `$VLLM_API_KEY`; the trainer's `$DFLASH_STREAM_API_KEY`).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from dflash_pipeline.core.errors import strip_url_credentials as redact_url
from dflash_pipeline.core.procs import free_port

#: The variable a feature server (`features serve`) reads its key from, and colocated servers are given theirs in.
DEFAULT_API_KEY_ENV = "DFLASH_FEATURES_API_KEY"

#: The variable the trainer reads its colocated endpoints from (JSON list of endpoint dicts).
ENDPOINTS_ENV = "DFLASH_STREAM_ENDPOINTS"
#: The variable holding the colocated servers' per-job API key on the trainer's side.
STREAM_KEY_ENV = "DFLASH_STREAM_API_KEY"


def split_gpus(visible: str | None, servers: int, per_server: int) -> tuple[list[str], str]:
    """`(each server's CUDA_VISIBLE_DEVICES, the trainer's)` from the job's `visible` devices.

    Raises ValueError when the job has fewer GPUs than the servers need."""
    devs = [d for d in (visible or "").split(",") if d.strip()]
    need = servers * per_server
    if per_server and len(devs) < need:
        raise ValueError(
            f"features.stream: {servers} servers x {per_server} GPUs need {need} GPUs, the job has "
            f"{len(devs)} (CUDA_VISIBLE_DEVICES={visible!r})"
        )
    per = (
        [",".join(devs[i * per_server : (i + 1) * per_server]) for i in range(servers)]
        if per_server
        else [""] * servers
    )
    return per, ",".join(devs[need:]) if per_server else (visible or "")


def hf_server_cmd(
    python: str,
    *,
    target: str,
    probe: dict,
    stream: dict,
    scratch: Path,
    url_file: Path,
    gpus: int,
    target_dtype: str,
    trust_remote_code: bool,
    max_len: int | None = None,
) -> list[str]:
    """The command line of one hf feature server (`.server`); its key comes through the environment."""
    ids = ",".join(str(i) for i in probe["drafter"]["target_layer_ids"])
    cmd = [
        python,
        "-m",
        "dflash_pipeline.features",
        "serve",
        "--target",
        target,
        "--layer-ids",
        ids,
        "--num-hidden-layers",
        str(probe["num_hidden_layers"]),
        "--scratch-dir",
        str(scratch),
        "--url-file",
        str(url_file),
        "--gpus",
        str(gpus),
        "--target-dtype",
        target_dtype,
    ]
    if max_len:
        cmd += ["--max-len", str(int(max_len))]
    if stream.get("last_hidden"):
        cmd.append("--last-hidden")
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd


def _wait_ready(procs, url_files, logs, timeout_s: float) -> list[str]:
    urls: list[str | None] = [None] * len(procs)
    deadline = time.monotonic() + timeout_s
    while any(u is None for u in urls):
        for i, (p, f) in enumerate(zip(procs, url_files)):
            if urls[i] is not None:
                continue
            if p.poll() is not None:
                tail = Path(logs[i]).read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"feature server {i} exited with {p.returncode} before it was ready; its log "
                    f"{logs[i]} ends:\n{tail}"
                )
            if f.is_file():
                urls[i] = f.read_text().strip()
        if time.monotonic() > deadline:
            raise RuntimeError(f"feature servers not ready after {timeout_s:.0f} s (logs: {', '.join(map(str, logs))})")
        time.sleep(0.2)  # polling the servers' readiness files (no event to wait on across processes)
    return urls  # type: ignore[return-value]


def _vllm_url_when_ready(url: str, proc, log: Path, timeout_s: float, api_key: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM feature server exited with {proc.returncode}; its log {log} ends:\n"
                f"{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/models", headers=headers), timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM feature server {url} not ready after {timeout_s:.0f} s (log {log})")
        time.sleep(0.5)  # polling the server's readiness (GET /models) as vllm serve offers no other signal


def stop(procs: Sequence[subprocess.Popen], grace_s: float = 20.0) -> None:
    """SIGTERM each server (its process group), then SIGKILL after `grace_s`."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def vllm_server_cmd(
    python: str,
    *,
    target: str,
    probe: dict,
    stream: dict,
    scratch: Path,
    port: int,
    gpus: int,
    target_dtype: str,
    trust_remote_code: bool,
    max_len: int,
) -> list[str]:
    """`vllm serve` with `extract_hidden_states` and the hidden-states connector (vLLM's on GPUs, our
    CPU-safe one on CPU), prefix caching and chunked prefill off, aux layers as `.vllm_backend`."""
    from dflash_pipeline.target.layer_ids import aux_hidden_state_ids

    from .vllm_backend import hidden_states_engine_config

    aux = aux_hidden_state_ids(
        probe["drafter"]["target_layer_ids"], probe["num_hidden_layers"], bool(stream.get("last_hidden"))
    )
    spec, kv = hidden_states_engine_config(aux, scratch, cuda=bool(gpus))
    vopts = stream.get("vllm") or {}
    dtype = {"auto": "float32" if not gpus else "bfloat16"}.get(target_dtype, target_dtype)
    raw = json.loads((Path(target) / "config.json").read_text(encoding="utf-8"))
    limit = (raw.get("text_config") or raw).get("max_position_embeddings")
    model_len = min(max_len + 8, int(limit)) if limit else max_len + 8  # a prompt + its one output token
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        target,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(model_len),
        "--no-enable-prefix-caching",
        "--no-enable-chunked-prefill",
        "--speculative-config",
        json.dumps(spec),
        "--kv-transfer-config",
        json.dumps(kv),
        "--tensor-parallel-size",
        str(max(1, gpus)),
        "--served-model-name",
        Path(target).name,
    ]
    if not gpus:
        cmd.append("--enforce-eager")
    if vopts.get("expert_parallel"):
        cmd.append("--enable-expert-parallel")
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    for k, v in (vopts.get("engine_args") or {}).items():
        cmd += [
            f"--{k.replace('_', '-')}",
            str(v) if not isinstance(v, (dict, list)) else json.dumps(v),
        ]
    return cmd


def _server_cmd(
    i: int,
    stream: dict,
    d: Path,
    env: dict,
    *,
    target: str,
    probe: dict,
    gpus: int,
    target_dtype: str,
    trust: bool,
    key: str,
) -> tuple[list[str], str | None, Path | None]:
    """`(command, base_url, url_file)` of feature server `i` of `start_servers` (scratch dir `d`): vLLM on a free
    port, else the hf server, which writes its URL to `url_file` once ready. `env` gets the job's API `key` (never the
    command)."""

    if stream.get("backend") == "vllm":
        port = free_port()
        cmd = vllm_server_cmd(
            stream["vllm"]["python"],
            target=target,
            probe=probe,
            stream=stream,
            scratch=d,
            port=port,
            gpus=gpus,
            target_dtype=target_dtype,
            trust_remote_code=trust,
            max_len=int(stream["max_len"]),
        )
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env["VLLM_API_KEY"] = key
        url, url_file = f"http://127.0.0.1:{port}/v1", None
    else:
        url_file = d.parent / f"server{i}.url"
        url_file.unlink(missing_ok=True)
        cmd = hf_server_cmd(
            sys.executable,
            target=target,
            probe=probe,
            stream=stream,
            scratch=d,
            url_file=url_file,
            gpus=gpus,
            target_dtype=target_dtype,
            trust_remote_code=trust,
            max_len=stream.get("max_len"),
        )
        env[DEFAULT_API_KEY_ENV] = key
        url = None
    return cmd, url, url_file


def start_servers(
    stream: dict,
    *,
    probe: dict,
    target: str,
    target_dtype: str = "auto",
    trust_remote_code: bool = False,
    timeout_s: float = 1800.0,
) -> tuple[list, list[dict]]:
    """Start `stream["servers"]` feature servers of `stream["backend"]` on this machine and wait until
    each is ready; returns `(processes, endpoints)` (endpoints as `features.stream.endpoints` entries).

    `stream`: the stream settings (`stream_job_config` in rules/common/params.smk): `servers`,
    `gpus_per_server`, `backend`, `scratch_dir`, `max_concurrency`, `last_hidden`, `max_len`,
    `vllm` (`python`, `expert_parallel`, `engine_args`). Every server requires a random key made
    here; it is put into `os.environ[STREAM_KEY_ENV]` and the endpoints name that variable
    (`api_key_env`). Raises RuntimeError (a server died or was not ready in `timeout_s`; names its
    log), ValueError (too few GPUs)."""
    n, per = int(stream["servers"]), int(stream.get("gpus_per_server") or 0)
    per_env, trainer_gpus = split_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), n, per)
    scratch = Path(stream["scratch_dir"]).resolve()
    key = secrets.token_urlsafe(32)
    procs, logs, endpoints = [], [], []
    try:
        for i in range(n):
            d = scratch / f"server{i}"
            if d.is_dir():  # answers a killed job's trainer never read (a SIGKILL leaves its window behind)
                shutil.rmtree(d)
            d.mkdir(parents=True)
            log = scratch / f"server{i}.log"
            env = dict(os.environ)
            if per:
                env["CUDA_VISIBLE_DEVICES"] = per_env[i]
            cmd, url, url_file = _server_cmd(
                i,
                stream,
                d,
                env,
                target=target,
                probe=probe,
                gpus=per,
                target_dtype=target_dtype,
                trust=trust_remote_code,
                key=key,
            )
            with open(log, "wb") as fh:  # the child keeps its own copy of the descriptor
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=fh,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                )
            logs.append(log)
            endpoints.append({"base_url": url, "url_file": url_file})
        for i, (p, ep) in enumerate(zip(procs, endpoints)):
            if ep["url_file"] is None:
                _vllm_url_when_ready(ep["base_url"], p, logs[i], timeout_s, key)
            else:
                ep["base_url"] = _wait_ready([p], [ep["url_file"]], [logs[i]], timeout_s)[0]
    except BaseException:
        stop(procs)
        raise
    eps = [
        {
            "base_url": e["base_url"],
            "max_concurrency": int(stream.get("max_concurrency") or 4),
            "transport": "path",
            "api_key_env": STREAM_KEY_ENV,
        }
        for e in endpoints
    ]
    os.environ[STREAM_KEY_ENV] = key  # the trainer's side; inherited by the ranks it launches
    if per:
        os.environ["CUDA_VISIBLE_DEVICES"] = trainer_gpus
    return procs, eps


def _arg(args: Sequence[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


@contextlib.contextmanager
def colocated_servers(trainer_args: Sequence[str]):
    """Around the trainer's launch: when its arguments carry `--stream-config` without endpoints, start the servers,
    put their endpoints into `$DFLASH_STREAM_ENDPOINTS` for the trainer, and stop them when the block exits. Anything
    else: nothing."""
    raw = _arg(trainer_args, "--stream-config")
    stream = json.loads(raw) if raw else None
    if not stream or stream.get("endpoints"):
        yield []
        return
    probe = json.loads(Path(_arg(trainer_args, "--probe")).read_text(encoding="utf-8"))
    procs, eps = start_servers(
        stream,
        probe=probe,
        target=_arg(trainer_args, "--target"),
        target_dtype=_arg(trainer_args, "--target-dtype") or "auto",
        trust_remote_code="--trust-remote-code" in trainer_args,
    )
    print(
        f"[stream] colocated: {len(eps)} {stream.get('backend', 'hf')} feature server(s) x "
        f"{stream.get('gpus_per_server') or 0} GPU(s) at {', '.join(redact_url(e['base_url']) for e in eps)}",
        flush=True,
    )
    old = os.environ.get(ENDPOINTS_ENV)
    os.environ[ENDPOINTS_ENV] = json.dumps(eps)
    try:
        yield eps
    finally:
        stop(procs)
        os.environ.pop(STREAM_KEY_ENV, None)
        if old is None:
            os.environ.pop(ENDPOINTS_ENV, None)
        else:
            os.environ[ENDPOINTS_ENV] = old


def run_colocated(a) -> int:
    """`colocate` CLI: servers up, the trainer (`a.cmd`) with `$DFLASH_STREAM_ENDPOINTS`, servers down;
    returns the trainer's exit status."""
    stream = json.loads(a.stream_config)
    probe = json.loads(Path(a.probe).read_text(encoding="utf-8"))
    procs, eps = start_servers(
        stream,
        probe=probe,
        target=a.target,
        target_dtype=a.target_dtype,
        trust_remote_code=a.trust_remote_code,
    )
    print(
        f"[stream] colocated: {len(eps)} {stream.get('backend', 'hf')} feature server(s) x "
        f"{stream.get('gpus_per_server') or 0} GPU(s) at {', '.join(redact_url(e['base_url']) for e in eps)}",
        flush=True,
    )
    try:
        cmd = [c for c in a.cmd if c != "--"] if a.cmd and a.cmd[0] == "--" else list(a.cmd)
        return subprocess.call(cmd, env={**os.environ, ENDPOINTS_ENV: json.dumps(eps)})
    finally:
        stop(procs)
