"""Acceptance evaluation (reference/dflash.md §7): τ arithmetic, multi-turn, temperature sampling,
thinking-mode refusal, plots, the report tables and server-mode τ against the local test server."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import tiny_target_and_drafter

from dflash_pipeline.core.contracts import prompt_id
from dflash_pipeline.evaluate import acceptance as E

B = 4


@pytest.fixture(scope="module")
def tiny():
    return tiny_target_and_drafter(num_hidden_layers=4, num_draft_layers=1, target_layer_ids=[0, 2], block_size=B)


# --- τ arithmetic on hand-made step sequences --------------------------------------------------------


def test_tau_zero_accepted_response():
    """Every verify step rejects the first draft: a+1 = 1 each step, τ = 1, no position accepted."""
    s = E.acceptance_stats([[1, 1, 1, 1]], B)
    assert s["tau"] == 1.0 and s["per_position_acceptance"] == [0.0, 0.0, 0.0]
    assert s["histogram"] == {"1": 4, "2": 0, "3": 0, "4": 0} and s["tokens_per_step"] == 1.0


def test_tau_max_accepted_response():
    s = E.acceptance_stats([[B, B, B]], B)
    assert s["tau"] == B and s["per_position_acceptance"] == [1.0, 1.0, 1.0]
    assert s["histogram"][str(B)] == 3


def test_tau_is_mean_over_responses_not_pooled():
    """One zero-accepted response (1,1,1,1) and one fully accepted (4): τ = (1 + 4) / 2, while the pooled
    tokens per step would be 8 / 5."""
    s = E.acceptance_stats([[1, 1, 1, 1], [4]], B)
    assert s["tau"] == 2.5 and math.isclose(s["tokens_per_step"], 8 / 5)
    assert s["per_position_acceptance"] == [0.2, 0.2, 0.2] and s["num_steps"] == 5


class _Tok:
    """Stands in for a tokenizer: ``render`` is patched, ``decode`` names the answer."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return f"answer-{ids[0]}"


def test_multi_turn_feeds_answers_back_and_counts_each_turn(monkeypatch, tiny):
    """MT-Bench: turn 2 is generated against turn 1 and the loop's own answer; each turn is one response."""
    target, drafter = tiny
    seen_histories = []
    canned = iter(
        [E.SpecResult([7, 7, 7], [1, 1, 1], 3), E.SpecResult([9, 9, 9, 9], [4], 1), E.SpecResult([5], [1], 1)]
    )

    def fake_render(tok, history, **kw):
        seen_histories.append([dict(m) for m in history])
        return [1, 2, 3]

    monkeypatch.setattr("dflash_pipeline.target.chat.render", fake_render)
    monkeypatch.setattr(E, "speculative_generate", lambda *a, **kw: next(canned))
    prompts = [
        {"prompt_id": "a", "turns": ["q1", "q2"], "system": "be brief"},
        {"prompt_id": "b", "turns": ["r1"], "system": None},
    ]
    s = E.run_eval_set(
        target,
        _Tok(),
        drafter,
        prompts,
        block_size=B,
        max_new_tokens=8,
        temperature=0.0,
        seed=0,
        thinking="disable",
        stop_token_ids=[0],
    )
    assert seen_histories[1] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "answer-7"},
        {"role": "user", "content": "q2"},
    ]
    assert seen_histories[2] == [{"role": "user", "content": "r1"}]
    assert s["num_responses"] == 3 and s["num_conversations"] == 2
    assert math.isclose(s["tau"], (1.0 + 4.0 + 1.0) / 3)
    assert s["new_tokens"] == 8 and s["target_forwards"] == 5 and math.isclose(s["tokens_per_target_forward"], 8 / 5)


# --- temperature sampling (target samples, draft greedy) ---------------------------------------------


def test_temperature_sampling_is_seeded_and_consistent(tiny):
    target, drafter = tiny
    prompt = [5, 17, 33, 2, 8]

    def run(seed, temperature=1.0):
        g = torch.Generator().manual_seed(seed)
        return E.speculative_generate(
            target, drafter, prompt, block_size=B, max_new_tokens=24, temperature=temperature, generator=g
        )

    a, b, c = run(0), run(0), run(1)
    assert a.output_ids == b.output_ids and a.accept_lengths == b.accept_lengths  # reproducible per seed
    assert a.output_ids != c.output_ids  # and actually sampled
    for r in (a, c):
        assert len(r.output_ids) == 24 and all(1 <= x <= B for x in r.accept_lengths)
        assert sum(r.accept_lengths) >= len(r.output_ids) - 1  # every committed token came from a verify step
        assert r.target_forwards == len(r.accept_lengths)
    greedy = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
    assert run(0, temperature=1e-6).output_ids == greedy  # T→0 is the greedy loop
    assert a.output_ids != greedy


def test_zero_features_drafter_sees_zeros(tiny):
    target, drafter = tiny
    seen = []
    real = drafter.draft_block

    def spy(embed, head, bonus, ctx, *a, **kw):
        seen.append(float(ctx.abs().sum()))
        return real(embed, head, bonus, ctx, *a, **kw)

    drafter.draft_block = spy
    try:
        E.speculative_generate(target, drafter, [5, 6, 7], block_size=B, max_new_tokens=6, zero_target_features=True)
        assert seen and all(v == 0.0 for v in seen)
        seen.clear()
        E.speculative_generate(target, drafter, [5, 6, 7], block_size=B, max_new_tokens=6)
        assert seen[0] > 0.0
    finally:
        del drafter.draft_block


# --- comparing records -------------------------------------------------------------------------------


def _record(thinking="disable", tau=2.0, sets=("gsm8k",), temperature=0.0):
    entry = {
        "checkpoint": "ckpt",
        "train_steps": 10,
        "zero_target_features": False,
        "sets": {
            s: {
                "tau": tau,
                "per_position_acceptance": [0.5, 0.25, 0.1],
                "histogram": {},
                "num_responses": 2,
                "num_steps": 4,
                "tokens_per_target_forward": tau,
            }
            for s in sets
        },
    }
    floor = {"checkpoint": None, "train_steps": 0, "sets": {s: {**entry["sets"][s], "tau": 1.0} for s in sets}}
    return {
        "settings": {"thinking": thinking, "temperature": temperature, "block_size": B, "max_new_tokens": 8},
        "drafters": {"trained": entry, "untrained": floor},
        "tau_over_untrained": {"trained": {s: tau for s in sets}},
    }


def test_refuses_to_compare_thinking_modes():
    with pytest.raises(E.EvalComparisonError, match="different thinking modes.*a: thinking=disable.*b: thinking=none"):
        E.merge_eval_records({"a": _record("disable"), "b": _record("none")})
    bad = _record()
    del bad["settings"]["thinking"]
    with pytest.raises(E.EvalComparisonError, match="settings.thinking"):
        E.merge_eval_records({"a": _record(), "b": bad})


def test_merge_same_thinking_mode_side_by_side():
    merged = E.merge_eval_records({"t0": _record(tau=3.0), "t1": _record(tau=2.0, temperature=1.0)})
    assert merged["thinking"] == "disable"
    assert set(merged["drafters"]) == {"t0/trained", "t0/untrained", "t1/trained", "t1/untrained"}
    assert merged["drafters"]["t1/trained"]["settings"]["temperature"] == 1.0  # settings travel with the numbers
    rows = E.eval_table_rows(merged)
    assert {
        (r["drafter"], r["tau"], r["temperature"])
        for r in rows
        if r["drafter"].endswith("trained") and "un" not in r["drafter"]
    } == {("t0/trained", 3.0, 0.0), ("t1/trained", 2.0, 1.0)}


# --- plots and tables --------------------------------------------------------------------------------


def test_plots_and_table_written(tmp_path):
    rec = _record(sets=("gsm8k", "mt_bench"))
    E.plot_acceptance(rec, tmp_path / "acc.png")
    series = {
        "settings": rec["settings"],
        "num_prompts": {"gsm8k": 2},
        "points": [{"step": 5, "sets": {"gsm8k": {"tau": 1.5}}}, {"step": 10, "sets": {"gsm8k": {"tau": 2.5}}}],
    }
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": s, "loss": 3.0 / s, "eal": 1 + s / 10}) + "\n" for s in (1, 5, 10)))
    E.plot_tau_vs_step(series, tmp_path / "tau.png", train_log=log)
    E.plot_tau_vs_step({**series, "points": []}, tmp_path / "empty.png")
    E.plot_training({"trained": log, "missing": tmp_path / "nope.jsonl"}, tmp_path / "train.png")
    for name in ("acc.png", "tau.png", "empty.png", "train.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name
    E.write_eval_table(rec, tmp_path / "t.tsv")
    lines = (tmp_path / "t.tsv").read_text().splitlines()
    assert lines[0].split("\t") == list(E.TABLE_COLUMNS) and len(lines) == 1 + 4
    assert "trained\tgsm8k\t2.0\t2.0\t" in lines[1]


def test_eval_sets_exclude_training_prompts_before_drawing(tmp_path):
    path = tmp_path / "q.jsonl"
    recs = [{"question_id": i, "category": "x", "turns": [f"question {i}", f"follow-up {i}"]} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = {"seed": 0, "sets": {"mt": {"path": str(path), "format": "mt_bench", "num_samples": 4}}}
    every, _ = E.load_eval_sets({**cfg, "sets": {"mt": {**cfg["sets"]["mt"], "num_samples": 10}}})
    train_ids = {r["prompt_id"] for r in every["mt"][:3]}
    sets, info = E.load_eval_sets(cfg, exclude_prompt_ids=train_ids)
    assert [r["prompt_id"] for r in sets["mt"]] == [r["prompt_id"] for r in every["mt"][3:7]]
    assert info["mt"] == {
        **info["mt"],
        "available": 10,
        "excluded_training_prompts": 3,
        "num_prompts": 4,
        "num_turns": 8,
    }
    # the training prompt id of a multi-turn prompt hashes the same user messages
    first = every["mt"][0]
    assert first["prompt_id"] == prompt_id([{"role": "user", "content": t} for t in first["turns"]])


def test_report_tables(tmp_path):
    from dflash_pipeline.report import tables as report

    manifest = {
        "datasets": {
            "a": {"read": 10, "kept": 7, "dropped": {"duplicate": 2, "empty": 1}, "shards": [{"name": "00000"}]},
            "b": {"read": 3, "kept": 3, "dropped": {}, "shards": []},
        }
    }
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    rows = report.prompts_table(tmp_path / "m.json", tmp_path / "p.tsv")
    assert rows[0]["dropped_duplicate"] == 2 and rows[0]["dropped_total"] == 3 and rows[1]["dropped_empty"] == 0
    text = (tmp_path / "p.tsv").read_text().splitlines()
    assert text[0].startswith("dataset\tread\tkept\tshards\tdropped_total\tdropped_duplicate\tdropped_empty")
    (tmp_path / "probe.json").write_text(
        json.dumps({"drafter": {"block_size": 8, "target_layer_ids": [1, 3]}, "x": None})
    )
    assert ("drafter.target_layer_ids", "1, 3") in report.probe_table(tmp_path / "probe.json", tmp_path / "probe.tsv")
