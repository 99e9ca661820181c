"""`python -m dflash_pipeline.probe DIR`: the `dflash-probe` CLI (`probe.main`)."""

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
