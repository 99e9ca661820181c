"""The test server's command line: `python -m dflash_pipeline.testing.server --help` (`main`).

One flag per field of `Faults` (same name, its default), in three argument groups: server
(address, port file, API key), answers (canned or target mode, reasoning, speculative metrics) and
faults.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
from dataclasses import fields
from pathlib import Path

from .app import DEFAULT_MODEL_NAME, FLAVORS, TestServer
from .faults import Faults, faults_summary


def _checked(name: str, convert, ok, what: str):
    """An argparse `type` called `name`: `convert(text)` when `ok` of it, else ArgumentTypeError
    "must be `what`" (argparse reports a failed `convert` as "invalid `name` value")."""

    def parse(text: str):
        value = convert(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
        return value

    parse.__name__ = name
    return parse


_count = _checked("_count", int, lambda v: v >= 0, "a count >= 0")
_seconds = _checked("_seconds", float, lambda v: v >= 0 and math.isfinite(v), "a number of seconds >= 0")
_status = _checked("_status", int, lambda v: 100 <= v <= 599, "an HTTP status 100-599")
_accept_length = _checked("_accept_length", float, lambda v: v >= 1 and math.isfinite(v), "an acceptance length >= 1")


_CLI_EPILOG = """\
Generation requests (POST /v1/chat/completions and /v1/completions, counted together) are numbered
1, 2, ... in arrival order. The *-first faults take consecutive requests from the start, in the order
drops, hangs, failures (e.g. --drop-first 1 --fail-first 2: request 1 is dropped, 2 and 3 fail); the
*-every faults then take every request whose number is a multiple of N (drop before hang before fail);
every other request is answered after --delay-s. Once --die-after requests have arrived, the server
acts crashed: every later request (/v1/models and /health included) has its connection dropped and is
not counted; /metrics and /stats keep answering. The process keeps running until SIGINT/SIGTERM.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health,
GET /metrics (Prometheus text: totals per status), GET /stats (JSON: the totals plus by_prompt =
{first user message (completions: the prompt text): requests received} and by_conversation =
{canonical JSON of the messages: requests received}).

On start it prints "READY <base_url>" (e.g. READY http://127.0.0.1:31001/v1) on stdout and the active
fault plan on stderr.

example: a server that fails every 5th request with 429 (Retry-After: 2) and answers the rest after 0.5 s
  python -m dflash_pipeline.testing.server --port 31001 --fail-every 5 --fail-status 429 \\
      --retry-after-s 2 --delay-s 0.5
"""


def _parser() -> argparse.ArgumentParser:
    """The CLI's parser: the server, answers and faults argument groups (epilog `_CLI_EPILOG`)."""
    ap = argparse.ArgumentParser(
        prog="python -m dflash_pipeline.testing.server",
        description=sys.modules[__package__].__doc__.split("\n")[0],  # the package docstring's summary
        epilog=_CLI_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_server_flags(ap.add_argument_group("server"))
    _add_answer_flags(ap.add_argument_group("answers"))
    flt = ap.add_argument_group("faults (generation requests only; see the numbering below)")
    defaults = Faults()
    _add_fault_plan_flags(flt, defaults)
    _add_marker_flags(flt, defaults)
    return ap


def _add_server_flags(srv: argparse._ArgumentGroup) -> None:
    """--host, --port, --port-file, --api-key-env."""
    srv.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: %(default)s; 0.0.0.0 = every interface, the printed "
        "base_url then names 127.0.0.1)",
    )
    srv.add_argument(
        "--port",
        type=int,
        default=0,
        help="TCP port (default: 0 = a free one; read it from the READY line or --port-file)",
    )
    srv.add_argument(
        "--port-file", default=None, metavar="FILE", help="write the bound port to FILE (atomically) once listening"
    )
    srv.add_argument(
        "--api-key-env",
        default=None,
        metavar="VAR",
        help="require 'Authorization: Bearer <key>' with the key held by environment variable "
        "VAR; other requests get 401 (default: no key)",
    )


def _add_answer_flags(ans: argparse._ArgumentGroup) -> None:
    """Canned or target answers (--target, --tokenizer, --model-name), reasoning and speculative metrics."""
    ans.add_argument(
        "--target",
        default=None,
        metavar="DIR",
        help="serve the causal LM at DIR (e.g. resources/demo-target) with its chat template, "
        "greedy, one request at a time (needs torch and transformers; meant for tiny "
        "models). Default: canned answers ('Answer <turn> to: <last user message>', one "
        "token per word)",
    )
    ans.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="canned mode: decode token-id prompts of /v1/completions (and tokenize string "
        "prompts) with the tokenizer at DIR (default: ids stand for themselves)",
    )
    ans.add_argument(
        "--model-name",
        default=DEFAULT_MODEL_NAME,
        help="model id listed by /v1/models and echoed in answers to requests without 'model' (default: %(default)s)",
    )
    ans.add_argument(
        "--reasoning",
        action="store_true",
        help="canned mode: act like a thinking model behind a reasoning parser: chat answers "
        "carry reasoning unless the request sends chat_template_kwargs.enable_thinking="
        "false; completions text starts with a <think> block unless the prompt ends "
        "with </think>",
    )
    ans.add_argument(
        "--reasoning-field",
        default="reasoning_content",
        choices=["reasoning_content", "reasoning"],
        help="response field that carries reasoning (default: %(default)s as SGLang and older "
        "vLLM; 'reasoning' as newer vLLM)",
    )
    ans.add_argument(
        "--spec-accept-length",
        type=_accept_length,
        default=None,
        metavar="TAU",
        help="act like an engine with a drafter of acceptance length TAU (>= 1): answers carry "
        "SGLang meta_info.spec_accept_length/spec_verify_ct and /metrics vLLM's "
        "spec_decode counters (default: none)",
    )
    ans.add_argument(
        "--no-spec-meta-info",
        action="store_true",
        help="with --spec-accept-length: leave meta_info out of answers (vLLM: /metrics only)",
    )
    ans.add_argument(
        "--flavor",
        choices=FLAVORS,
        default="vllm",
        help="answer shapes: vllm (token ids as vLLM returns them), sglang (SGLang's: ids per choice "
        "and in sglext, meta_info per choice with return_meta_info, streaming, the 400 for ids "
        "on a streamed chat), sglang-legacy (an SGLang before PR #30917: no token ids; "
        "default: %(default)s)",
    )
    ans.add_argument(
        "--spec-block-size",
        type=int,
        default=16,
        metavar="B",
        help="sglang flavors with --spec-accept-length: the drafter's block size of the spec_* "
        "histograms (SGLang's --speculative-num-draft-tokens; default: %(default)s)",
    )
    ans.add_argument(
        "--return-input-ids",
        action="store_true",
        help="sglang flavor: the prompt ids in every answer's sglext (as SGLang's --return-input-ids)",
    )
    ans.add_argument(
        "--return-output-ids",
        action="store_true",
        help="sglang flavor: the output ids in every answer's sglext (as SGLang's --return-output-ids)",
    )


#: The drops, hangs, failures, delay and crash of `Faults`: flag -> (type, metavar, help). A flag names
#: its field (`--drop-first`: `drop_first`), whose value in the defaults is the flag's default.
_FAULT_PLAN_FLAGS = {
    "--delay-s": (
        _seconds,
        "S",
        "answer every non-faulted chat or completions request after S seconds (default: %(default)s)",
    ),
    "--drop-first": (
        _count,
        "N",
        "drop the connection of the first N requests without an answer (default: %(default)s)",
    ),
    "--hang-first": (
        _count,
        "N",
        (
            "the N requests after the drops get no answer for --hang-s seconds, then a dropped "
            "connection (a client timeout shorter than --hang-s sees a timeout; default: %(default)s)"
        ),
    ),
    "--fail-first": (
        _count,
        "N",
        "the N requests after the drops and hangs get HTTP --fail-status (default: %(default)s)",
    ),
    "--drop-every": (
        _count,
        "N",
        "drop the connection of every request whose number is a multiple of N (default: %(default)s = off)",
    ),
    "--hang-every": (
        _count,
        "N",
        "hang every request whose number is a multiple of N, as --hang-first does (default: %(default)s = off)",
    ),
    "--fail-every": (
        _count,
        "N",
        (
            "answer every request whose number is a multiple of N with HTTP --fail-status, "
            "i.e. a failure rate of 1/N (default: %(default)s = off)"
        ),
    ),
    "--hang-s": (
        _seconds,
        "S",
        "how long a hung request waits before its connection is dropped (seconds; default: %(default)s)",
    ),
    "--fail-status": (
        _status,
        "CODE",
        (
            "HTTP status of --fail-first/--fail-every failures, e.g. 500, 503, or 429 for rate "
            "limiting (default: %(default)s); the body is an OpenAI error object"
        ),
    ),
    "--retry-after-s": (
        _seconds,
        "S",
        "send 'Retry-After: S' (seconds) with --fail-first/--fail-every failures (default: no header)",
    ),
    "--die-after": (
        _count,
        "N",
        (
            "after N requests, act crashed: drop every later connection, /v1/models and /health "
            "included (/metrics and /stats keep answering; default: never)"
        ),
    ),
}


def _add_fault_plan_flags(flt: argparse._ArgumentGroup, d: Faults) -> None:
    """The drops, hangs, failures, delay and crash of `Faults` (`_FAULT_PLAN_FLAGS`; defaults from
    `d`)."""
    for flag, (kind, metavar, text) in _FAULT_PLAN_FLAGS.items():
        flt.add_argument(flag, type=kind, default=getattr(d, flag[2:].replace("-", "_")), metavar=metavar, help=text)


def _add_marker_flags(flt: argparse._ArgumentGroup, d: Faults) -> None:
    """The marker strings of `Faults` that force a 400, wrong content or a malformed body."""
    flt.add_argument(
        "--bad-request-marker",
        default=d.bad_request_marker,
        metavar="TEXT",
        help="a request whose last user message (completions: prompt) contains TEXT gets HTTP 400 "
        "'prompt is too long' (default: %(default)s; '' = off)",
    )
    flt.add_argument(
        "--wrong-content-marker",
        default=d.wrong_content_marker,
        metavar="TEXT",
        help="a request whose last user message (completions: prompt) contains TEXT gets an answer "
        "that carries reasoning even though thinking was disabled (default: %(default)s; "
        "'' = off)",
    )
    flt.add_argument(
        "--malformed-marker",
        default=d.malformed_marker,
        metavar="TEXT",
        help="a request whose last user message (completions: prompt) contains TEXT gets HTTP 200 "
        "with a truncated, unparsable JSON body (default: %(default)s; '' = off)",
    )


#: TestServer's arguments whose flag has the same name (`--reasoning-field` → `reasoning_field`).
_SAME_NAMED = (
    "model_name reasoning reasoning_field port host spec_accept_length flavor spec_block_size return_input_ids"
    " return_output_ids"
).split()


def main(argv: list[str] | None = None) -> int:
    """CLI: serve until SIGINT/SIGTERM. Prints `READY <base_url>` on stdout once listening."""
    args = _parser().parse_args(argv)
    api_key = os.environ[args.api_key_env] if args.api_key_env else None
    faults = Faults(**{f.name: getattr(args, f.name) for f in fields(Faults)})  # one flag per field
    server = TestServer(
        target_dir=args.target,
        tokenizer_dir=args.tokenizer,
        faults=faults,
        api_key=api_key,
        spec_meta_info=not args.no_spec_meta_info,
        **{name: getattr(args, name) for name in _SAME_NAMED},  # the flags named as TestServer's arguments
    )
    asyncio.run(_serve(server, args))
    return 0


async def _serve(server: TestServer, args: argparse.Namespace) -> None:
    """Start `server`, write `--port-file` (atomically), print READY (stdout) and the plan (stderr), then serve until
    SIGINT/SIGTERM (handlers installed before READY, so an early SIGTERM exits 0)."""
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    await server.start_async()
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(f"{server.port}\n")
        tmp.replace(args.port_file)
    print(f"READY {server.base_url}", flush=True)
    print(
        f"test server {server.base_url}: model {server.model_name!r}, "
        f"{'target ' + str(args.target) if args.target else 'canned answers'}, "
        f"faults: {faults_summary(server.faults)}",
        file=sys.stderr,
        flush=True,
    )
    await done.wait()
    await server.stop_async()
