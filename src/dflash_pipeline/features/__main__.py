"""CLI: ``python -m dflash_pipeline.features extract --probe P --target DIR --token-shard T --out F ...``.

Run by the ``extract_features`` rule with the backend's interpreter (the vLLM venv for ``vllm``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash_pipeline.features", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract", help="write the feature shard of one token shard (resumes a killed run)")
    e.add_argument("--probe", required=True, help="probe record JSON (target_layer_ids, hidden_size, num_hidden_layers)")
    e.add_argument("--target", required=True, help="target model directory")
    e.add_argument("--token-shard", required=True)
    e.add_argument("--out", required=True, help="feature shard path (.safetensors)")
    e.add_argument("--features-config", required=True, help="JSON of the validated `features` config")
    e.add_argument("--target-dtype", default="auto")
    e.add_argument("--gpus", type=int, default=0, help="GPUs of this job (0 = CPU)")
    e.add_argument("--trust-remote-code", action="store_true")
    e.add_argument("--stats", help="write the extraction stats JSON here")
    a = p.parse_args(argv)

    from .extract import extract_shard

    probe = json.loads(Path(a.probe).read_text(encoding="utf-8"))
    cfg = json.loads(a.features_config)
    stats = extract_shard(
        a.token_shard, a.out, target_dir=a.target, target_layer_ids=probe["drafter"]["target_layer_ids"],
        hidden_size=probe["hidden_size"], num_hidden_layers=probe["num_hidden_layers"], backend=cfg["backend"],
        dtype=cfg["dtype"], last_hidden=cfg["last_hidden"], chunk_tokens=cfg["chunk_tokens"], gpus=a.gpus,
        target_dtype=a.target_dtype, trust_remote_code=a.trust_remote_code, vllm_options=cfg.get("vllm"),
    )
    if a.stats:
        from dflash_pipeline.core.shards import write_json

        write_json(a.stats, stats, skip_if_identical=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
