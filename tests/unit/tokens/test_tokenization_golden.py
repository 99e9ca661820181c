"""Golden token shards: the bytes the tokens stage writes stay those of ``workflow.TOKENIZATION_REVISION``.

rules/tokens.smk reruns tokenization (and then training and eval) in every workdir only when
``TOKENIZATION_REVISION`` changes, not on every edit of the tokenization code. This test is what makes
that safe: it tokenizes a fixed, varied set of completion records (single/multi-turn, reasoning, a
max_tokens cut, max_length truncation, error and empty records, control-token and tool-call text, unicode,
server token ids that match the render and ones that do not, ``</think>`` in an answer) through the real
:func:`dflash_pipeline.tokens.shard.tokenize_shard` path (tokenizer saved and loaded from disk) with several chat
templates — the demo target's tokenizer and zoo twins' tokenizers (:mod:`dflash_pipeline.testing.zoo`:
Qwen3 with reasoning, Llama 3.1, gpt-oss, Kimi-K2 and DeepSeek-V3.1, whose templates carry tool calling)
under several ``tokens`` settings, and compares each token shard's content (every column, the Arrow
schema, the row groups and the file metadata, as canonical JSON -> sha256, with a per-row digest so a
failure names the case and the record) with ``tests/unit/tokens/golden/token_shards.json``.

When it fails after an intended change of the token-shard bytes: bump ``TOKENIZATION_REVISION`` in
``src/dflash_pipeline/workflow/policy.py`` and regenerate the golden::

    python tests/unit/tokens/test_tokenization_golden.py --regenerate

(the golden records the revision it was made with; the test checks that it equals the constant).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":  # script mode (--regenerate): conftest lives in tests/
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import contextlib
import datetime
import hashlib
import json
import tempfile
from typing import Any, Callable

import pyarrow.parquet as pq
import pytest
from conftest import GSM8K_TRAIN, SHAREGPT, models_dir

from dflash_pipeline.core import shards
from dflash_pipeline.core.contracts import COMPLETION_SCHEMA, canonical_json
from dflash_pipeline.target import chat
from dflash_pipeline.tokens.shard import tokenize_records, tokenize_shard
from dflash_pipeline.workflow.policy import TOKENIZATION_REVISION

GOLDEN = Path(__file__).resolve().parent / "golden" / "token_shards.json"
REGENERATE = "python tests/unit/tokens/test_tokenization_golden.py --regenerate"

# --------------------------------------------------------------------------------------------------
# The completion records (one shard, tokenized by every case)
# --------------------------------------------------------------------------------------------------

LONG_ANSWER = " ".join(
    f"Step {i}: add {i} apples to the basket, which now holds {i * (i + 1) // 2}." for i in range(1, 16)
)
LONG_PROMPT = "Read this carefully. " + " ".join(f"Fact {i}: the value of x{i} is {i * 7}." for i in range(60))
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

#: (prompt_id, thinking, status, [(role, content, reasoning)], per-assistant-turn finish_reason,
#: server ids: None | "exact" (ids of what the render supervises) | "other" (ids of another text))
CONVERSATIONS: list[tuple] = [
    (
        "single",
        "disable",
        "ok",
        [("user", "What is 6 times 7?", None), ("assistant", "The answer is 42.", None)],
        ["stop"],
        None,
    ),
    (
        "reasoning",
        "save",
        "ok",
        [
            ("user", "What is 6 times 7?", None),
            ("assistant", "The answer is 42.", "Six sevens: 7, 14, 21, 28, 35, 42."),
        ],
        ["stop"],
        None,
    ),
    (
        "multi_reasoning",
        "save",
        "ok",
        [
            ("system", "You are terse.", None),
            ("user", "Hello there", None),
            ("assistant", "Hello! How can I help?", "A greeting; answer briefly."),
            ("user", "What is 12 squared?", None),
            ("assistant", "144.", "12 * 12 = 144."),
            ("user", "And its square root?", None),
            ("assistant", "12.", "sqrt(144) = 12."),
        ],
        ["stop"] * 3,
        None,
    ),
    (
        "multi_plain",
        "none",
        "ok",
        [
            ("user", "Name a colour.", None),
            ("assistant", "Blue.", None),
            ("user", "Another one?", None),
            ("assistant", "Green.", None),
        ],
        ["stop", "stop"],
        None,
    ),
    (
        "length_cut",
        "disable",
        "truncated",
        [("user", "Count to twenty.", None), ("assistant", "1, 2, 3, 4, 5, 6, 7", None)],
        ["length"],
        None,
    ),
    (
        "long_answer",
        "disable",
        "ok",
        [("user", "Explain the apples, step by step.", None), ("assistant", LONG_ANSWER, None)],
        ["stop"],
        None,
    ),
    ("long_prompt", "disable", "ok", [("user", LONG_PROMPT, None), ("assistant", "x59 is 413.", None)], ["stop"], None),
    ("error", "disable", "error", [("user", "Hi", None), ("assistant", "", None)], ["stop"], None),
    (
        "control_text",
        "disable",
        "ok",
        [
            ("user", "How do chat templates end a turn?", None),
            (
                "assistant",
                "They write <|im_end|> (ChatML), <|eot_id|> (Llama 3) or <|end|>; <think> opens reasoning.",
                None,
            ),
        ],
        ["stop"],
        None,
    ),
    (
        "tool_call_text",
        "disable",
        "ok",
        [("user", "What is the weather in Paris?", None), ("assistant", TOOL_CALL, None)],
        ["stop"],
        None,
    ),
    (
        "unicode",
        "disable",
        "ok",
        [
            ("user", "Traduis « mathématiques » en chinois. 🙂", None),
            ("assistant", "  Voilà : 数学 (shùxué) 🙂 \n", None),
        ],
        ["stop"],
        None,
    ),
    ("empty_answer", "disable", "ok", [("user", "Say nothing.", None), ("assistant", "", None)], ["stop"], None),
    (
        "think_in_answer",
        "disable",
        "ok",
        [
            ("user", "How does Qwen3 close its reasoning?", None),
            ("assistant", "It writes </think> and then the answer.", None),
        ],
        ["stop"],
        None,
    ),
    (
        "server_ids_exact",
        "disable",
        "ok",
        [("user", "What is 9 plus 10?", None), ("assistant", "19.", None)],
        ["stop"],
        "exact",
    ),
    (
        "server_ids_other",
        "disable",
        "ok",
        [("user", "What is 9 plus 10?", None), ("assistant", "Nineteen.", None)],
        ["stop"],
        "other",
    ),
    (
        "server_ids_multi",
        "none",
        "ok",
        [
            ("user", "Pick a number.", None),
            ("assistant", "Seven.", None),
            ("user", "Double it.", None),
            ("assistant", "Fourteen.", None),
        ],
        ["stop", "stop"],
        "exact",
    ),
]


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _server_ids(tok, msgs: list[dict], i: int, thinking: str, kind: str) -> tuple[list[int] | None, list[int]]:
    """(prompt_token_ids, output_token_ids) a server would return for the assistant message ``msgs[i]``:
    the rendered generation prompt and the answer followed by the end-of-turn token (``kind="other"``: the
    ids of a different answer). The prompt is None when the template cannot render it."""
    try:
        prompt = _ids(tok, chat.render(tok, msgs[:i], thinking=thinking, add_generation_prompt=True))
    except Exception:  # a template that rejects this conversation: the record then has no prompt ids
        prompt = None
    text = msgs[i]["content"] if kind == "exact" else "Something else entirely."
    return prompt, _ids(tok, text) + [tok.convert_tokens_to_ids(tok.eos_token)]


def completion_records(tok) -> list[dict]:
    """The records of :data:`CONVERSATIONS` as ``COMPLETION_SCHEMA`` dicts (server ids from ``tok``)."""
    out = []
    for pid, thinking, status, turns, finish, server in CONVERSATIONS:
        msgs = [{"role": r, "content": c, "reasoning_content": rc} for r, c, rc in turns]
        a_idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        meta = []
        for k, i in enumerate(a_idx):
            p, o = _server_ids(tok, msgs, i, thinking, server) if server else (None, None)
            meta.append(
                {
                    "finish_reason": finish[k],
                    "prompt_tokens": len(p or []),
                    "completion_tokens": len(o or []),
                    "prompt_token_ids": p,
                    "output_token_ids": o,
                    "latency_s": 0.5,
                    "endpoint": "golden",
                }
            )
        out.append(
            {
                "prompt_id": pid,
                "dataset": "golden",
                "messages": msgs,
                "turns": meta,
                "model": "golden",
                "sampling": "{}",
                "thinking": thinking,
                "status": status,
                "error": "server error" if status == "error" else None,
            }
        )
    return out


# --------------------------------------------------------------------------------------------------
# Tokenizers and cases
# --------------------------------------------------------------------------------------------------

_TOKENIZERS: dict[str, Any] = {}


def demo_tokenizer():
    """The demo target's tokenizer (same corpus and vocabulary as the session ``demo_target``)."""
    from dflash_pipeline.demo import load_corpus, train_tokenizer

    if "demo" not in _TOKENIZERS:
        convs = load_corpus([GSM8K_TRAIN, SHAREGPT])
        _TOKENIZERS["demo"] = train_tokenizer([m["content"] for c in convs for m in c], vocab_size=1024)
    return _TOKENIZERS["demo"]


def zoo_tokenizer(family: str) -> Callable[[], Any]:
    """Factory of the zoo twin's tokenizer of ``family`` (demo BPE + the family's template and specials)."""

    def build():
        from dflash_pipeline.testing import zoo

        root = models_dir()
        if root is None:
            pytest.skip("no model metadata directory (set DFLASH_MODELS_DIR)")
        if family not in _TOKENIZERS:
            tc_path = root / family / "tokenizer_config.json"
            tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else None
            template = zoo.family_template_text(root, family)
            _TOKENIZERS[family] = zoo.family_tokenizer(template, GSM8K_TRAIN, tc)
        return _TOKENIZERS[family]

    return build


#: case -> (tokenizer factory, tokens config, row_group_size)
CASES: dict[str, tuple[Callable[[], Any], dict, int]] = {
    "demo": (demo_tokenizer, {"max_length": 128, "last_turn_only": False, "strict": False}, 1024),
    "demo-last_turn-server_ids-small_groups": (
        demo_tokenizer,
        {"max_length": 64, "last_turn_only": True, "strict": False, "use_server_token_ids": True},
        5,
    ),
    "qwen3": (zoo_tokenizer("Qwen3-8B"), {"max_length": 160, "last_turn_only": False, "strict": False}, 1024),
    "qwen3-server_ids": (
        zoo_tokenizer("Qwen3-8B"),
        {"max_length": 160, "last_turn_only": False, "strict": False, "use_server_token_ids": True},
        1024,
    ),
    # Llama 3.1 and gpt-oss templates open with a system header (knowledge cutoff, date): longer sequences
    "llama3.1": (
        zoo_tokenizer("Llama-3.1-8B-Instruct"),
        {"max_length": 256, "last_turn_only": False, "strict": False},
        1024,
    ),
    "llama3.1-last_turn": (
        zoo_tokenizer("Llama-3.1-8B-Instruct"),
        {"max_length": 160, "last_turn_only": True, "strict": False},
        1024,
    ),
    "gpt-oss": (zoo_tokenizer("gpt-oss-20b"), {"max_length": 512, "last_turn_only": False, "strict": False}, 1024),
    "kimi-k2": (zoo_tokenizer("Kimi-K2-Instruct"), {"max_length": 160, "last_turn_only": False, "strict": False}, 1024),
    "deepseek-v3.1": (
        zoo_tokenizer("DeepSeek-V3.1"),
        {"max_length": 160, "last_turn_only": False, "strict": False},
        1024,
    ),
}


def _digest(obj: Any) -> str:
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


#: The day the golden was made: templates that print today's date (gpt-oss's ``strftime_now("%Y-%m-%d")``,
#: Llama 3.1's ``date_string``) render this one, so the golden does not change with the calendar.
GOLDEN_DAY = datetime.datetime(2026, 12, 1)


@contextlib.contextmanager
def _fixed_day():
    """transformers' template ``strftime_now`` (``chat_template_utils.datetime.now``) returns :data:`GOLDEN_DAY`."""
    from transformers.utils import chat_template_utils as ctu

    class _Day(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return GOLDEN_DAY

    real, ctu.datetime = ctu.datetime, _Day
    try:
        yield
    finally:
        ctu.datetime = real


def tokenize_case(name: str, work: Path) -> tuple[dict, list[dict]]:
    """Tokenize the golden records for case ``name`` through ``tokenize_shard`` (tokenizer saved to and
    loaded from ``work``) on :data:`GOLDEN_DAY`. Returns ``(summary for the golden, the shard's rows)``."""
    with _fixed_day():
        return _tokenize_case(name, work)


def _tokenize_case(name: str, work: Path) -> tuple[dict, list[dict]]:
    factory, tokens_cfg, row_group_size = CASES[name]
    tok = factory()
    target = work / name / "target"
    tok.save_pretrained(target)
    loaded = chat.load_tokenizer(target)
    completions = work / name / "completions.parquet"
    shards.write_parquet(completions, shards.table_from_records(completion_records(loaded), COMPLETION_SCHEMA))
    out = work / name / "tokens.parquet"
    tokenize_shard(completions, out, target_dir=target, tokens_cfg=tokens_cfg, row_group_size=row_group_size)
    pf = pq.ParquetFile(out)
    rows = pf.read().to_pylist()
    summary = {
        "schema": pf.schema_arrow.to_string(show_schema_metadata=False),
        "metadata": shards.read_shard_metadata(out),
        "row_groups": [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)],
        "rows": [
            [r["prompt_id"], r["turn"], r["num_tokens"], r["num_loss_tokens"], r["truncated"], _digest(r)[:16]]
            for r in rows
        ],
        "sha256": _digest(rows),
    }
    return summary, rows


def _versions() -> dict:
    import tokenizers
    import transformers

    return {"tokenizers": tokenizers.__version__, "transformers": transformers.__version__}


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


def _golden() -> dict:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def test_golden_is_of_this_revision():
    golden = _golden()
    assert golden["revision"] == TOKENIZATION_REVISION, (
        f"{GOLDEN} was made at TOKENIZATION_REVISION {golden['revision']!r}, the code says "
        f"{TOKENIZATION_REVISION!r}: regenerate the golden after bumping the revision ({REGENERATE})"
    )
    assert sorted(golden["cases"]) == sorted(CASES), f"the golden's cases differ from CASES: {REGENERATE}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_token_shard_matches_golden(name, tmp_path):
    want = _golden()["cases"][name]
    got, rows = tokenize_case(name, tmp_path)
    if got != want:
        lines = [f"case {name!r}: the token shard differs from {GOLDEN.name} (revision {TOKENIZATION_REVISION})"]
        for key in ("schema", "metadata", "row_groups"):
            if got[key] != want[key]:
                lines.append(f"  {key}: golden {want[key]!r}\n     now    {got[key]!r}")
        g_rows, w_rows = got["rows"], want["rows"]
        for i in range(max(len(g_rows), len(w_rows))):
            g = g_rows[i] if i < len(g_rows) else None
            w = w_rows[i] if i < len(w_rows) else None
            if g != w:
                lines.append(
                    f"  row {i} [prompt_id, turn, num_tokens, num_loss_tokens, truncated, digest]: golden {w} now {g}"
                )
        made_with = _golden().get("made_with")
        if made_with != _versions():
            lines.append(
                f"  (the golden was made with {made_with}, this is {_versions()}: a tokenizer library "
                f"change alone leaves existing workdirs' shards as they are; regenerate without a bump)"
            )
        lines.append(
            "The token-shard bytes changed. If that is intended, bump TOKENIZATION_REVISION in "
            "src/dflash_pipeline/workflow/policy.py (every workdir re-tokenizes, retrains and re-evaluates) and "
            f"regenerate the golden: {REGENERATE}. If it is not (a refactor), the change is a bug."
        )
        pytest.fail("\n".join(lines))
    # the batching of tokenize_records decides no byte: small batches give the shard's rows
    tok = chat.load_tokenizer(tmp_path / name / "target")
    _, cfg, _ = CASES[name]
    with _fixed_day():
        again = list(
            tokenize_records(
                tok,
                completion_records(tok),
                max_length=cfg["max_length"],
                last_turn_only=cfg["last_turn_only"],
                strict=cfg["strict"],
                use_server_token_ids=cfg.get("use_server_token_ids", False),
                batch_size=3,
            )
        )
    assert [
        _digest({**r, "input_ids": r["input_ids"].tolist(), "loss_mask": r["loss_mask"].tolist()}) for r in again
    ] == [_digest(r) for r in rows]


def regenerate() -> dict:
    """Tokenize every case and write the golden file (at the current ``TOKENIZATION_REVISION``)."""
    if models_dir() is None:
        raise SystemExit("no model metadata directory (set DFLASH_MODELS_DIR): the zoo cases need it")
    with tempfile.TemporaryDirectory() as tmp:
        cases = {name: tokenize_case(name, Path(tmp))[0] for name in sorted(CASES)}
    golden = {"revision": TOKENIZATION_REVISION, "made_with": _versions(), "cases": cases}
    shards.atomic_write_bytes(GOLDEN, (json.dumps(golden, indent=1, ensure_ascii=False) + "\n").encode("utf-8"))
    return golden


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regenerate", action="store_true", help=f"rewrite {GOLDEN}")
    args = parser.parse_args()
    if not args.regenerate:
        parser.error("nothing to do: pass --regenerate (run the test with pytest)")
    made = regenerate()
    print(
        f"wrote {GOLDEN}: revision {made['revision']}, {len(made['cases'])} cases, "
        f"{sum(len(c['rows']) for c in made['cases'].values())} rows"
    )
