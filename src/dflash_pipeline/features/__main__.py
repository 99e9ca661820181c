"""CLI: `python -m dflash_pipeline.features extract --probe P --target DIR --token-shard T --out F ...`,
`... serve --target DIR --layer-ids 1,3 ...` (an hf feature server, `.server`; prints its URL when
ready) and `... colocate --stream-config JSON ... -- CMD` (servers for a colocated stream run, `.colocate`).

Run by the `extract_features` / `train_drafter` rules with the backend's interpreter (the vLLM venv for `vllm`).
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
    e.add_argument(
        "--probe", required=True, help="probe record JSON (target_layer_ids, hidden_size, num_hidden_layers)"
    )
    e.add_argument("--target", required=True, help="target model directory")
    e.add_argument("--token-shard", required=True)
    e.add_argument("--out", required=True, help="feature shard path (.safetensors)")
    e.add_argument("--features-config", required=True, help="JSON of the validated `features` config")
    e.add_argument("--target-dtype", default="auto")
    e.add_argument("--gpus", type=int, default=0, help="GPUs of this job (0 = CPU)")
    e.add_argument("--trust-remote-code", action="store_true")
    e.add_argument("--stats", help="write the extraction stats JSON here")
    _serve_parser(sub)
    _colocate_parser(sub)
    _many_parser(sub)
    a = p.parse_args(argv)
    if a.cmd == "serve":
        return _serve(a)
    if a.cmd == "extract-many":
        return _extract_many(a)
    if a.cmd == "colocate":
        from .colocate import run_colocated

        return run_colocated(a)

    from .extract import extract_shard

    probe = json.loads(Path(a.probe).read_text(encoding="utf-8"))
    cfg = json.loads(a.features_config)
    stats = extract_shard(
        a.token_shard,
        a.out,
        target_dir=a.target,
        target_layer_ids=probe["drafter"]["target_layer_ids"],
        hidden_size=probe["hidden_size"],
        num_hidden_layers=probe["num_hidden_layers"],
        backend=cfg["backend"],
        dtype=cfg["dtype"],
        last_hidden=cfg["last_hidden"],
        chunk_tokens=cfg["chunk_tokens"],
        gpus=a.gpus,
        target_dtype=a.target_dtype,
        trust_remote_code=a.trust_remote_code,
        vllm_options=cfg.get("vllm"),
    )
    if a.stats:
        from dflash_pipeline.core.shards import write_json

        write_json(a.stats, stats, skip_if_identical=False)
    return 0


def _serve_parser(sub) -> None:
    from .server import DEFAULT_API_KEY_ENV, Limits

    s = sub.add_parser("serve", help="an hf feature server (features.stream; prints its URL when ready)")
    s.add_argument("--target", required=True, help="target model directory")
    s.add_argument("--layer-ids", required=True, help="canonical target_layer_ids, comma-separated (e.g. 1,3)")
    s.add_argument("--num-hidden-layers", type=int, required=True)
    s.add_argument("--last-hidden", action="store_true", help="also send the last decoder layer's pre-norm output")
    s.add_argument("--scratch-dir", required=True, help="where /v1/completions answers' files are written")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0, help="0 = a free port")
    s.add_argument("--url-file", help="write the URL here (atomically) once ready")
    s.add_argument("--model-name", help="the id GET /v1/models lists (default: the target directory's name)")
    s.add_argument(
        "--max-len",
        type=int,
        help="longest record accepted (tokens; default and ceiling: the target's max_position_embeddings); "
        "request bodies are capped from it",
    )
    s.add_argument(
        "--api-key-env",
        default=DEFAULT_API_KEY_ENV,
        help=f"environment variable holding the API key every route but GET /health requires (default "
        f"{DEFAULT_API_KEY_ENV}; unset or empty: no key). The key is never taken on the command line.",
    )
    s.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="allow a non-loopback --host without an API key (anyone who reaches the port can use it)",
    )
    s.add_argument(
        "--request-timeout-s",
        type=float,
        default=Limits.request_timeout_s,
        help="seconds a request's headers and body may take to arrive (and an idle connection may stay open)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=Limits.max_connections,
        help="connections served at once; more are answered 503 and closed",
    )
    s.add_argument(
        "--scratch-max-bytes",
        type=int,
        default=Limits.scratch_max_bytes,
        help="bytes of unread answer files this server keeps in --scratch-dir; past it /v1/completions answers 503",
    )
    s.add_argument(
        "--scratch-max-age-s",
        type=float,
        default=Limits.scratch_max_age_s,
        help="seconds after which an answer file nobody read is deleted",
    )
    s.add_argument("--target-dtype", default="auto")
    s.add_argument("--gpus", type=int, default=0, help="GPUs to spread the target over (device_map; 0 = CPU)")
    s.add_argument("--trust-remote-code", action="store_true")
    s.add_argument(
        "--hang-after",
        type=int,
        help="fault injection (tests, benches): accept and never answer feature requests after the first N",
    )


def _many_parser(sub) -> None:
    m = sub.add_parser(
        "extract-many",
        help="write several feature shards through one set of feature servers (started once, or the "
        "--stream-config endpoints)",
    )
    m.add_argument("--probe", required=True)
    m.add_argument("--target", required=True)
    m.add_argument("--token-shard", action="append", required=True, help="repeat; the i-th --out is its shard")
    m.add_argument("--out", action="append", required=True)
    m.add_argument("--features-config", required=True, help="JSON of the validated `features` config")
    m.add_argument("--stream-config", required=True, help="JSON of the stream settings (servers or endpoints, fleet)")
    m.add_argument("--target-dtype", default="auto")
    m.add_argument("--trust-remote-code", action="store_true")


def _extract_many(a) -> int:
    from .extract_stream import extract_shards

    if len(a.token_shard) != len(a.out):
        raise SystemExit(f"extract-many: {len(a.token_shard)} --token-shard but {len(a.out)} --out")
    cfg = json.loads(a.features_config)
    stats = extract_shards(
        list(zip(a.token_shard, a.out)),
        json.loads(a.stream_config),
        probe=json.loads(Path(a.probe).read_text(encoding="utf-8")),
        target_dir=a.target,
        dtype=cfg["dtype"],
        last_hidden=cfg["last_hidden"],
        chunk_tokens=cfg["chunk_tokens"],
        target_dtype=a.target_dtype,
        trust_remote_code=a.trust_remote_code,
    )
    print("[features] extract-many done " + json.dumps(stats), flush=True)
    return 0


def _colocate_parser(sub) -> None:
    c = sub.add_parser(
        "colocate", help="start features.stream.servers servers, run CMD with their endpoints, stop them"
    )
    c.add_argument("--stream-config", required=True, help="JSON of the stream settings (rules/features_helpers.smk)")
    c.add_argument("--probe", required=True)
    c.add_argument("--target", required=True)
    c.add_argument("--target-dtype", default="auto")
    c.add_argument("--trust-remote-code", action="store_true")
    c.add_argument("cmd", nargs="+", help="the trainer's command line (after --)")


def _serve(a) -> int:
    import os

    from .server import FeatureServer, Limits, check_bind, serve

    server_args = dict(vars(a))  # every serve flag but these is FeatureServer's argument
    del server_args["cmd"]
    host, port, url_file = server_args.pop("host"), server_args.pop("port"), server_args.pop("url_file")
    insecure = server_args.pop("insecure_no_auth")
    key = os.environ.get(server_args.pop("api_key_env")) or None
    limits = Limits(**{f: server_args.pop(f) for f in Limits.__dataclass_fields__})
    check_bind(host, key, insecure)  # before the target is loaded: a refused start costs nothing
    layers = [int(x) for x in server_args.pop("layer_ids").split(",") if x.strip()]
    server = FeatureServer(server_args.pop("target"), layers, api_key=key, limits=limits, **server_args)
    serve(server, host, port, url_file, insecure_no_auth=insecure)
    return 0


if __name__ == "__main__":
    sys.exit(main())
