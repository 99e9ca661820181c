"""The CLI reference page `docs/reference/cli.md`: every entry point's argparse parser, captured without
running the entry point, rendered as Markdown."""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Callable, Iterator, Sequence

from dflash_pipeline.docs_gen.markdown import GENERATED_NOTE, md_table, md_text

# --- CLI reference (argparse)


class _Captured(Exception):
    def __init__(self, parser):
        super().__init__("parser captured")
        self.parser = parser


@contextlib.contextmanager
def _capture_parse() -> Iterator[None]:
    """While active, the first `parse_args`/`parse_known_args` call raises `_Captured` with its
    parser, so an entry point's `main` hands over its parser without running."""
    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def grab(self, *args, **kwargs):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = grab
    argparse.ArgumentParser.parse_known_args = grab
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved


def captured_parser(main: Callable, argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argparse parser `main(argv)` builds (it is not run).

    Raises:
        RuntimeError: `main` returned without parsing arguments.
    """
    with _capture_parse():
        try:
            main(list(argv))
        except _Captured as got:
            return got.parser
    raise RuntimeError(f"{main.__module__}.{main.__name__} parsed no arguments")


def _argument(action: argparse.Action) -> str:
    """How an argument is written on the command line: `--out-dir OUT_DIR`, `token_shards ...`."""
    metavar = action.metavar if isinstance(action.metavar, str) else None
    if not action.option_strings:
        name = metavar or action.dest
        return f"{name} ..." if action.nargs in ("+", "*", argparse.REMAINDER) else name
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    value = metavar or ("{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper())
    more = " ..." if action.nargs in ("+", "*") else ""
    return ", ".join(action.option_strings) + f" {value}{more}"


def _action_help(action: argparse.Action, prog: str) -> str:
    text = argparse.HelpFormatter(prog)._expand_help(action) if action.help else ""
    notes = []
    if action.required and action.option_strings:
        notes.append("required")
    if isinstance(action, argparse._AppendAction):
        notes.append("repeatable")
    return md_text(" ".join([text, *(f"({n})" for n in notes)]).strip())


def parser_markdown(parser: argparse.ArgumentParser, prog: str, level: int = 3) -> str:
    """A parser as Markdown: its description, a table of arguments per argument group, its epilog (as
    written), then each subcommand under a heading of `level`. Rendered from the parser's actions, not
    from `format_help`, so the page does not depend on the Python version's help layout."""
    out = []
    if parser.description:
        out += [md_text(parser.description).replace("\\|", "|"), ""]
    subs = _subparsers(parser)
    for group in parser._action_groups:
        rows = [
            [f"`{_argument(a)}`", _action_help(a, prog)]
            for a in group._group_actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS
        ]
        if rows:
            title = {"options": "options", "optional arguments": "options"}.get(group.title, group.title)
            out += [f"*{title}*", "", md_table(["argument", "description"], rows), ""]
    if parser.epilog:
        out += ["```text", parser.epilog.strip("\n"), "```", ""]
    for name, sub in subs.items():
        out += [f"{'#' * level} `{prog} {name}`", "", parser_markdown(sub, f"{prog} {name}", level + 1), ""]
    return "\n".join(out).rstrip() + "\n"


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _stdout_of(fn: Callable, *args) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        fn(*args)
    return buf.getvalue().rstrip()


def _entry_points() -> list[tuple[str, str, Callable[[], str]]]:
    """`(command, what it is for, its Markdown)` of every entry point, in the order of the page."""

    def parsed(module: str, attr: str, prog: str, argv: Sequence[str] = (), sub: str = "") -> Callable[[], str]:
        def text() -> str:
            import importlib

            parser = captured_parser(getattr(importlib.import_module(module), attr), argv)
            if sub:  # one subcommand of a parser, documented as its own entry point
                parser = _subparsers(parser)[sub]
            return parser_markdown(parser, prog)

        return text

    def workflow_usage() -> str:
        from dflash_pipeline.workflow.policy import run_with_gpus

        return "```text\n" + _stdout_of(run_with_gpus, ["--help"]) + "\n```\n"

    def test_server() -> str:
        from dflash_pipeline.testing.server.cli import _parser

        return parser_markdown(_parser(), "python -m dflash_pipeline.testing.server")

    return [
        (
            "dflash-probe",
            "Probe a model directory (no weights loaded)",
            parsed("dflash_pipeline.probe", "main", "dflash-probe"),
        ),
        (
            "dflash-train",
            "Train a drafter (what `train_drafter` runs under `accelerate launch`; also `python -m dflash_pipeline.train`)",
            parsed("dflash_pipeline.train.run", "main", "dflash-train"),
        ),
        (
            "dflash-eval",
            "Measure τ of drafters with our speculative loop",
            parsed("dflash_pipeline.evaluate.acceptance", "main", "dflash-eval"),
        ),
        (
            "dflash-eval server",
            "Measure τ as a running SGLang/vLLM server reports it (also `python -m dflash_pipeline.evaluate.engine_acceptance`)",
            parsed("dflash_pipeline.evaluate.engine_acceptance", "main", "dflash-eval server"),
        ),
        (
            "dflash-eval serve-md",
            "Write an export's `serve.md` (launch lines)",
            parsed("dflash_pipeline.evaluate.vllm_server", "_main", "dflash-eval serve-md", sub="serve-md"),
        ),
        (
            "python -m dflash_pipeline.features",
            "Write feature shards, serve target features",
            parsed("dflash_pipeline.features.__main__", "main", "python -m dflash_pipeline.features"),
        ),
        ("python -m dflash_pipeline.workflow", "The rules' job wrappers (GPUs, launch, log tee)", workflow_usage),
        (
            "python -m dflash_pipeline.workflow.jobs tokenize",
            "Tokenize one completion shard",
            parsed("dflash_pipeline.workflow.jobs", "tokenize", "python -m dflash_pipeline.workflow.jobs tokenize"),
        ),
        (
            "python -m dflash_pipeline.demo",
            "Build the tiny demo target",
            parsed("dflash_pipeline.demo", "main", "python -m dflash_pipeline.demo"),
        ),
        ("python -m dflash_pipeline.testing.server", "The fault-injecting OpenAI-compatible test server", test_server),
        (
            "python -m dflash_pipeline.testing.zoo",
            "Build tiny twins of every supported family; `--table` runs every stage on each",
            parsed("dflash_pipeline.testing.zoo", "main", "python -m dflash_pipeline.testing.zoo"),
        ),
    ]


def cli_reference() -> str:
    """`docs/reference/cli.md`: every entry point's arguments."""
    out = [
        GENERATED_NOTE.format(source="each entry point's argparse parser"),
        "",
        "# Command line",
        "",
        "Every entry point and its arguments (what `--help` prints). The workflow runs them for you; they are also useful on their own "
        "(probe a model directory, measure τ against a running server, start a feature server).",
        "",
    ]
    for command, what, text in _entry_points():
        out += [f"## `{command}`", "", what + ".", "", text()]
    return "\n".join(out)
