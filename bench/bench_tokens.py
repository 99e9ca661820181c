"""Tokens stage throughput (tokens/s per core) vs a naive per-record baseline, and shard peak memory.

Both paths run in this process on one core (Rust thread pools pinned to 1 thread) over the same records
and produce the same masks:

* ``tokens``: :func:`dflash_pipeline.tokens.shard.tokenize_records` (string-level render diffs with the
  compiled template called directly - the same sandboxed Jinja template ``apply_chat_template`` uses,
  without its per-call overhead -, one batched offset-mapping tokenizer call per 256 sequences, each
  conversation tokenized once when the template is prefix-stable).
* ``server ids`` ([3]): the same single-turn records carrying the prompt/output token ids a server returns
  (vLLM ``return_token_ids``, or the ids ``generation.api: completions`` sends), tokenized with
  ``tokens.use_server_token_ids``: no template render and no BPE encode at all.
* ``naive``: per record and assistant turn, ``apply_chat_template(..., tokenize=True)`` of the
  generation-prompt render and of the render with the turn, mask = token-prefix difference (the usual
  "re-render and re-encode every prefix" approach).

Usage::

    python bench/bench_tokens.py                     # 2000 conversations, throughput only
    python bench/bench_tokens.py --peak-records 100000   # + peak RSS of tokenize_shard on a 100k shard
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from dflash_pipeline import demo

from dflash_pipeline.target import chat

from dflash_pipeline.core import shards  # noqa: E402
from dflash_pipeline.core.contracts import COMPLETION_SCHEMA  # noqa: E402
from dflash_pipeline.tokens.shard import tokenize_records, tokenize_shard  # noqa: E402


def load_conversations(n: int | None, seed: int = 0) -> list[list[dict]]:
    """Real conversations: GSM8K (single turn) and ShareGPT (multi-turn), assistant text as 'generated';
    ``n`` of them (cycled), or all once with ``n=None``."""
    convs: list[list[dict]] = []
    with open(REPO / "data" / "gsm8k" / "train.jsonl", encoding="utf-8") as fh:
        for line in fh:
            r = json.loads(line)
            convs.append([{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}])
    for rec in json.loads((REPO / "data" / "sharegpt" / "sharegpt.json").read_text(encoding="utf-8")):
        msgs = []
        for t in rec.get("conversations", []):
            role = {"human": "user", "gpt": "assistant"}.get(t.get("from"))
            if role is None or (msgs and msgs[-1]["role"] == role) or (not msgs and role != "user"):
                break
            msgs.append({"role": role, "content": t.get("value", "")})
        if len(msgs) >= 2 and msgs[-1]["role"] == "assistant":
            convs.append(msgs)
    rng = random.Random(seed)
    rng.shuffle(convs)
    if n is None:
        return convs
    return (convs * (n // max(len(convs), 1) + 1))[:n]


def completion_records(convs: list[list[dict]], thinking: str) -> list[dict]:
    recs = []
    for i, msgs in enumerate(convs):
        n = sum(m["role"] == "assistant" for m in msgs)
        recs.append(
            {
                "prompt_id": f"p{i}",
                "dataset": "bench",
                "messages": [dict(m, reasoning_content=None) for m in msgs],
                "turns": [{"finish_reason": "stop"} for _ in range(n)],
                "model": "bench",
                "sampling": "{}",
                "thinking": thinking,
                "status": "ok",
                "error": None,
            }
        )
    return recs


def naive(tokenizer, records, max_length: int) -> tuple[int, int]:
    """Per record and turn: tokenize both renders, mask by token-prefix difference. Returns (tokens, loss)."""
    n_tok = n_loss = 0
    for rec in records:
        msgs = rec["messages"]
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            kw = chat.template_kwargs(rec["thinking"])
            p = tokenizer.apply_chat_template(
                chat.template_messages(msgs[:i]), tokenize=True, return_dict=False, add_generation_prompt=True, **kw
            )
            q = tokenizer.apply_chat_template(
                chat.template_messages(msgs[: i + 1]),
                tokenize=True,
                return_dict=False,
                add_generation_prompt=False,
                **kw,
            )
            if q[: len(p)] != p:
                continue
            mask = [0] * len(p) + [1] * (len(q) - len(p) - 1) + [0]  # trailing "\n" after <|im_end|>
            q, mask = q[:max_length], mask[:max_length]
            n_tok += len(q)
            n_loss += sum(mask)
    return n_tok, n_loss


def peak_memory(tokenizer_dir: Path, n: int, thinking: str) -> dict:
    """Write an n-record completion shard, tokenize it in a child process, report its peak RSS."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "c.parquet"
        recs = completion_records(load_conversations(n), thinking)
        shards.write_parquet(src, shards.table_from_records(recs, COMPLETION_SCHEMA))
        del recs
        code = (
            "import json,resource,sys,time; sys.path.insert(0, %r)\n"
            "from dflash_pipeline.tokens.shard import tokenize_shard\n"
            "t=time.perf_counter(); s=tokenize_shard(%r, %r, target_dir=%r, tokens_cfg={'max_length':3072,'last_turn_only':False})\n"
            "print(json.dumps({'seconds': time.perf_counter()-t, 'records_out': s['records_out'], 'num_tokens': s['num_tokens'],"
            " 'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024}))"
        ) % (str(REPO / "src"), str(src), str(Path(tmp) / "t.parquet"), str(tokenizer_dir))
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=os.environ)
        return json.loads(out.stdout.strip().splitlines()[-1])


#: Prefix-stable ChatML (Qwen2.5 style): earlier turns render the same once later turns exist, so a
#: multi-turn conversation is one training sequence.
CHATML_PREFIX_STABLE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def server_id_records(tok, records: list[dict]) -> list[dict]:
    """``records`` (single turn) with ``turns[0].prompt_token_ids``/``output_token_ids`` filled the way a
    server fills them: the generation-prompt render encoded, and the reply's ids plus the end-of-turn id."""
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for rec in records:
        msgs = chat.template_messages(rec["messages"])
        p = tok.apply_chat_template(
            msgs[:-1],
            tokenize=True,
            return_dict=False,
            add_generation_prompt=True,
            **chat.template_kwargs(rec["thinking"]),
        )
        o = tok.encode(msgs[-1]["content"], add_special_tokens=False) + [eot]
        out.append({**rec, "turns": [{"finish_reason": "stop", "prompt_token_ids": p, "output_token_ids": o}]})
    return out


def measure(tok, records: list[dict], max_length: int, use_server_token_ids: bool = False) -> dict:
    """Both paths over the same records (after a warm-up); returns seconds and token counts."""
    kw = {"max_length": max_length, "use_server_token_ids": use_server_token_ids}
    naive(tok, records[:50], max_length)  # warm-up (template compile)
    list(tokenize_records(tok, records[:50], **kw))
    t = time.perf_counter()
    stats: dict = {}
    out = list(tokenize_records(tok, records, stats=stats, **kw))
    fast_s = time.perf_counter() - t
    t = time.perf_counter()
    naive_tokens, naive_loss = naive(tok, records, max_length)
    naive_s = time.perf_counter() - t
    return {
        "fast_s": fast_s,
        "fast_tokens": sum(r["num_tokens"] for r in out),
        "stats": stats,
        "naive_s": naive_s,
        "naive_tokens": naive_tokens,
        "naive_loss": naive_loss,
    }


def report(m: dict, n_records: int) -> None:
    st = m["stats"]
    print(
        f"  tokens.tokenize_records: {m['fast_tokens']:,} tokens ({st['num_loss_tokens']:,} supervised, "
        f"{st['records_out']} sequences) in {m['fast_s']:.2f} s = {m['fast_tokens'] / m['fast_s']:,.0f} tokens/s/core"
    )
    print(
        f"  naive per-turn re-render + re-encode: {m['naive_tokens']:,} tokens ({m['naive_loss']:,} supervised) in "
        f"{m['naive_s']:.2f} s = {m['naive_tokens'] / m['naive_s']:,.0f} tokens/s/core"
    )
    print(
        f"  speedup: {(m['fast_tokens'] / m['fast_s']) / (m['naive_tokens'] / m['naive_s']):.2f}x tokens/s; "
        f"{m['naive_s'] / m['fast_s']:.2f}x conversations/s ({n_records / m['fast_s']:,.0f} vs "
        f"{n_records / m['naive_s']:,.0f})"
    )


def breakdown(tok, records: list[dict], naive_s: float) -> None:
    """Where the pipeline's time goes: the two renders per turn and one encode per sequence are work the
    naive path does too, so ``naive_s / (render + encode)`` bounds any render-diff implementation."""
    from dflash_pipeline.tokens.shard import conversation_sequences

    convs = [chat.template_messages(r["messages"]) for r in records]
    ps, qs = [], []
    for msgs in convs:
        for i, msg in enumerate(msgs):
            if msg["role"] == "assistant":
                ps.append(msgs[:i])
                qs.append(msgs[: i + 1])
    t = time.perf_counter()
    chat.render_many(tok, ps, thinking=records[0]["thinking"], add_generation_prompt=True)
    chat.render_many(tok, qs, thinking=records[0]["thinking"], add_generation_prompt=False)
    render_s = time.perf_counter() - t
    texts = [s.text for r in records for s in conversation_sequences(tok, r["messages"], thinking=r["thinking"])]
    t = time.perf_counter()
    tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    encode_s = time.perf_counter() - t
    print(
        f"  breakdown: 2 template renders per turn {render_s:.2f} s (sandboxed Jinja, as apply_chat_template), "
        f"one BPE encode per sequence {encode_s:.2f} s; the naive path pays both as well, so no render-diff "
        f"implementation can beat it by more than {naive_s / (render_s + encode_s):.2f}x on these records"
    )


#: ``--smoke``: a few conversations and a small vocabulary (tests/bench/test_benches.py).
SMOKE = {"records": 40, "vocab_size": 512, "max_length": 512, "peak_records": 0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=2000, help="conversations in the throughput run")
    ap.add_argument("--thinking", default="disable", choices=["none", "disable"])
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-length", type=int, default=3072)
    ap.add_argument(
        "--peak-records", type=int, default=0, help="also measure peak RSS for a shard of this many records"
    )
    ap.add_argument("--smoke", action="store_true", help=f"tiny sizes (seconds), for the suite's smoke test: {SMOKE}")
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)

    convs = load_conversations(args.records)
    t0 = time.perf_counter()
    tok = demo.train_tokenizer((m["content"] for c in convs[:3000] for m in c), vocab_size=args.vocab_size)
    print(f"tokenizer: byte-level BPE vocab {len(tok)} (trained in {time.perf_counter() - t0:.1f} s), one core")

    records = completion_records(convs, args.thinking)
    turns = sum(len(r["turns"]) for r in records)
    print(
        f"[1] GSM8K + ShareGPT mix, demo Qwen3-style template (rewrites earlier turns): {len(records)} "
        f"conversations, {turns} assistant turns, thinking={args.thinking}"
    )
    m = measure(tok, records, args.max_length)
    report(m, len(records))
    breakdown(tok, records, m["naive_s"])

    multi = [c for c in load_conversations(None) if sum(x["role"] == "assistant" for x in c) >= 2]
    multi = (multi * (args.records // max(len(multi), 1) + 1))[: max(args.records // 4, len(multi))]
    default_template = tok.chat_template
    tok.chat_template = CHATML_PREFIX_STABLE
    mrecs = completion_records(multi, "none")
    mturns = sum(len(r["turns"]) for r in mrecs)
    print(
        f"[2] multi-turn ShareGPT, prefix-stable ChatML template: {len(mrecs)} conversations, {mturns} "
        f"assistant turns (one sequence per conversation; the naive path re-encodes every turn's prefix)"
    )
    mm = measure(tok, mrecs, args.max_length)
    report(mm, len(mrecs))
    tok.chat_template = default_template

    single = [r for r in records if len(r["turns"]) == 1]
    with_ids = server_id_records(tok, single)
    print(
        f"[3] the single-turn records of [1] carrying server token ids (tokens.use_server_token_ids): "
        f"{len(with_ids)} conversations"
    )
    ms = measure(tok, with_ids, args.max_length, use_server_token_ids=True)
    assert ms["stats"]["server_ids_used"] == len(with_ids), ms["stats"]
    report(ms, len(with_ids))

    if args.peak_records:
        with tempfile.TemporaryDirectory() as tdir:
            tok.save_pretrained(tdir)
            pm = peak_memory(Path(tdir), args.peak_records, args.thinking)
        print(
            f"peak memory, tokenize_shard on {args.peak_records:,} records: {pm['peak_rss_mb']:.0f} MiB RSS "
            f"({pm['records_out']:,} sequences, {pm['num_tokens']:,} tokens, {pm['seconds']:.1f} s)"
        )
    print(f"(this process peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
