"""Completions stage throughput against local OpenAI-compatible servers vs a naive client, same run.

Servers: N separate processes of ``python -m dflash_pipeline.testing.server`` (canned answers, one
"token" per word) that answer every request after a fixed ``--delay-s``, like a real server's latency.

* ``pipeline``: :func:`dflash_pipeline.completions.generate_shard` with the openai backend (async client,
  aiohttp transport, least-outstanding balancing, cap C per endpoint, progress file, shard write) over
  ``--requests`` single-turn prompts.
* ``naive``: what peers do - a thread pool of N*C threads, one synchronous ``openai.OpenAI`` client per
  endpoint, round-robin, same prompts and sampling.

Reported per client: requests/s against the ideal N*C/delay, output tokens/s, client CPU seconds per
1,000 requests (this process only; the servers are other processes), and the zero-latency ceiling
(``--delay-s 0`` servers, requests/s). Everything is bounded: ``--requests`` per measurement and a
``--timeout-s`` per measurement.

Usage::

    python bench/bench_completions.py                                   # 2 x 32, 1 s delay, 640 requests
    python bench/bench_completions.py --endpoints 4 --concurrency 256 --requests 4096
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from dflash_pipeline import contracts, shards  # noqa: E402
from dflash_pipeline.completions import generate_shard  # noqa: E402


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def start_servers(n: int, delay_s: float, tmp: Path) -> list[tuple[subprocess.Popen, str]]:
    procs = []
    for i in range(n):
        pf = tmp / f"port-{delay_s}-{i}.txt"
        p = subprocess.Popen(
            [sys.executable, "-m", "dflash_pipeline.testing.server", "--port", "0", "--port-file", str(pf),
             "--delay-s", str(delay_s)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        procs.append((p, pf))
    out = []
    for p, pf in procs:
        deadline = time.monotonic() + 60
        while not pf.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start (exit {p.poll()})")
            time.sleep(0.05)
        out.append((p, f"http://127.0.0.1:{int(pf.read_text())}/v1"))
    return out


def stop_servers(servers) -> None:
    for p, _ in servers:
        p.send_signal(signal.SIGTERM)
    for p, _ in servers:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def prompt_shard(path: Path, n: int, tag: str) -> list[list[dict]]:
    convs = [[{"role": "user", "content": f"{tag} question {i}: what is {i} plus {i}? answer in a few words"}]
             for i in range(n)]
    recs = [{"prompt_id": contracts.prompt_id(m), "dataset": "bench", "messages": m, "metadata": "{}"} for m in convs]
    shards.write_parquet(path, shards.table_from_records(recs, contracts.PROMPT_SCHEMA))
    return convs


def gen_cfg(urls: list[str], conc: int, timeout_s: float) -> dict:
    return {
        "backend": "openai", "model": "test-model", "thinking": "none", "temperature": 0.0, "top_p": 1.0,
        "top_k": None, "max_tokens": 64, "seed": 0, "batch_size": 1, "request_timeout_s": timeout_s,
        "max_retries": 0, "retry_backoff_s": 0.1, "retry_backoff_max_s": 1.0, "endpoint_max_failures": 1000,
        "endpoint_reprobe_s": 1.0, "circuit_breaker_failures": 1000, "max_error_fraction": 1.0, "extra_body": {},
        "endpoints": [{"base_url": u, "max_concurrency": conc} for u in urls],
    }


def run_pipeline(urls, conc, n, tmp: Path, tag: str, timeout_s: float) -> dict:
    src, out = tmp / f"{tag}-prompts.parquet", tmp / f"{tag}-out.parquet"
    prompt_shard(src, n, tag)
    c0, t0 = cpu_s(), time.perf_counter()
    stats = generate_shard(src, out, target_dir=None, gen_cfg=gen_cfg(urls, conc, timeout_s))
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    assert stats["ok"] + stats["truncated"] == n, stats
    return {"wall": wall, "cpu": cpu, "requests": n, "out_tokens": stats["completion_tokens"], "errors": stats["error"]}


def run_naive(urls, conc, n, tag: str, timeout_s: float) -> dict:
    import openai

    clients = [openai.OpenAI(base_url=u, api_key="EMPTY", max_retries=0, timeout=timeout_s) for u in urls]
    rr = itertools.cycle(clients)
    jobs = [(next(rr), f"{tag} question {i}: what is {i} plus {i}? answer in a few words") for i in range(n)]

    def one(job):
        client, text = job
        r = client.chat.completions.create(model="test-model", messages=[{"role": "user", "content": text}],
                                           max_tokens=64, temperature=0.0, top_p=1.0, seed=0)
        return r.usage.completion_tokens

    c0, t0 = cpu_s(), time.perf_counter()
    errors = tokens = 0
    with cf.ThreadPoolExecutor(max_workers=len(urls) * conc) as pool:
        for fut in [pool.submit(one, j) for j in jobs]:
            try:
                tokens += fut.result(timeout=timeout_s)
            except Exception:  # counted, as a peer's client would log and move on
                errors += 1
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    for c in clients:
        c.close()
    return {"wall": wall, "cpu": cpu, "requests": n, "out_tokens": tokens, "errors": errors}


def line(name: str, r: dict, ideal: float | None) -> str:
    rps = r["requests"] / r["wall"]
    s = (f"  {name:9s} {r['requests']:6d} req in {r['wall']:7.2f} s = {rps:8.1f} req/s"
         f"{f' ({100 * rps / ideal:5.1f}% of ideal)' if ideal else ''}, {r['out_tokens'] / r['wall']:9.0f} output tok/s, "
         f"client CPU {1000 * r['cpu'] / r['requests']:.2f} s per 1k req, errors {r['errors']}")
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--endpoints", type=int, default=2, help="N server processes")
    ap.add_argument("--concurrency", type=int, default=32, help="C, per-endpoint concurrency cap")
    ap.add_argument("--delay-s", type=float, default=1.0, help="fixed server latency")
    ap.add_argument("--requests", type=int, default=0, help="requests per measurement (default 10*N*C)")
    ap.add_argument("--ceiling-requests", type=int, default=2000, help="requests for the zero-latency ceiling (0: skip)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="request timeout")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TQDM_DISABLE", "1")
    n_ep, conc = args.endpoints, args.concurrency
    n = args.requests or 10 * n_ep * conc
    ideal = n_ep * conc / args.delay_s if args.delay_s > 0 else None
    ideal_txt = f"ideal N*C/delay = {ideal:.0f} req/s" if ideal else "no ideal at delay 0"
    print(f"{n_ep} endpoint(s) x concurrency {conc}, server delay {args.delay_s} s, {n} requests ({ideal_txt}), "
          f"{os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        servers = start_servers(n_ep, args.delay_s, tmp)
        try:
            urls = [u for _, u in servers]
            run_pipeline(urls, conc, min(n, 2 * n_ep * conc), tmp, "warm", args.timeout_s)  # connections, imports
            run_naive(urls, conc, min(n, 64), "warm", args.timeout_s)
            fast = run_pipeline(urls, conc, n, tmp, "fast", args.timeout_s)
            naive = run_naive(urls, conc, n, "naive", args.timeout_s)
        finally:
            stop_servers(servers)
        print(line("pipeline", fast, ideal))
        print(line("naive", naive, ideal))
        print(f"  ratio pipeline/naive: {naive['wall'] / fast['wall']:.2f}x requests/s, "
              f"{(naive['cpu'] / naive['requests']) / max(fast['cpu'] / fast['requests'], 1e-9):.2f}x less CPU per request")
        if args.ceiling_requests:
            servers = start_servers(1, 0.0, tmp)
            try:
                urls = [u for _, u in servers]
                run_pipeline(urls, 64, 200, tmp, "warm0", args.timeout_s)
                fast0 = run_pipeline(urls, 64, args.ceiling_requests, tmp, "fast0", args.timeout_s)
                naive0 = run_naive(urls, 64, args.ceiling_requests, "naive0", args.timeout_s)
            finally:
                stop_servers(servers)
            print(f"zero-latency ceiling (1 endpoint, delay 0, concurrency 64, {args.ceiling_requests} requests):")
            print(line("pipeline", fast0, None))
            print(line("naive", naive0, None))
            print(f"  ratio pipeline/naive: {naive0['wall'] / fast0['wall']:.2f}x requests/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
