"""`dflash-eval` (console script) / `python -m dflash_pipeline.evaluate`: the eval stage's commands.

- `dflash-eval --probe P --target T --eval-config JSON --out X [--drafter label=dir]…`: τ of each drafter
  with our speculative loop (`evaluate.acceptance.main`);
- `dflash-eval server --base-url URL --set NAME=PATH …`: τ as a running SGLang/vLLM server reports it
  (`evaluate.engine_acceptance.main`);
- `dflash-eval serve-md DRAFTER_DIR [--target T]`: write the export's `serve.md`
  (`evaluate.vllm_server.write_serve_md`).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Dispatch on the first argument (`server`, `serve-md`; anything else is the loop's options)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["server"]:
        from dflash_pipeline.evaluate.engine_acceptance import main as server_main

        server_main(argv[1:])
    elif argv[:1] == ["serve-md"]:
        from dflash_pipeline.evaluate.vllm_server import _main as serve_md_main

        serve_md_main(argv)
    else:
        from dflash_pipeline.evaluate.acceptance import main as loop_main

        loop_main(argv)


if __name__ == "__main__":
    main()
