"""What made a result: the software, the machine's kernels, the device and dtype, and the target's digest.

Every result file (`train_summary.json`, `acceptance.json`, `engine.json`) carries a `provenance` block from
`provenance`, and the report header shows it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Iterable, Optional

#: Distributions named in every provenance block (None where not installed).
CORE_PACKAGES = ("torch", "transformers", "accelerate", "tokenizers", "safetensors", "snakemake", "dflash-pipeline")

#: Environment variables that choose torch's CPU kernels (ATen's dispatch, MKL, oneDNN) and its threads: the
#: same weights give other float rounding under other kernels, so they belong to a result's provenance.
KERNEL_ENV = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "ONEDNN_MAX_CPU_ISA",
    "OMP_NUM_THREADS",
    "CUBLAS_WORKSPACE_CONFIG",
)

#: Files of a target directory left out of its digest: build facts that hold timings, and licence texts.
_DIGEST_SKIP = ("demo_target.json",)
#: A target directory larger than this is digested by its metadata files only (weights of real targets are
#: tens of GB; their config and tokenizer still tell two targets apart).
DIGEST_MAX_BYTES = 256 * 2**20


def package_versions(names: Iterable[str] = CORE_PACKAGES) -> dict[str, Optional[str]]:
    """`{distribution: version}` from the installed metadata (`None` for one that is not installed)."""
    out: dict[str, Optional[str]] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def target_digest(target_dir: str | os.PathLike) -> Optional[dict]:
    """sha256 over a target directory's files (sorted by relative path; each file's path and bytes), without build
    facts (`demo_target.json`) and `LICENSE*` files. A directory over `DIGEST_MAX_BYTES` is digested over its files
    under 1 MiB only, and says so with `"weights": false`. Returns `{"sha256", "files", "weights"}`, or None for a
    missing directory."""
    root = Path(target_dir)
    if not root.is_dir():
        return None
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.name not in _DIGEST_SKIP and not p.name.startswith("LICENSE") and ".cache" not in p.parts
    )
    total = sum(p.stat().st_size for p in files)
    weights = total <= DIGEST_MAX_BYTES
    if not weights:
        files = [p for p in files if p.stat().st_size < 2**20]
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(root).as_posix().encode("utf-8") + b"\0")
        with open(p, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return {"sha256": h.hexdigest(), "files": len(files), "weights": weights}


def _torch():
    """torch if this process has imported it (the jobs whose results carry provenance have), else None: reading
    provenance never loads torch into a job that does not use it."""
    return sys.modules.get("torch")


def cpu_capability() -> Optional[str]:
    """The CPU kernel level torch dispatches to (`"AVX512"`, `"AVX2"`, `"DEFAULT"`...), None without torch."""
    torch = _torch()
    try:
        return torch.backends.cpu.get_cpu_capability() if torch is not None else None
    except AttributeError:  # a build without the query
        return None


def provenance(
    *,
    target_dir: str | os.PathLike | None = None,
    device: str | None = None,
    dtype: str | None = None,
    extra_packages: Iterable[str] = (),
    engine: dict | None = None,
) -> dict:
    """The provenance block of a result.

    Args:
        target_dir: the target the result was made with; its `target_digest` is recorded.
        device: the device the result was computed on (`"cpu"`, `"cuda:0"`...).
        dtype: the compute dtype (`"float32"`, `"bfloat16"`...).
        extra_packages: more distributions to name (`vllm`, `sglang` where a job used them).
        engine: facts of a serving engine (name, version) the result came from.

    Returns:
        `{"python", "packages", "platform", "cpu_capability", "torch_threads", "kernel_env", "device",
        "dtype", "target", "engine"?}`; JSON-serialisable.
    """
    torch = _torch()
    threads = torch.get_num_threads() if torch is not None else None
    out = {
        "python": platform.python_version(),
        "packages": package_versions((*CORE_PACKAGES, *extra_packages)),
        "platform": f"{sys.platform}-{platform.machine()}",
        "cpu_capability": cpu_capability(),
        "torch_threads": threads,
        "kernel_env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ},
        "device": device,
        "dtype": dtype,
        "target": None if target_dir is None else {"path": str(target_dir), "digest": target_digest(target_dir)},
    }
    if engine is not None:
        out["engine"] = engine
    return out


def provenance_line(prov: dict) -> str:
    """One line for a report header or a log: `torch 2.13.0, transformers 5.25.0, ... · cpu (AVX512, 2 threads),
    float32 · target sha256 1a2b3c4d5e6f`."""
    pk = prov.get("packages") or {}
    soft = ", ".join(f"{k} {v}" for k, v in pk.items() if v and k != "dflash-pipeline")
    dev = prov.get("device") or "?"
    kern = ", ".join(x for x in (prov.get("cpu_capability"), f"{prov.get('torch_threads')} threads") if x)
    parts = [f"python {prov.get('python')}, {soft}", f"{dev} ({kern}), {prov.get('dtype') or '?'}"]
    digest = ((prov.get("target") or {}).get("digest") or {}).get("sha256")
    if digest:
        parts.append(f"target sha256 {digest[:12]}")
    return " · ".join(parts)
