"""`python -m dflash_pipeline.docs_gen`: see `dflash_pipeline.docs_gen`."""

from dflash_pipeline.docs_gen import main

if __name__ == "__main__":
    raise SystemExit(main())
