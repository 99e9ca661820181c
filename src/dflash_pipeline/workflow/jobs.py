"""Shell entry points of per-shard rules: `python -m dflash_pipeline.workflow.jobs tokenize ...`.

A `shell:` rule costs Snakemake nothing at plan time where a `script:` rule costs a quarter of a dry run
over 10,000 shards (bench/bench_dag.py). Each command takes what the script took from the `snakemake`
object: the same params values, input, output and log paths. `generate_completions` stays a script rule,
so its endpoints never appear in a command line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any, Mapping, Optional, Sequence


def tokenize_args(tokens_cfg: Mapping[str, Any], chat_template: Optional[str], trust_remote_code: bool) -> str:
    """The settings part of the `tokenize` command line, shell-quoted: `--tokens JSON`, `--chat-template FILE` when
    one is set, `--trust-remote-code` when on."""
    args = ["--tokens", json.dumps(dict(tokens_cfg))]
    if chat_template is not None:
        args += ["--chat-template", str(chat_template)]
    if trust_remote_code:
        args.append("--trust-remote-code")
    return shlex.join(args)


def tokenize(argv: Sequence[str]) -> int:
    """`tokenize COMPLETION_SHARD TOKEN_SHARD --target DIR --tokens JSON [--chat-template F]
    [--trust-remote-code] [--log LOG]`: `tokens.tokenize_shard` of one shard."""
    p = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.workflow.jobs tokenize",
        description="tokenize one completion shard into one token shard",
    )
    p.add_argument("completions", help="completion shard (Parquet, contracts.COMPLETION_SCHEMA)")
    p.add_argument("out", help="token shard to write (atomically)")
    p.add_argument("--target", required=True, help="target model directory (tokenizer files)")
    p.add_argument("--tokens", required=True, help="JSON of the validated `tokens` config section")
    p.add_argument("--chat-template", help=".jinja file overriding the tokenizer's template")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log", help="the job's log file (Snakemake `log:`)")
    a = p.parse_args(argv)

    from dflash_pipeline.tokens import tokenize_shard
    from dflash_pipeline.workflow.policy import log_to

    with log_to(a.log):
        tokenize_shard(
            a.completions,
            a.out,
            target_dir=a.target,
            tokens_cfg=json.loads(a.tokens),
            chat_template=a.chat_template,
            trust_remote_code=a.trust_remote_code,
        )
    return 0


COMMANDS = {"tokenize": tokenize}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch `COMMAND ARGS...`; 2 with a usage line for an unknown command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m dflash_pipeline.workflow.jobs {{{','.join(COMMANDS)}}} ARGS...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
