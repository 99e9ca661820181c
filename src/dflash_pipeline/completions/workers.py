"""Several client processes for one shard (`generation.client_processes > 1`).

One event loop fills a core at about 1,000-1,400 requests/s. With P processes each has its own event
loop, fleet (every endpoint's `max_concurrency` split, `_split_caps`), take-out state and breaker; they
take prompt batches from one shared queue and send finished records back. The parent is the only writer
(`on_done`: progress file, sidecar, bar), so a killed job re-sends only in-flight conversations.

Results queue messages: `("recs", [record, ...])`, `("log", wid, logger, level, text)`,
`("done", wid, stats)`, `("error", wid, message, "ConfigError" | "GenerationError")`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue as queue_mod
import sys
import threading
import time
from typing import TYPE_CHECKING, Sequence

from dflash_pipeline.core.errors import ConfigError, GenerationError
from dflash_pipeline.core.procs import die_with_parent

from .records import OnDone, RunInfo, _raise_http_log_levels, redact_url
from .stats import fleet_stats, merge_fleet_stats

if TYPE_CHECKING:  # the backend imports this module to run its client processes
    from .openai_backend import OpenAIBackend

log = logging.getLogger(__package__)  # one logger for the whole completions stage

#: Prompts per task-queue item (fewer queue round trips; small enough to keep the split dynamic).
_TASK_BATCH = 8
#: Seconds a stopping client process gets to hand back what it finished before it is terminated.
_STOP_GRACE_S = 10.0


def _split_caps(gen_cfg: dict, n: int) -> list[dict]:
    """`n` copies of `gen_cfg` whose endpoints' `max_concurrency` add up to the original caps (the
    remainders spread round-robin over the processes); each copy has `client_processes: 1`."""
    out = [{**gen_cfg, "client_processes": 1, "endpoints": []} for _ in range(n)]
    turn = 0
    for ep in gen_cfg["endpoints"]:
        cap = int(ep["max_concurrency"])
        base, extra = divmod(cap, n)
        for k in range(n):
            share = base + (1 if (k - turn) % n < extra else 0)
            out[k]["endpoints"].append({**ep, "max_concurrency": share})
        turn = (turn + extra) % n
    return out


# --- the client process


class _PromptFeed:
    """Prompts from the shared `tasks` queue into this process's asyncio queue. A daemon thread does the blocking
    gets, one batch ahead: the next batch is fetched once no more prompts are waiting locally than the last batch held.
    `None` (no more) becomes one `None` per worker."""

    def __init__(self, tasks, loop: asyncio.AbstractEventLoop, workers: int):
        self.tasks, self.loop, self.workers = tasks, loop, workers
        self.local: asyncio.Queue = asyncio.Queue()  # prompts taken from `tasks`, not yet started
        self.want = threading.Event()  # set by the loop: fetch the next batch
        self.fetching = True
        self.low = 0

    def start(self) -> None:
        self.want.set()
        threading.Thread(target=self._fetch, daemon=True, name="prompt-fetch").start()

    def _fetch(self) -> None:
        while True:
            self.want.wait()
            self.want.clear()
            batch = self.tasks.get()
            self.loop.call_soon_threadsafe(self._deliver, batch)
            if batch is None:
                return

    def refill(self) -> None:
        """Ask for the next batch when the local queue runs low (called as a worker takes a prompt)."""
        if not self.fetching and self.local.qsize() <= self.low:
            self.fetching = True
            self.want.set()

    def _deliver(self, batch) -> None:
        self.fetching = False
        if batch is None:
            self.fetching = True  # no more fetches
            for _ in range(self.workers):
                self.local.put_nowait(None)
            return
        self.low = len(batch)
        for p in batch:
            self.local.put_nowait(p)
        self.refill()

    async def get(self) -> dict | None:
        return await self.local.get()


def _cancel_on_stop(stop, loop: asyncio.AbstractEventLoop, main: asyncio.Task) -> None:
    """Cancel `main` once the parent sets `stop`. Polls: waiting on a multiprocessing.Event blocks its
    setter once a waiter died."""
    while not stop.value:
        time.sleep(0.1)
    try:
        loop.call_soon_threadsafe(main.cancel)
    except RuntimeError:  # the loop has already finished
        pass


async def serve(backend: OpenAIBackend, tasks, emit: OnDone, info: RunInfo, stop) -> dict | None:
    """One client process's loop: conversations from the shared `tasks` queue (batches of prompts,
    `None` = no more) through this process's fleet, each finished record to `emit`. Returns the
    fleet's stats, or None when the parent's `stop` flag ended it early."""
    loop = asyncio.get_running_loop()
    fleet = backend._make_fleet()
    n = sum(ep.max_concurrency for ep in fleet.eps)
    feed = _PromptFeed(tasks, loop, n)

    async def worker() -> None:
        while True:
            prompt = await feed.get()
            if prompt is None:
                return
            feed.refill()
            emit(await backend._conversation(fleet, prompt, info))

    threading.Thread(
        target=_cancel_on_stop, args=(stop, loop, asyncio.current_task()), daemon=True, name="stop-watch"
    ).start()
    workers = []
    try:
        await fleet.start()
        feed.start()
        workers = [asyncio.ensure_future(worker()) for _ in range(n)]
        await asyncio.gather(*workers)
    except asyncio.CancelledError:
        if stop.value:
            return None
        raise
    finally:
        for t in workers:
            t.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await fleet.close()
    return fleet_stats(backend.stats, fleet.eps)


class _ForwardLog(logging.Handler):
    """A client process's log records, sent to the parent (which logs them under its own handlers)."""

    def __init__(self, results, wid: int):
        super().__init__()
        self.results, self.wid = results, wid

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            if record.exc_info:
                msg += "\n" + logging.Formatter().formatException(record.exc_info)
            self.results.put(("log", self.wid, record.name, record.levelno, msg))
        except Exception:  # logging must never take the client down
            pass


def _client_process(
    wid: int, ppid: int, gen_cfg: dict, init_kw: dict, info: RunInfo, tasks, results, stop, log_level: int
) -> None:
    """Entry point of client process `wid` (spawned by `run_client_processes`)."""
    die_with_parent(ppid)
    root = logging.getLogger()
    root.handlers[:] = [_ForwardLog(results, wid)]
    root.setLevel(log_level)
    _raise_http_log_levels()  # for the life of this process (its log records travel through the results queue)
    try:
        backend_cls = init_kw.pop("backend_cls")  # the parent's class (pickled by reference), not an import
        backend = backend_cls(gen_cfg, **init_kw)  # API keys from the inherited environment, as in the parent
        out: list[dict] = []
        loop_ref: list = []

        def flush() -> None:
            results.put(("recs", list(out)))
            out.clear()

        def emit(record: dict) -> None:  # one message per loop iteration, however many finished in it
            if not out:
                loop_ref[0].call_soon(flush)
            out.append(record)

        async def main() -> dict | None:
            loop_ref.append(asyncio.get_running_loop())
            return await serve(backend, tasks, emit, info, stop)

        stats = asyncio.run(main())
        if out:
            flush()
        results.put(("done", wid, stats))
    except (GenerationError, ConfigError) as exc:  # re-raised by the parent as the same type
        results.put(("error", wid, str(exc), type(exc).__name__))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the job
        log.error("client process %d failed", wid, exc_info=True)
        results.put(("error", wid, f"client process {wid} failed: {type(exc).__name__}: {exc}", "GenerationError"))


class _BareMain:
    """While starting "spawn" children, hide the `__main__` module: a child re-imports the parent's
    main script unless it is guarded by `if __name__ == "__main__"`, and Snakemake's `script:` files
    are not (the child would run the job again). The children need nothing from it."""

    def __enter__(self):
        import types

        self.saved = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")

    def __exit__(self, *exc):
        if self.saved is not None:
            sys.modules["__main__"] = self.saved


# --- the parent


class _Parent:
    """The parent's side of the results queue: records to `on_done`, log lines to its own loggers, each process's end
    (stats or error); a process that exited without a word counts as crashed after 1 s."""

    def __init__(self, procs: list, on_done: OnDone):
        self.procs, self.on_done = procs, on_done
        self.finished: dict[int, dict | None] = {}
        self.error: str | None = None
        self.error_type: type[Exception] = GenerationError
        self.exited_at: dict[int, float] = {}

    def _fail(self, message: str, error_type: type[Exception] = GenerationError) -> None:
        if self.error is None:  # the first error is the one raised
            self.error, self.error_type = message, error_type

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "recs":
            for rec in msg[1]:
                self.on_done(rec)
        elif kind == "log":
            _, wid, name, levelno, text = msg
            logging.getLogger(name).log(levelno, "[client process %d] %s", wid, text)
        elif kind == "done":
            self.finished[msg[1]] = msg[2]
        elif kind == "error":
            self.finished[msg[1]] = None
            self._fail(msg[2], ConfigError if msg[3] == "ConfigError" else GenerationError)

    def check_exits(self, now: float) -> None:
        for i, p in enumerate(self.procs):
            if i in self.finished or p.exitcode is None:
                continue
            if now - self.exited_at.setdefault(i, now) > 1.0:
                self.finished[i] = None
                self._fail(f"client process {i} exited with code {p.exitcode} before finishing (see the log above)")

    def loop(self, results, stop) -> None:
        """Until every process finished, or `_STOP_GRACE_S` after the first error."""
        next_check = time.monotonic() + 0.5
        stop_deadline = None
        while True:
            try:
                msg = results.get(timeout=0.2)
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                self.handle(msg)
            now = time.monotonic()
            if msg is None or now >= next_check:
                next_check = now + 0.5
                self.check_exits(now)
            if self.error is not None and stop_deadline is None:
                stop.value = 1
                stop_deadline = now + _STOP_GRACE_S
            if len(self.finished) == len(self.procs):
                return
            if stop_deadline is not None and now > stop_deadline:
                return


def _shutdown(procs: list, stop, tasks, results) -> None:
    """Stop every client process (5 s to end, then killed) and close the queues."""
    stop.value = 1
    deadline = time.monotonic() + 5.0
    for p in procs:
        if p.pid is not None:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)
    tasks.cancel_join_thread()
    tasks.close()
    results.close()


def run_client_processes(
    backend: OpenAIBackend, prompts: Sequence[dict], on_done: OnDone, info: RunInfo, n: int
) -> dict:
    """`OpenAIBackend.run` over `n` client processes. Returns the merged `stats.fleet_stats` plus `client_processes`.
    Raises the first process's ConfigError or GenerationError."""
    import multiprocessing

    if not backend._probed:  # once here: every process sends and records the same, checked model, and a
        asyncio.run(backend._discover())  # configuration error is raised here rather than in each process
    info.model = backend.model
    init_kw = {**backend._init_kw, "resolved_model": backend.model, "backend_cls": type(backend)}
    ctx = multiprocessing.get_context("spawn")  # not fork: the parent may hold threads
    tasks, results = ctx.Queue(), ctx.Queue()
    stop = ctx.RawValue("b", 0)  # set by the parent: end in-flight conversations and hand back what finished
    k = max(1, min(_TASK_BATCH, len(prompts) // (4 * n)))
    for i in range(0, len(prompts), k):
        tasks.put(list(prompts[i : i + k]))
    for _ in range(n):
        tasks.put(None)
    level = logging.getLogger(__package__).getEffectiveLevel()
    procs = [
        ctx.Process(
            target=_client_process,
            name=f"dflash-client-{i}",
            daemon=True,
            args=(i, os.getpid(), c, init_kw, info, tasks, results, stop, level),
        )
        for i, c in enumerate(_split_caps(backend.cfg, n))
    ]
    parent = _Parent(procs, on_done)
    try:
        with _BareMain():
            for p in procs:
                p.start()
        parent.loop(results, stop)
    finally:
        _shutdown(procs, stop, tasks, results)
    if parent.error is not None:
        raise parent.error_type(parent.error)
    total = merge_fleet_stats(parent.finished.values(), [redact_url(e["base_url"]) for e in backend.cfg["endpoints"]])
    total["client_processes"] = n
    return total
