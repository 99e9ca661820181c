"""The serving engine as users run it: a vLLM OpenAI server with (or without) our drafter, and the launch
lines written beside every export.

* `VLLMServer` runs `vllm.entrypoints.openai.api_server` in vLLM's environment, waits for `/v1/models`,
  logs its output and stops its process group on exit; on CPU it adds `--enforce-eager` and
  `VLLM_CPU_KVCACHE_SPACE=1` (GiB) unless set (`reference/feasibility.md` §9).
* `dflash_speculative_config`: vLLM ignores the checkpoint's `block_size` and needs
  `num_speculative_tokens = block_size − 1` (dflash.md §8.4).
* `serve_commands` / `write_serve_md`: the vLLM and SGLang launch lines of an export (`final/serve.md`).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Optional, Sequence

from dflash_pipeline.core.errors import PipelineError
from dflash_pipeline.core.procs import end_process_group, free_port
from dflash_pipeline.core.vllm_env import require_vllm_python
from dflash_pipeline.drafter import families as FR


class EngineError(PipelineError):
    """The serving engine did not start, died, or answered something unusable."""


def dflash_speculative_config(drafter_dir: str | Path, block_size: int) -> dict:
    """vLLM's `--speculative-config` for a DFlash drafter export (dflash.md §8.4, feasibility.md §9): the default
    family's (`drafter.dflash.DFlashFamily.speculative_config`).

    `num_speculative_tokens` = `block_size − 1`: the block's slot 0 is the bonus token, the other
    `block_size − 1` slots are the drafts (vLLM reads no `block_size` from the checkpoint).

    Raises:
        BlockSizeError (a ValueError): `block_size` < 2 (`check_block_size`).
    """
    return FR.default().speculative_config(drafter_dir, block_size)


def drafter_speculative_config(drafter_dir: str | Path, block_size: int) -> dict:
    """`--speculative-config` of the export in `drafter_dir`, by its family
    (`drafter.dflash.DFlashFamily.speculative_config`)."""
    return FR.of_checkpoint(drafter_dir).speculative_config(drafter_dir, block_size)


def _family_env(drafter_dir: Optional[str | Path]) -> dict:
    """The server environment the drafter's family needs (the V2 model runner for DFlash2 / DSpark)."""
    return FR.of_checkpoint(drafter_dir).engine_env() if drafter_dir else {}


def _cpu_only() -> bool:
    """True when no CUDA device is visible here (then vLLM is the CPU build: eager mode, small KV cache)."""
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:  # pragma: no cover - the project always has torch
        return True


def http_get(url: str, *, timeout_s: float = 10.0, api_key: Optional[str] = None) -> str:
    """GET `url` → body text. Raises `urllib.error.URLError`/`HTTPError` as urllib does."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
        return resp.read().decode("utf-8")


class VLLMServer:
    """One vLLM OpenAI-compatible server process serving `model` (a target directory), optionally with
    a DFlash `drafter` (an export directory) as speculative decoder.

    Use as a context manager (`with VLLMServer(...) as srv: srv.base_url`) or `start()`/`stop()`.
    `extra_args` are appended to the command line (e.g. `["--dtype", "float32", "--reasoning-parser",
    "qwen3"]`). The engine's stdout and stderr go to `log_path` (appended; a start failure quotes its
    tail). The server runs in its own session, so `stop` ends the API server and its engine-core
    process together.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        log_path: str | Path,
        drafter: Optional[str | Path] = None,
        block_size: Optional[int] = None,
        extra_args: Sequence[str] = (),
        chat_template: Optional[str | Path] = None,
        served_model_name: Optional[str] = None,
        python: Optional[str] = None,
        host: str = "127.0.0.1",
        port: Optional[int] = None,
        env: Optional[Mapping[str, str]] = None,
    ):
        if drafter is not None and block_size is None:
            raise ValueError("a DFlash drafter needs its block_size (num_speculative_tokens = block_size - 1)")
        self.model = str(model)
        self.drafter = None if drafter is None else str(drafter)
        self.block_size = block_size
        self.extra_args = [str(a) for a in extra_args]
        self.chat_template = None if chat_template is None else str(chat_template)
        self.served_model_name = served_model_name
        self.python = python
        self.host = host
        self.port = port
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.proc: Optional[subprocess.Popen] = None
        self.started_s: Optional[float] = None

    @property
    def base_url(self) -> str:
        """OpenAI base URL, `http://host:port/v1`."""
        return f"http://{self.host}:{self.port}/v1"

    @property
    def metrics_url(self) -> str:
        """Prometheus endpoint, `http://host:port/metrics`."""
        return f"http://{self.host}:{self.port}/metrics"

    def argv(self, python: str) -> list[str]:
        """The server's command line (`python` is the vLLM environment's interpreter)."""
        cmd = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.chat_template:
            cmd += ["--chat-template", self.chat_template]
        if self.drafter is not None:
            cmd += ["--speculative-config", json.dumps(drafter_speculative_config(self.drafter, int(self.block_size)))]
        if _cpu_only() and "--enforce-eager" not in self.extra_args:
            cmd.append("--enforce-eager")
        return cmd + self.extra_args

    def start(self, timeout_s: float = 600.0) -> "VLLMServer":
        """Start the server and wait until `GET /v1/models` answers 200 (polled every 0.5 s).

        Raises:
            VLLMNotFound: no vLLM environment.
            EngineError: the process exited, or was not ready within `timeout_s` (it is stopped); the
                message quotes the end of the engine log.
        """
        if self.proc is not None:
            return self
        python = require_vllm_python(self.python)
        if self.port is None:
            self.port = free_port(self.host)
        env = {**os.environ, **_family_env(self.drafter), **self.env}
        if _cpu_only():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.argv(python)
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"$ {shlex.join(cmd)}\n")
            log.flush()
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.proc = None
                raise EngineError(
                    f"vLLM exited with status {code} while starting ({shlex.join(cmd)}); "
                    f"end of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                http_get(f"{self.base_url}/models", timeout_s=5.0)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(
                    f"vLLM not ready after {timeout_s:.0f} s at {self.base_url}; end of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)
        self.started_s = time.monotonic() - t0
        return self

    def alive(self) -> bool:
        """Whether the server process is running."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group (the engine-core child shares it); SIGKILL what is left after
        `timeout_s`. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            end_process_group(proc, timeout_s)

    def log_tail(self, n_chars: int = 4000) -> str:
        """The last `n_chars` characters of the engine log ('' when there is none)."""
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-n_chars:]
        except FileNotFoundError:
            return ""

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def loop_dtype(target_dtype: str) -> str:
    """The dtype our speculative loop runs the target in for `target.dtype` = `target_dtype` on this machine, as
    vLLM's `--dtype` value (`float32`, `bfloat16`, `float16`)."""
    import torch

    from dflash_pipeline.target.loading import resolve_dtype

    return str(resolve_dtype(target_dtype, "cuda" if torch.cuda.is_available() else "cpu")).replace("torch.", "")


def served_dtype_of_log(log_text: str) -> Optional[str]:
    """The dtype vLLM says it serves in its start-up log, None when the log does not say."""
    import re

    found = re.findall(r"\bdtype=torch\.(\w+)", log_text)
    return found[-1] if found else None


# --- Launch lines of an export (final/serve.md)


def serve_commands(drafter_dir: str | Path, target: str | Path, block_size: int, *, port: int = 8000) -> dict[str, str]:
    """The launch lines that serve the DFlash export `drafter_dir` beside `target` (dflash.md §8.4): `{"vllm": ...,
    "sglang": ...}`, vLLM with `num_speculative_tokens = block_size − 1`, SGLang with `--speculative-num-draft-tokens =
    block_size` (it counts the bonus slot).
    """
    return FR.default().serve_commands(drafter_dir, target, block_size, port=port)


def write_serve_md(
    drafter_dir: str | Path, *, target: Optional[str | Path] = None, served_dir: Optional[str | Path] = None
) -> Path:
    """Write `<drafter_dir>/serve.md`: how to serve this export with vLLM and SGLang, block size and
    target layers read from its `config.json` (atomic). `target`: the target's path or hub id as the
    user passes it to the engine (default: a `<target>` placeholder). `served_dir`: the drafter's path
    in the commands when `drafter_dir` is a temp dir renamed into place afterwards (default: its own).

    Returns the path written. Raises `FileNotFoundError` when the export has no `config.json`
    (`drafter.config.DFlashConfig.from_checkpoint` reads it).
    """
    from dflash_pipeline.core.shards import atomic_write_bytes
    from dflash_pipeline.drafter.config import checkpoint_meta

    d = Path(drafter_dir)
    cfg = FR.load_config(d)
    tgt = str(target) if target is not None else "<target>"
    text = FR.of_config(cfg).serve_md(cfg.to_dict(), checkpoint_meta(d), Path(served_dir or d).resolve(), tgt)
    out = d / "serve.md"
    atomic_write_bytes(out, text.encode("utf-8"))
    return out


def _main(argv: Optional[Sequence[str]] = None) -> None:
    """CLI: `dflash-eval serve-md DRAFTER_DIR [--target T]` (or `python -m dflash_pipeline.evaluate.vllm_server
    serve-md …`) writes serve.md."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dflash_pipeline.evaluate.vllm_server")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve-md", help="write <drafter>/serve.md with the vLLM and SGLang launch lines")
    s.add_argument("drafter")
    s.add_argument("--target")
    a = p.parse_args(argv)
    print(write_serve_md(a.drafter, target=a.target))


if __name__ == "__main__":
    _main()
