"""τ by context length: the buckets, the loop's per-step context lengths, long conversations built
up to a length with the training prompts left out, and held-out τ per bucket during training."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import tiny_target_and_drafter

from dflash_pipeline.core.contracts import prompt_id
from dflash_pipeline.core.errors import ConfigError
from dflash_pipeline.evaluate import acceptance as E
from dflash_pipeline.evaluate.context_length import bucket_labels, length_buckets_of, tau_by_context_length
from dflash_pipeline.evaluate.long_conversations import build_long_conversations, load_long_conversations
from dflash_pipeline.prompts import normalize_record
from dflash_pipeline.train.heldout import AcceptanceCounts, block_acceptance


def test_bucket_labels_and_the_schema_default():
    assert bucket_labels([1024, 4096, 16384]) == ["<1K", "1K–4K", "4K–16K", "≥16K"]
    assert bucket_labels([256, 1536]) == ["<256", "256–1.5K", "≥1.5K"]
    assert length_buckets_of({}) == [1024, 4096, 16384]  # the eval rule's params leave the default out
    for bad in ([], [4096, 1024], [0, 5], [1024, 1024]):
        with pytest.raises(ConfigError, match="context_length_buckets"):
            bucket_labels(bad)


def test_tau_by_bucket_is_the_mean_over_responses_of_their_steps_in_it():
    # response 1: two steps under 100 tokens (a+1 = 4, 2), one at 150; response 2: one step at 120 and one at 99
    out = tau_by_context_length([([10, 60, 150], [4, 2, 1]), ([99, 120], [3, 5])], [100, 1000])
    assert list(out) == ["<100", "100–1000"]  # no step in ≥1000: left out
    assert math.isclose(out["<100"]["tau"], ((4 + 2) / 2 + 3) / 2) and out["<100"]["num_steps"] == 3
    assert math.isclose(out["100–1000"]["tau"], (1 + 5) / 2) and out["100–1000"]["num_responses"] == 2
    assert out["<100"]["range"] == [0, 100] and out["100–1000"]["range"] == [100, 1000]
    # one bucket only: its τ is the set's τ (E.acceptance_stats)
    resp = [([5, 9], [3, 1]), ([5], [4])]
    assert math.isclose(tau_by_context_length(resp, [1024])["<1K"]["tau"], E.acceptance_stats([[3, 1], [4]], 4)["tau"])


def test_the_loop_records_the_context_of_every_verify_step():
    target, drafter = tiny_target_and_drafter(num_hidden_layers=4, num_draft_layers=1, target_layer_ids=[0, 2])
    prompt = list(range(5, 25))
    res = E.speculative_generate(target, drafter, prompt, block_size=4, max_new_tokens=12)
    assert len(res.context_lengths) == len(res.accept_lengths) > 1
    assert res.context_lengths[0] == len(prompt)  # the first block is verified after the prompt
    for i in range(1, len(res.context_lengths)):  # each next one after the tokens accepted before it
        assert res.context_lengths[i] == res.context_lengths[i - 1] + res.accept_lengths[i - 1]


def _chat(i: int, exchanges: int) -> dict:
    conv = []
    for j in range(exchanges):
        conv += [
            {"from": "human", "value": f"question {i}.{j} " + "x " * 10},
            {"from": "gpt", "value": f"answer {i}.{j} " + "y " * 10},
        ]
    return {"id": str(i), "conversations": conv}


def test_long_conversations_reach_the_length_and_leave_training_prompts_out(tmp_path):
    path = tmp_path / "chats.json"
    records = [_chat(i, 2) for i in range(12)]
    path.write_text(json.dumps(records))
    trained = {prompt_id(normalize_record(records[0])), prompt_id(normalize_record(records[5]))}

    def count(messages):  # a stand-in for the rendered length: words
        return sum(len(m["content"].split()) for m in messages)

    out, found = load_long_conversations(
        path, build_to_tokens=60, num_samples=3, seed=0, count_tokens=count, exclude_prompt_ids=trained
    )
    assert found == {"available": 12, "excluded_training_prompts": 2}
    assert len(out) == 3
    used = " ".join(m["content"] for r in out for m in r["history"]) + " ".join(t for r in out for t in r["turns"])
    assert "question 0." not in used and "question 5." not in used  # training prompts never feed a long conversation
    for r in out:
        assert count([*r["history"], {"role": "user", "content": r["turns"][0]}]) >= 60
        assert [m["role"] for m in r["history"][:2]] == ["user", "assistant"] and len(r["turns"]) == 1
        assert any(m["content"].startswith("answer ") for m in r["history"])  # the file's own answers as history
    # too short a stream: no record rather than a short one
    assert (
        build_long_conversations(
            [[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]],
            build_to_tokens=10**6,
            num_samples=2,
            count_tokens=count,
        )
        == []
    )


def test_a_long_record_is_answered_after_its_history(monkeypatch):
    target, drafter = tiny_target_and_drafter(num_hidden_layers=4, num_draft_layers=1, target_layer_ids=[0, 2])
    seen = []

    def fake_render(tok, history, **kw):
        seen.append([dict(m) for m in history])
        return [1, 2, 3]

    monkeypatch.setattr("dflash_pipeline.target.chat.render", fake_render)
    monkeypatch.setattr(E, "speculative_generate", lambda *a, **kw: E.SpecResult([7], [2], 1, context_lengths=[3]))

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "ok"

    hist = [{"role": "user", "content": "u0"}, {"role": "assistant", "content": "a0"}]
    s = E.run_eval_set(
        target,
        Tok(),
        drafter,
        [{"prompt_id": "p", "system": None, "history": hist, "turns": ["u1"]}],
        block_size=4,
        max_new_tokens=4,
        temperature=0.0,
        seed=0,
        thinking="disable",
        stop_token_ids=[0],
        length_buckets=[2, 8],
    )
    assert seen == [[*hist, {"role": "user", "content": "u1"}]]
    assert s["by_context_length"] == {
        "2–8": {"tau": 2.0, "num_responses": 1, "num_steps": 1, "tokens_per_step": 2.0, "range": [2, 8]}
    }


def test_heldout_tau_per_bucket_adds_up_across_batches_and_ranks():
    accept = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    valid = torch.ones(3, 3, dtype=torch.bool)
    contexts = torch.tensor([5, 50, 500])
    c = block_acceptance(accept, valid, contexts, [10, 100])
    s = c.summary()
    assert s["by_context_length"] == {
        "<10": {"tau": 3.0, "num_blocks": 1, "range": [0, 10]},
        "10–100": {"tau": 2.0, "num_blocks": 1, "range": [10, 100]},
        "≥100": {"tau": 1.0, "num_blocks": 1, "range": [100, None]},
    }
    assert math.isclose(s["tau"], 2.0)  # the blocks' mean, as without buckets
    both = AcceptanceCounts.from_tensor((c + c).as_tensor(), [10, 100]).summary()  # an all-reduce of two ranks
    assert both["by_context_length"]["<10"] == {"tau": 3.0, "num_blocks": 2, "range": [0, 10]}
    assert "by_context_length" not in block_acceptance(accept, valid).summary()
