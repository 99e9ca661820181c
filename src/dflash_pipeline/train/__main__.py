"""`python -m dflash_pipeline.train` (the train rule's entry point)."""

from dflash_pipeline.train.run import main

if __name__ == "__main__":
    main()
