"""Completions stage throughput against local OpenAI-compatible servers vs a naive client, same run.

Servers: N separate processes of ``python -m dflash_pipeline.testing.server`` (canned answers, one
"token" per word) that answer every request after a fixed delay, like a real server's latency.

* ``pipeline``: :func:`dflash_pipeline.completions.generate_shard` with the openai backend (async client,
  aiohttp transport, least-outstanding balancing, cap C per endpoint, progress file, shard write) over
  single-turn prompts.
* ``naive``: what peers do - a thread pool of N*C threads, one synchronous ``openai.OpenAI`` client per
  endpoint, ``chat.completions.create``, round-robin, same prompts and sampling.

Each measurement runs in its own client process (so its CPU is its own; the servers and this driver are
other processes) after a short warm-up, and is bounded: ``--waves`` x N x C requests (at most
``--max-requests``) and a wall-clock limit per measurement (``--measure-timeout-s``; a measurement over it
is killed and reported as a timeout). Reported per grid point and client:

* requests/s over the whole run (start to last answer, ramp-up and drain included) and as % of the ideal
  N*C/delay;
* steady % of ideal: the rate while all N*C slots are busy, without the ramp-up: N*C / the mean latency
  the client saw (send to parsed answer) for the requests after the first two waves, as % of the ideal;
  i.e. delay / mean latency, how much the client adds to the server's delay. The whole-run figure also
  pays for the start (the first N*C requests and connections all at once) and for the drain of the last
  wave, whose answers have spread out by then: about one delay per run;
* client CPU seconds per 1,000 requests, and the servers' CPU per 1,000 requests (all server processes;
  includes the warm-up's few requests).

The zero-latency ceiling (1 endpoint, delay 0, concurrency 64) is measured first: the box's own limit in
requests/s, where the client's event loop fills one core and the server shares the other. A grid point
whose ideal exceeds ``--cpu-bound-fraction`` (0.5) of the pipeline's ceiling is CPU-bound (marked ``CPU``:
the client's core, not the delay, limits it, and the fixed-delay waves queue behind each other; compare
its requests/s with the ceiling) and is repeated at the shortest delay ``delay * 2**k`` whose ideal is at
most half that (marked ``delay``: there the % of ideal measures the client's overhead).

Usage::

    python bench/bench_completions.py                                   # grid 1x64,2x128,4x256 at 1 s
    python bench/bench_completions.py --grid 2x32 --delay-s 1           # one point
    python bench/bench_completions.py --grid 4x256@4 --ceiling-requests 0
    python bench/bench_completions.py --grid 4x256 --waves 20 --clients pipeline --client-processes 2
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
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

from dflash_pipeline.core import contracts

from dflash_pipeline.core import shards  # noqa: E402
from dflash_pipeline.completions import generate_shard  # noqa: E402
from dflash_pipeline.core.config import validate_config  # noqa: E402


def cpu_s() -> float:
    """CPU seconds of this process and of its reaped children (the pipeline's client processes, which
    ``generate_shard`` joins before returning)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of another process, from /proc (0.0 where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def start_servers(n: int, delay_s: float, tmp: Path) -> list[tuple[subprocess.Popen, str]]:
    procs = []
    for i in range(n):
        pf = tmp / f"port-{delay_s}-{i}-{time.monotonic_ns()}.txt"
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dflash_pipeline.testing.server",
                "--port",
                "0",
                "--port-file",
                str(pf),
                "--delay-s",
                str(delay_s),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
            },
        )
        procs.append((p, pf))
    out = []
    for p, pf in procs:
        deadline = time.monotonic() + 60
        while not pf.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                stop_servers([(q, "") for q, _ in procs])
                raise SystemExit(f"server did not start (exit {p.poll()})")
            time.sleep(0.05)
        out.append((p, f"http://127.0.0.1:{int(pf.read_text())}/v1"))
    return out


def stop_servers(servers) -> None:
    for p, _ in servers:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p, _ in servers:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def prompt_shard(path: Path, n: int, tag: str) -> list[list[dict]]:
    convs = [
        [{"role": "user", "content": f"{tag} question {i}: what is {i} plus {i}? answer in a few words"}]
        for i in range(n)
    ]
    recs = [{"prompt_id": contracts.prompt_id(m), "dataset": "bench", "messages": m, "metadata": "{}"} for m in convs]
    shards.write_parquet(path, shards.table_from_records(recs, contracts.PROMPT_SCHEMA))
    return convs


def gen_cfg(urls: list[str], conc: int, timeout_s: float, client_processes: int = 1) -> dict:
    return validate_config(
        {
            "generation": {
                "client_processes": client_processes,
                "backend": "openai",
                "model": "test-model",
                "thinking": "none",
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": None,
                "max_tokens": 64,
                "seed": 0,
                "batch_size": 1,
                "request_timeout_s": timeout_s,
                "max_retries": 0,
                "retry_backoff_s": 0.1,
                "retry_backoff_max_s": 1.0,
                "endpoint_max_failures": 1000,
                "endpoint_reprobe_s": 1.0,
                "circuit_breaker_failures": 1000,
                "max_error_fraction": 1.0,
                "extra_body": {},
                "endpoints": [{"base_url": u, "max_concurrency": conc} for u in urls],
            }
        }
    )["generation"]


def run_pipeline(urls, conc, n, tmp: Path, tag: str, timeout_s: float, procs: int = 1) -> dict:
    src, out = tmp / f"{tag}-prompts.parquet", tmp / f"{tag}-out.parquet"
    prompt_shard(src, n, tag)
    c0, t0 = cpu_s(), time.perf_counter()
    stats = generate_shard(src, out, target_dir=None, gen_cfg=gen_cfg(urls, conc, timeout_s, procs))
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    # Workers take prompts in shard order, so request i is in wave i // (N*C); latency_s is the client's
    # time from sending the request to its parsed answer.
    turns = shards.read_parquet(out).column("turns").to_pylist()
    lat = [t[0]["latency_s"] if t else None for t in turns]
    return {
        "wall": wall,
        "cpu": cpu,
        "requests": n,
        "out_tokens": stats["completion_tokens"],
        "errors": stats["error"],
        "latency": lat,
    }


def run_naive(urls, conc, n, tag: str, timeout_s: float) -> dict:
    import openai

    clients = [openai.OpenAI(base_url=u, api_key="EMPTY", max_retries=0, timeout=timeout_s) for u in urls]
    rr = itertools.cycle(clients)
    jobs = [(next(rr), f"{tag} question {i}: what is {i} plus {i}? answer in a few words") for i in range(n)]

    def one(job):
        client, text = job
        t = time.monotonic()
        r = client.chat.completions.create(
            model="test-model",
            messages=[{"role": "user", "content": text}],
            max_tokens=64,
            temperature=0.0,
            top_p=1.0,
            seed=0,
        )
        return r.usage.completion_tokens, time.monotonic() - t

    c0, t0 = cpu_s(), time.perf_counter()
    errors = tokens = 0
    lat: list[float | None] = []
    with cf.ThreadPoolExecutor(max_workers=len(urls) * conc) as pool:
        for fut in [pool.submit(one, j) for j in jobs]:
            try:
                k, dt = fut.result(timeout=timeout_s)
                tokens += k
                lat.append(dt)
            except Exception:  # counted, as a peer's client would log and move on
                errors += 1
                lat.append(None)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    for c in clients:
        c.close()
    return {"wall": wall, "cpu": cpu, "requests": n, "out_tokens": tokens, "errors": errors, "latency": lat}


def steady_rps(lat: list[float | None], in_flight: int) -> float | None:
    """Requests/s while all ``in_flight`` slots are busy, after the ramp-up: ``in_flight`` / the mean
    client-side latency of the requests after the first two waves (Little's law for a closed loop; the
    time a slot spends between an answer and its next request is microseconds here)."""
    rest = [x for x in lat[2 * in_flight :] if x is not None]
    if len(rest) < in_flight:
        return None
    return in_flight / (sum(rest) / len(rest))


def child(args) -> int:
    """One measurement in this process: a short warm-up, then ``--requests`` requests; prints RESULT <json>."""
    logging.basicConfig(level=logging.WARNING)  # the progress bar stays on, as in a real run (stderr is a pipe here)
    urls = args.urls.split(",")
    warm = min(args.requests, 4 * len(urls))
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.child == "pipeline":
            run_pipeline(urls, args.conc, warm, tmp, "warm", args.timeout_s, args.client_processes)
            r = run_pipeline(urls, args.conc, args.requests, tmp, "run", args.timeout_s, args.client_processes)
        else:
            run_naive(urls, args.conc, warm, "warm", args.timeout_s)
            r = run_naive(urls, args.conc, args.requests, "run", args.timeout_s)
    r["steady_rps"] = steady_rps(r.pop("latency"), len(urls) * args.conc)
    print("RESULT " + json.dumps(r), flush=True)
    return 0


def measure(kind: str, servers, conc: int, n: int, delay_s: float, args) -> dict:
    """One measurement in a child process (killed after its wall-clock limit); adds the servers' CPU."""
    urls = [u for _, u in servers]
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        kind,
        "--urls",
        ",".join(urls),
        "--conc",
        str(conc),
        "--requests",
        str(n),
        "--timeout-s",
        str(args.timeout_s),
        "--client-processes",
        str(args.client_processes),
    ]
    ideal = len(urls) * conc / delay_s if delay_s > 0 else None
    limit = args.measure_timeout_s or (60 + 3 * (n / ideal if ideal else n / 100))
    srv0 = sum(proc_cpu_s(p.pid) for p, _ in servers)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"timeout": limit}
    srv = sum(proc_cpu_s(p.pid) for p, _ in servers) - srv0
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"{kind} measurement failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(line[len("RESULT ") :])
    r["server_cpu"] = srv  # includes the warm-up's few requests
    return r


def parse_grid(spec: str, default_delay: float) -> list[tuple[int, int, float]]:
    """``"1x64,2x128,4x256@4"`` -> [(1, 64, d), (2, 128, d), (4, 256, 4.0)]."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(","))):
        nc, _, d = item.partition("@")
        n_ep, _, conc = nc.lower().partition("x")
        out.append((int(n_ep), int(conc), float(d) if d else default_delay))
        if out[-1][2] <= 0:
            raise SystemExit(f"--grid {item}: the delay must be > 0 (the zero-latency ceiling is measured separately)")
    return out


def fmt_client(r: dict, ideal: float | None) -> str:
    if "timeout" in r:
        return f"{'timeout ' + format(r['timeout'], '.0f') + ' s':>28s}"
    rps = r["requests"] / r["wall"]
    pct = f"{100 * rps / ideal:5.1f}%" if ideal else "    - "
    steady = f"{100 * r['steady_rps'] / ideal:5.1f}%" if ideal and r.get("steady_rps") else "    - "
    err = f" err {r['errors']}" if r["errors"] else ""
    return f"{rps:7.1f} {pct} {steady} {1000 * r['cpu'] / r['requests']:6.2f}{err}"


#: ``--smoke``: one small point, a short ceiling, both clients (tests/bench/test_benches.py).
SMOKE = {"grid": "1x4", "delay_s": 0.05, "waves": 3, "ceiling_requests": 64, "no_fallback": True}


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--grid", default=None, help="N x C points, comma-separated, each optionally @delay: 1x64,2x128,4x256@4"
    )
    ap.add_argument("--endpoints", type=int, default=None, help="with --concurrency: a one-point grid N x C")
    ap.add_argument("--concurrency", type=int, default=None)
    ap.add_argument("--delay-s", type=float, default=1.0, help="server delay of points without @delay")
    ap.add_argument("--waves", type=int, default=10, help="requests per measurement = waves * N * C ...")
    ap.add_argument("--max-requests", type=int, default=12000, help="... but at most this many")
    ap.add_argument(
        "--ceiling-requests", type=int, default=4000, help="requests for the zero-latency ceiling (0: skip)"
    )
    ap.add_argument(
        "--cpu-bound-fraction",
        type=float,
        default=0.5,
        help="a point is CPU-bound when its ideal exceeds this fraction of the pipeline's ceiling; it "
        "is repeated at the shortest delay * 2**k whose ideal is at most half that",
    )
    ap.add_argument("--no-fallback", action="store_true", help="do not repeat CPU-bound points at a longer delay")
    ap.add_argument("--clients", default="pipeline,naive", help="which clients to measure")
    ap.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="pipeline: generation.client_processes (client processes for the one shard; their CPU is "
        "counted in the client CPU)",
    )
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout")
    ap.add_argument(
        "--measure-timeout-s",
        type=float,
        default=0.0,
        help="wall-clock limit per measurement (default 60 s + 3x its ideal duration)",
    )
    ap.add_argument("--child", choices=["pipeline", "naive"], help=argparse.SUPPRESS)
    ap.add_argument("--urls", help=argparse.SUPPRESS)
    ap.add_argument("--conc", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=0, help="requests per measurement (overrides --waves)")
    ap.add_argument("--smoke", action="store_true", help=f"tiny sizes (seconds), for the suite's smoke test: {SMOKE}")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    if args.child:
        return child(args)

    if args.grid is None:
        args.grid = (
            f"{args.endpoints}x{args.concurrency}" if args.endpoints and args.concurrency else "1x64,2x128,4x256"
        )
    grid = parse_grid(args.grid, args.delay_s)
    kinds = [k for k in args.clients.split(",") if k]
    print(
        f"{os.cpu_count()} CPUs, load {load()} (1/5/15 min); per-request timeout {args.timeout_s:g} s; "
        f"pipeline client processes {args.client_processes}"
    )

    ceiling = None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.ceiling_requests:
            servers = start_servers(1, 0.0, tmp)
            try:
                res = {k: measure(k, servers, 64, args.ceiling_requests, 0.0, args) for k in kinds}
            finally:
                stop_servers(servers)
            print(f"zero-latency ceiling: 1 endpoint x 64, delay 0, {args.ceiling_requests} requests (load {load()})")
            for k, r in res.items():
                if "timeout" in r:
                    print(f"  {k:9s} timeout")
                    continue
                print(
                    f"  {k:9s} {r['requests'] / r['wall']:7.1f} req/s, client CPU {1000 * r['cpu'] / r['requests']:.2f} s per 1k req "
                    f"({100 * r['cpu'] / r['wall']:.0f}% of a core), "
                    f"server CPU {1000 * r['server_cpu'] / r['requests']:.2f} s per 1k req, errors {r['errors']}"
                )
            if "pipeline" in res and "timeout" not in res["pipeline"]:
                ceiling = res["pipeline"]["requests"] / res["pipeline"]["wall"]
            if len(res) == 2 and all("timeout" not in r for r in res.values()):
                print(f"  ratio pipeline/naive: {res['naive']['wall'] / res['pipeline']['wall']:.2f}x requests/s")

        points = []
        for n_ep, conc, delay in grid:
            points.append((n_ep, conc, delay))
            ideal = n_ep * conc / delay
            if ceiling and ideal > args.cpu_bound_fraction * ceiling and not args.no_fallback:
                k = 1
                while n_ep * conc / (delay * 2**k) > args.cpu_bound_fraction / 2 * ceiling:
                    k += 1
                points.append((n_ep, conc, delay * 2**k))

        hdr = f"{'N x C':>8s} {'delay':>5s} {'ideal':>6s} {'limit':>5s} {'req':>6s} |"
        sub = "  req/s %ideal steady CPU/1k"
        print()
        print(
            hdr
            + "".join(f" {k + ':':<28s} |" for k in kinds)
            + (" gain vs naive  |" if len(kinds) == 2 else "")
            + " server CPU/1k"
        )
        print(
            " " * len(hdr)
            + "".join(f" {sub} |" for _ in kinds)
            + ("  req/s CPU/req |" if len(kinds) == 2 else "")
            + " "
            + "/".join(kinds)
        )
        for n_ep, conc, delay in points:
            ideal = n_ep * conc / delay
            n = args.requests or min(args.waves * n_ep * conc, args.max_requests)
            n = max(n, n_ep * conc)
            limit = "-" if ceiling is None else ("CPU" if ideal > args.cpu_bound_fraction * ceiling else "delay")
            servers = start_servers(n_ep, delay, tmp)
            try:
                res = {k: measure(k, servers, conc, n, delay, args) for k in kinds}
            finally:
                stop_servers(servers)
            row = f"{f'{n_ep}x{conc}':>8s} {delay:5g} {ideal:6.0f} {limit:>5s} {n:6d} |"
            row += "".join(f" {fmt_client(r, ideal)} |" for r in res.values())
            if len(kinds) == 2 and all("timeout" not in r for r in res.values()):
                p, q = res["pipeline"], res["naive"]
                row += f" {q['wall'] / p['wall']:5.2f}x  {(q['cpu'] / q['requests']) / max(p['cpu'] / p['requests'], 1e-9):5.2f}x |"
            elif len(kinds) == 2:
                row += f" {'-':>15s} |"
            srv = [f"{1000 * r['server_cpu'] / r['requests']:.2f}" if "timeout" not in r else "-" for r in res.values()]
            print(row + " " + "/".join(srv) + f"   (load {load()})", flush=True)
    print(
        "\nreq/s: requests / wall (ramp-up and drain included); %ideal: of N*C/delay; steady: N*C / mean client "
        "latency after the first two waves, % of ideal; CPU/1k: client CPU s per 1,000 requests; gain vs naive: "
        "requests/s pipeline / naive and CPU per request naive / pipeline (above 1 = the pipeline is better)."
    )
    if ceiling:
        print(
            f"limit: 'CPU' = ideal above {args.cpu_bound_fraction:g} x the pipeline's zero-latency ceiling "
            f"({ceiling:.0f} req/s, where its event loop fills one core): the client's core, shared with the servers "
            f"on this box, bounds that point, not the delay (compare req/s with the ceiling); 'delay' = ideal below "
            f"that, so %ideal measures the client's overhead."
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
