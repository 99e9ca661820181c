"""Extract one feature shard by hand (the ``extract_features`` rule runs the same CLI):

    .venv-vllm/bin/python scripts/extract_features.py extract --probe results/probe/demo.json \
        --target DIR --token-shard results/tokens/d/00000.parquet --out f.safetensors --features-config '{...}'
"""

import sys

from dflash_pipeline.features.__main__ import main

sys.exit(main())
