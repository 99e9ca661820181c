"""``train.target_features: stream`` on CPU with real hf feature servers (subprocesses of
``python -m dflash_pipeline.features serve``): the request contract, a stream run equal to a shards run,
the bounded window, the scratch check, a server SIGKILLed mid-epoch, every server gone (state saved, the
rerun resumes at the same batch), and the server on an MLA twin (DeepSeek-V3)."""

from __future__ import annotations

import functools
import json
import re
import signal
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FAST_FLEET, FeatureServer
from test_features import LAYERS, TRAIN_CFG, token_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_pipeline.features import FeatureClient, StreamError, fleet_config
from dflash_pipeline.features.extract import extract_shard
from dflash_pipeline.features.hf_backend import HFExtractor

REPO = Path(__file__).resolve().parents[3]
#: A feature server serving LAYERS (:class:`conftest.FeatureServer`).
Server = functools.partial(FeatureServer, layers=LAYERS)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3 target, two token shards and their hf feature shards (bf16, no last hidden)."""
    root = tmp_path_factory.mktemp("stream")
    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    target = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        target.lm_head.weight.mul_(40.0)
    target.save_pretrained(root / "target")
    tokens = [
        token_shard(root / "a.parquet", 24, 0),
        token_shard(root / "b.parquet", 10, 1),
    ]
    feats = []
    for t in tokens:
        out = root / (t.stem + ".safetensors")
        extract_shard(
            t,
            out,
            target_dir=root / "target",
            target_layer_ids=LAYERS,
            hidden_size=32,
            num_hidden_layers=4,
            backend="hf",
            dtype="bfloat16",
            last_hidden=False,
        )
        feats.append(out)
    probe = {
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "tie_word_embeddings": False,
        "drafter": {
            "block_size": 4,
            "num_draft_layers": 1,
            "target_layer_ids": LAYERS,
            "mask_token_id": 79,
        },
    }
    return root, probe, tokens, feats


#: The key the module's server requires and the variable its clients read it from.
KEY_ENV, KEY = "DFLASH_TEST_STREAM_KEY", "stream-test-key-3f9a"


@pytest.fixture(scope="module")
def server(setup):
    """The module's feature server; it requires :data:`KEY` (clients name :data:`KEY_ENV`)."""
    root = setup[0]
    s = Server(root / "target", root / "scratch0", api_key=KEY)
    yield s
    s.kill()


@pytest.fixture(autouse=True)
def _key_env(monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)


def _client(urls, transport="path", last_hidden=False, fleet=FAST_FLEET, scratch=None):
    eps = [{"base_url": u, "max_concurrency": 4, "transport": transport, "api_key_env": KEY_ENV} for u in urls]
    c = FeatureClient(
        eps,
        fleet_config(fleet, None),
        num_layers=len(LAYERS),
        hidden_size=32,
        last_hidden=last_hidden,
        scratch_dir=scratch,
    )
    c.start()
    return c


def _log(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()]


def _train(setup, out_dir, mode, stream=None, **cfg):
    from dflash_pipeline.train import train

    root, probe, tokens, feats = setup
    return train(
        token_shards=tokens,
        feature_shards=feats if mode == "shards" else (),
        probe=probe,
        target_dir=root / "target",
        out_dir=out_dir,
        cfg=dict(TRAIN_CFG, target_features=mode, **cfg),
        stream=stream,
    )


@pytest.fixture(scope="module")
def shards_run(setup, tmp_path_factory):
    out = tmp_path_factory.mktemp("shards-run")
    summary = _train(setup, out, "shards", trace_batches=True)
    return out, summary


def test_server_contract_path_and_bytes(setup, server):
    """Both transports give the hf extractor's features bit for bit (bf16-rounded); the scratch file is
    deleted once read; a token id outside the vocabulary is a client error (not retried)."""
    root = setup[0]
    recs = [np.arange(3, 3 + n) % 80 for n in (5, 17, 9)]
    h = HFExtractor(root / "target", LAYERS, num_hidden_layers=4)
    want = [next(iter(h.run([0], [r])))[1].to(torch.bfloat16) for r in recs]
    for transport in ("path", "bytes"):
        c = _client([server.url], transport, scratch=server.scratch)
        try:
            got = c.fetch_all(recs)
            with pytest.raises(StreamError, match=r"HTTP 400.*token id 99 outside the vocabulary"):
                c.submit(np.array([5, 99])).result()
        finally:
            c.close()
        for g, w in zip(got, want):
            assert torch.equal(g.features, w)
        assert list(server.scratch.iterdir()) == []
        assert (c.stats["peak_scratch_bytes"] > 0) == (transport == "path")


def test_the_server_answers_401_without_its_key(server):
    """The CLI server started with a key in its environment: 401 on the feature routes and the model list
    without it or with a wrong one (the client's requests, with it, are the contract test above)."""
    import urllib.error
    import urllib.request

    body = json.dumps({"prompt": [1, 2, 3]}).encode()
    for path, auth in [(p, a) for p in ("/completions", "/features", "/models") for a in (None, "Bearer wrong")]:
        req = urllib.request.Request(server.url + path, data=None if path == "/models" else body)
        if auth:
            req.add_header("Authorization", auth)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 401, (path, auth)


def test_a_server_tapping_other_layers_stops_the_client_at_once(server):
    """A client told to expect one more layer than the server taps (a server started for another drafter)
    gets a StreamError naming both shapes at the first answer; the record is not re-sent (it was, forever:
    the server answers its health probe, so the breaker never opened)."""
    eps = [{"base_url": server.url, "max_concurrency": 1, "transport": "path", "api_key_env": KEY_ENV}]
    c = FeatureClient(
        eps,
        fleet_config(FAST_FLEET, None),
        num_layers=len(LAYERS) + 1,
        hidden_size=32,
        scratch_dir=server.scratch,
    )
    c.start()
    try:
        with pytest.raises(StreamError, match=r"hidden_states \(6, 2, 32\), expected \(6, 3, 32\)"):
            c.submit(np.arange(6)).result(timeout=120)
    finally:
        c.close()
    assert c.stats["requests"] == 1 and c.stats["retries"] == 0


def test_a_server_tapping_other_layers_of_the_same_count_stops_the_client_at_once(server):
    """A server started with other --layer-ids of the same count (the shapes agree) names its aux ids in each
    answer's metadata; a client expecting the probe's refuses the first answer, naming both (it trained on
    the wrong layers before, and exported a config.json naming the right ones)."""
    from dflash_pipeline.target.layer_ids import aux_hidden_state_ids

    served = aux_hidden_state_ids(LAYERS, 4, False)
    other = [i + 1 for i in served]
    for expect, ok in ((served, True), (other, False)):
        eps = [{"base_url": server.url, "max_concurrency": 1, "transport": "bytes", "api_key_env": KEY_ENV}]
        c = FeatureClient(
            eps, fleet_config(FAST_FLEET, None), num_layers=len(LAYERS), hidden_size=32, aux_layer_ids=expect
        )
        c.start()
        try:
            if ok:
                assert c.submit(np.arange(6)).result(timeout=120).features.shape == (6, len(LAYERS) * 32)
            else:
                want = re.escape(f"the server taps hidden_states [{','.join(map(str, served))}], expected {other}")
                with pytest.raises(StreamError, match=want):
                    c.submit(np.arange(6)).result(timeout=120)
                assert c.stats["retries"] == 0
        finally:
            c.close()


class _FailingFeatureServer:
    """An HTTP server that answers its health probe (``GET /v1/models``) and fails every feature request with
    HTTP 500, as a server does for a record it runs out of memory on: the breaker alone never opens, because
    each re-probe brings the server back in."""

    def __init__(self):
        import http.server
        import threading

        self.posts = 0
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "target", "object": "model"}]})

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.posts += 1
                self._send(500, {"error": {"message": "CUDA out of memory", "code": 500}})

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_record_every_server_fails_stops_the_client_after_max_retries():
    """A record that fails on every server that is up (HTTP 500 each time, health probes fine) is sent
    max_retries + 1 times, then the client raises a StreamError naming the record, the count and the last
    error (before, it was re-sent forever and the train job hung)."""
    srv = _FailingFeatureServer()
    try:
        c = _client([srv.url], "bytes", fleet={**FAST_FLEET, "max_retries": 2})
        try:
            with pytest.raises(StreamError, match=r"a record of 6 tokens failed 3 times \(generation\.max_retries 2\)"):
                c.submit(np.arange(6)).result(timeout=120)
        finally:
            c.close()
    finally:
        srv.close()
    assert srv.posts == 3 and c.stats["retries"] == 2


def test_stream_run_equals_shards_run(setup, server, shards_run, tmp_path):
    """Same token shards, seed and features: the stream run is the shards run (fp32 drafter, bf16 features
    on both sides, same batches) - every logged loss and the final weights are equal bit for bit, so the
    tolerance is zero. The log carries the supply/demand figures; the scratch dir is empty at the end."""
    from safetensors.torch import load_file

    ref_dir, ref = shards_run
    st = _train(
        setup,
        tmp_path / "stream",
        "stream",
        trace_batches=True,
        stream={
            "endpoints": [{"base_url": server.url, "api_key_env": KEY_ENV}],
            "scratch_dir": str(server.scratch),
            "fleet": FAST_FLEET,
        },
    )
    assert st["steps"] == ref["steps"] and st["records"] == ref["records"]
    assert [r["loss"] for r in _log(tmp_path / "stream")] == [r["loss"] for r in _log(ref_dir)]
    a, b = (
        load_file(ref_dir / "final" / "model.safetensors"),
        load_file(tmp_path / "stream" / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rec = _log(tmp_path / "stream")[-1]
    assert (
        0.0 <= rec["stream_wait_fraction"] <= 1.0 and rec["server_tokens_per_s"] > 0 and rec["trainer_tokens_per_s"] > 0
    )
    s = st["stream"]
    assert s["peak_scratch_bytes"] > 0 and s["suggested_servers_per_rank"] >= 1 and s["retries"] == 0
    assert list(server.scratch.iterdir()) == []


class _FakeClient:
    """Answers on its own schedule, no server: holds the first ``hold`` requests and then answers them
    newest first (out of order), answers later ones at once. Features of a record: its first token id."""

    def __init__(self, hold: int = 0):
        self.hold = hold
        self.pending: list[tuple[np.ndarray, Future]] = []
        self.submitted = 0
        self.stats = {"peak_scratch_bytes": 0, "retries": 0, "requests": 0}

    def submit(self, ids):
        from dflash_pipeline.features import Features

        f = Future()
        self.submitted += 1
        self.pending.append((np.asarray(ids), f))
        if self.submitted >= self.hold:
            for ids_, f_ in reversed(self.pending):
                f_.set_result(Features(torch.full((len(ids_), 4), float(ids_[0])), None, 0, 0))
            self.pending = []
        return f

    def server_tokens_per_s(self):
        return None

    def close(self):
        pass


def _batches(n, b=2, s=6):
    out = []
    for i in range(n):
        ids = torch.arange(b * s).reshape(b, s) + 100 * i
        am = torch.ones(b, s, dtype=torch.long)
        am[1, 4:] = 0
        out.append({"input_ids": ids, "attention_mask": am, "loss_mask": am.to(torch.uint8)})
    return out


def test_window_is_bounded_and_order_is_the_loaders():
    """Replies out of order still give the loader's order; at most prefetch_batches batches are requested
    ahead; a byte budget of one batch keeps one batch in flight."""
    from dflash_pipeline.train.stream import FeatureStream

    fake = _FakeClient(hold=6)  # the first 3 batches (6 records) answered newest first
    fs = FeatureStream(fake, prefetch_batches=3, max_inflight_bytes=10**9, wire_bytes_per_token=8)
    gen = fs.batches(iter(_batches(5)))
    first = next(gen)
    assert fake.submitted == 6  # 3 batches ahead, no more
    assert torch.equal(first["features"][0, :, 0], torch.zeros(6))
    assert torch.equal(first["features"][1, :4, 0], torch.full((4,), 6.0))
    assert torch.equal(first["features"][1, 4:], torch.zeros(2, 4))  # padding stays zero
    rest = list(gen)
    assert [int(b["input_ids"][0, 0]) for b in [first, *rest]] == [
        0,
        100,
        200,
        300,
        400,
    ]
    assert [float(b["features"][0, 0, 0]) for b in [first, *rest]] == [
        0.0,
        100.0,
        200.0,
        300.0,
        400.0,
    ]
    assert fs.peak_inflight == 3 * (6 + 4) * 8

    one = FeatureStream(
        _FakeClient(),
        prefetch_batches=3,
        max_inflight_bytes=10 * 8,
        wire_bytes_per_token=8,
    )
    assert len(list(one.batches(iter(_batches(3))))) == 3 and one.peak_inflight == 10 * 8


def test_refuses_to_start_when_scratch_cannot_hold_the_window(setup, server, tmp_path):
    with pytest.raises(OSError, match=r"scratch directory .* the stream window needs"):
        _train(
            setup,
            tmp_path / "big",
            "stream",
            stream={
                "endpoints": [{"base_url": server.url, "api_key_env": KEY_ENV}],
                "scratch_dir": str(server.scratch),
                "fleet": FAST_FLEET,
                "prefetch_batches": 10**12,
                "max_inflight_bytes": 2**62,
            },
        )


def test_server_sigkilled_mid_epoch_costs_only_time(setup, shards_run, tmp_path, monkeypatch):
    """Two servers; one is SIGKILLed after the third batch. Its requests are retried on the other, and the
    run is still the shards run (equal losses)."""
    from dflash_pipeline.train import stream as S

    root = setup[0]
    a, b = (
        Server(root / "target", tmp_path / "sa"),
        Server(root / "target", tmp_path / "sb"),
    )
    real = S.FeatureStream._assemble
    seen = []

    def assemble(self, p, results):
        seen.append(1)
        if len(seen) == 3:
            b.kill()
        return real(self, p, results)

    monkeypatch.setattr(S.FeatureStream, "_assemble", assemble)
    try:
        st = _train(
            setup,
            tmp_path / "run",
            "stream",
            stream={
                "endpoints": [{"base_url": a.url}, {"base_url": b.url}],
                "scratch_dir": str(tmp_path),
                "fleet": FAST_FLEET,
            },
        )
    finally:
        a.kill()
        b.kill()
    assert b.proc.returncode == -signal.SIGKILL and len(seen) > 3
    assert [r["loss"] for r in _log(tmp_path / "run")] == [r["loss"] for r in _log(shards_run[0])]
    assert st["stream"]["retries"] >= 1


def _health(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as r:
        return json.loads(r.read())


def test_a_server_that_hangs_costs_only_time(setup, shards_run, tmp_path):
    """Two servers; the second accepts every feature request after its first 3 and never answers (its
    GET /v1/models still does). The request timeout fails those requests, the fleet retries them on the
    first server, and the run is the shards run: equal losses and final weights, no record lost or doubled
    (the healthy server computed exactly the records the hung one did not answer)."""
    from safetensors.torch import load_file

    root = setup[0]
    a = Server(root / "target", tmp_path / "sa")
    b = Server(root / "target", tmp_path / "sb", extra=("--hang-after", "3"))
    # the hung server stays out once its requests time out; 8 s is 10x a feature request of this tiny target on a
    # loaded 2-core box, and what each hung request costs the test
    fleet = {**FAST_FLEET, "endpoint_reprobe_s": 600, "request_timeout_s": 8}
    try:
        st = _train(
            setup,
            tmp_path / "run",
            "stream",
            stream={
                "endpoints": [{"base_url": a.url}, {"base_url": b.url}],
                "scratch_dir": str(tmp_path),
                "fleet": fleet,
            },
        )
        ha, hb = _health(a.url), _health(b.url)
    finally:
        a.kill()
        b.kill()
    assert hb["requests"] == 3 and hb["hung"] >= 1
    assert st["stream"]["retries"] == hb["hung"]
    assert ha["requests"] + hb["requests"] == st["stream"]["requests"]  # each record computed once
    assert [r["loss"] for r in _log(tmp_path / "run")] == [r["loss"] for r in _log(shards_run[0])]
    w, ref = (
        load_file(tmp_path / "run" / "final" / "model.safetensors"),
        load_file(shards_run[0] / "final" / "model.safetensors"),
    )
    assert all(torch.equal(w[k], ref[k]) for k in ref)


def test_all_servers_gone_saves_state_and_resume_continues(setup, shards_run, tmp_path, monkeypatch):
    """The only server dies mid-epoch: the job fails with StreamError naming the breaker, after saving the
    state of the steps done; a rerun against a new server resumes there and feeds exactly the batches the
    uninterrupted run fed (batch traces equal), to the same step count."""
    from dflash_pipeline.train import stream as S

    root = setup[0]
    a = Server(root / "target", tmp_path / "sa")
    real = S.FeatureStream._assemble
    seen = []

    def assemble(self, p, results):
        seen.append(1)
        if len(seen) == 5:
            a.kill()
        return real(self, p, results)

    monkeypatch.setattr(S.FeatureStream, "_assemble", assemble)
    out = tmp_path / "run"
    with pytest.raises(StreamError, match="circuit breaker open"):
        _train(
            setup,
            out,
            "stream",
            trace_batches=True,
            save_every_steps=1000,
            stream={"endpoints": [{"base_url": a.url}], "scratch_dir": str(tmp_path), "fleet": FAST_FLEET},
        )
    a.kill()
    monkeypatch.setattr(S.FeatureStream, "_assemble", real)
    saved = sorted((out / "state").glob("*"))
    assert saved, "no state saved before the error"
    done = len(_log(out))
    assert 5 <= done < shards_run[1]["steps"]
    b = Server(root / "target", tmp_path / "sb")
    try:
        st = _train(
            setup,
            out,
            "stream",
            trace_batches=True,
            save_every_steps=1000,
            stream={"endpoints": [{"base_url": b.url}], "scratch_dir": str(tmp_path), "fleet": FAST_FLEET},
        )
    finally:
        b.kill()
    assert st["steps"] == shards_run[1]["steps"]
    steps = [r["step"] for r in _log(out)]
    assert steps == list(range(1, st["steps"] + 1))
    trace = [json.loads(x) for x in (out / "trace" / "rank0.jsonl").read_text().splitlines()]
    ref = [json.loads(x) for x in (shards_run[0] / "trace" / "rank0.jsonl").read_text().splitlines()]
    by_step = {}
    for t in trace:  # the killed run may have traced batches of its unfinished step; the rerun's count
        by_step.setdefault(t["step"], []).append(t["batch"])
    assert [t["batch"] for t in ref] == [b for s in sorted(by_step) for b in by_step[s][-1:]]


def test_malformed_answers_save_state_before_the_job_fails(setup, tmp_path):
    """A server that answers well for a while, then with bytes that are no safetensors file (the record
    retried max_retries + 1 times, each answer as bad): the train job fails with a StreamError naming the
    unusable answer, after saving the state of the steps done, as it does when every server is gone."""
    from safetensors.torch import save
    from test_stream_trust import FakeFeatureServer

    posts = []

    def answer(route, ids):
        posts.append(1)
        if len(posts) > 24:
            return "bytes", b"\x08\x00\x00\x00\x00\x00\x00\x00not json" + bytes(64)
        t = len(ids)
        hs = torch.randn(t, len(LAYERS), 32, generator=torch.Generator().manual_seed(t))
        return "bytes", save({"hidden_states": hs, "token_ids": torch.from_numpy(np.asarray(ids, dtype=np.int64))})

    srv = FakeFeatureServer(answer)
    out = tmp_path / "run"
    try:
        with pytest.raises(StreamError, match=r"failed 3 times.*unusable answer"):
            _train(
                setup,
                out,
                "stream",
                save_every_steps=1000,
                stream={
                    "endpoints": [{"base_url": srv.url, "transport": "bytes"}],
                    "fleet": {**FAST_FLEET, "max_retries": 2},
                },
            )
    finally:
        srv.close()
    assert sorted((out / "state").glob("*")), "no state saved before the error"
    assert len(_log(out)) >= 1


def test_hf_server_on_an_mla_twin(real_models_dir, tmp_path):
    """DeepSeek-V3's MLA twin (the architecture of Kimi K2/K2.6): the server's features equal the hf
    extractor's, with the last hidden state; and a stream run on the twin through that server is the shards
    run on the twin's hf feature shard, every logged loss and the final weights equal bit for bit."""
    from safetensors.torch import load_file

    from dflash_pipeline.testing import zoo
    from dflash_pipeline.train import train

    twin = zoo.build_twin(
        real_models_dir,
        "DeepSeek-V3",
        tmp_path / "ds",
        corpus_file=REPO / "data/gsm8k/train.jsonl",
    )
    tcfg = json.loads((twin / "config.json").read_text())
    n, hidden = tcfg["num_hidden_layers"], tcfg["hidden_size"]
    layers = [0, n - 1]
    tokens = token_shard(tmp_path / "t.parquet", 12, 3)  # ids < 78, inside the twin's vocabulary
    feats = tmp_path / "t.safetensors"
    extract_shard(
        tokens,
        feats,
        target_dir=twin,
        target_layer_ids=layers,
        hidden_size=hidden,
        num_hidden_layers=n,
        backend="hf",
        dtype="bfloat16",
        last_hidden=False,
    )
    probe = {
        "hidden_size": hidden,
        "num_hidden_layers": n,
        "tie_word_embeddings": bool(tcfg.get("tie_word_embeddings", False)),
        "drafter": {"block_size": 4, "num_draft_layers": 1, "target_layer_ids": layers, "mask_token_id": 79},
    }

    def run(mode, out, stream=None):
        return train(
            token_shards=[tokens],
            feature_shards=[feats] if mode == "shards" else (),
            probe=probe,
            target_dir=twin,
            out_dir=out,
            cfg=dict(TRAIN_CFG, target_features=mode, epochs=1),
            stream=stream,
        )

    ref = run("shards", tmp_path / "shards")
    s = Server(twin, tmp_path / "scratch", layers=layers, num_hidden_layers=n, last_hidden=True)
    try:
        eps = [{"base_url": s.url, "max_concurrency": 2, "transport": "path"}]
        c = FeatureClient(
            eps,
            fleet_config(FAST_FLEET, None),
            num_layers=2,
            hidden_size=hidden,
            last_hidden=True,
            scratch_dir=s.scratch,
        )
        c.start()
        try:
            rec = np.arange(10, 40)
            (got,) = c.fetch_all([rec])
        finally:
            c.close()
        st = run(
            "stream",
            tmp_path / "stream",
            # the server sends the last hidden state too (the contract check above); the trainer takes it
            {
                "endpoints": [{"base_url": s.url}],
                "scratch_dir": str(s.scratch),
                "fleet": FAST_FLEET,
                "last_hidden": True,
            },
        )
    finally:
        s.kill()
    h = HFExtractor(twin, layers, num_hidden_layers=n, last_hidden=True)
    ((_, f, last),) = list(h.run([0], [rec]))
    assert torch.equal(got.features, f.to(torch.bfloat16)) and torch.equal(got.last_hidden, last.to(torch.bfloat16))
    assert st["steps"] == ref["steps"] >= 2
    assert [r["loss"] for r in _log(tmp_path / "stream")] == [r["loss"] for r in _log(tmp_path / "shards")]
    a, b = (
        load_file(tmp_path / "shards/final/model.safetensors"),
        load_file(tmp_path / "stream/final/model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_stream_with_packing_and_heldout_matches_online(setup, server, tmp_path):
    """Packed rows (each record's features computed alone by the server) and held-out validation work
    with stream: the run ends where the online packed run ends (bf16 features vs fp32: not bit-equal)."""
    extra = {"packing": True, "validation_fraction": 0.2, "validation_every_steps": 4}
    online = _train(setup, tmp_path / "online", "online", **extra)
    st = _train(
        setup,
        tmp_path / "stream",
        "stream",
        **extra,
        stream={
            "endpoints": [{"base_url": server.url, "api_key_env": KEY_ENV}],
            "scratch_dir": str(server.scratch),
            "fleet": FAST_FLEET,
        },
    )
    assert st["steps"] == online["steps"] and st["heldout_records"] == online["heldout_records"] > 0
    lo, ls = (
        [r["loss"] for r in _log(tmp_path / "online")],
        [r["loss"] for r in _log(tmp_path / "stream")],
    )
    assert abs(lo[0] - ls[0]) <= 1e-2 * lo[0] and abs(lo[-1] - ls[-1]) <= 0.05 * lo[-1], (lo, ls)
    assert (tmp_path / "stream" / "val_log.jsonl").is_file()
