"""Every result names what made it (dflash_pipeline.core.provenance): software, kernels, device, dtype, and the
target's digest; the report header shows it in one line."""

from __future__ import annotations

import importlib.metadata
import json

from conftest import SHIPPED_DEMO_TARGET

from dflash_pipeline.core.provenance import DIGEST_MAX_BYTES, provenance, provenance_line, target_digest


def test_provenance_names_software_kernels_device_and_target(monkeypatch):
    import torch
    import transformers

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    prov = provenance(target_dir=SHIPPED_DEMO_TARGET, device="cpu", dtype="float32", extra_packages=["no-such-dist"])
    assert prov["packages"]["torch"] == importlib.metadata.version("torch")
    assert prov["packages"]["transformers"] == transformers.__version__
    assert {"accelerate", "snakemake", "dflash-pipeline"} <= set(prov["packages"])
    assert prov["packages"]["no-such-dist"] is None
    assert prov["kernel_env"] == {"ATEN_CPU_CAPABILITY": "avx2"} and prov["torch_threads"] == torch.get_num_threads()
    assert prov["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert prov["device"] == "cpu" and prov["dtype"] == "float32"
    digest = prov["target"]["digest"]
    assert digest["weights"] is True and len(digest["sha256"]) == 64 and digest["files"] >= 6
    json.dumps(prov)  # a JSON field of every result
    line = provenance_line(prov)
    assert f"transformers {transformers.__version__}" in line and f"target sha256 {digest['sha256'][:12]}" in line
    assert "cpu (" in line and "float32" in line


def test_target_digest_follows_the_bytes_not_the_build_facts(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * 64)
    (d / "demo_target.json").write_text('{"seconds": 1}')
    first = target_digest(d)
    (d / "demo_target.json").write_text('{"seconds": 2}')  # build timings: not the target
    (d / "LICENSE-data").write_text("text")
    assert target_digest(d) == first
    (d / "model.safetensors").write_bytes(b"\1" * 64)
    assert target_digest(d)["sha256"] != first["sha256"]
    assert target_digest(tmp_path / "missing") is None


def test_a_large_target_is_digested_by_its_metadata(tmp_path, monkeypatch):
    import dflash_pipeline.core.provenance as P

    d = tmp_path / "big"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    (d / "model-00001.safetensors").write_bytes(b"\0" * (2 << 20))
    monkeypatch.setattr(P, "DIGEST_MAX_BYTES", 1 << 20)
    big = target_digest(d)
    assert big["weights"] is False and big["files"] == 1
    assert DIGEST_MAX_BYTES >= 64 << 20  # the shipped demo target (7 MB) is digested whole
