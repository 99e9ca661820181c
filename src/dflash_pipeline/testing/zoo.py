"""A zoo of tiny twins: one random-weight model per real `config.json` under the model metadata corpus
(`../shared/data/models/<family>/`), small enough to build, train and evaluate in seconds on a CPU.

A twin keeps what makes its family distinct and shrinks the rest (`.zoo_shrink.shrink_config`): config
class, `model_type`, nested `text_config`, MLA and MoE routing, the layer-type pattern (sliding windows
shrink to `SLIDING_WINDOW` tokens), tied embeddings, partial rotary, rope scaling; quantization is
dropped. Its tokenizer renders the family's real chat template (`family_template`) with the family's
special tokens; `config.vocab_size` leaves free rows (mask token). Built deterministically from
`(family, seed)`. `python -m dflash_pipeline.testing.zoo --table` runs every stage on every twin.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from dflash_pipeline.testing.zoo_shrink import shrink_config
from dflash_pipeline.testing.zoo_templates import (  # noqa: F401 (the zoo's API)
    TEMPLATE_FROM,
    family_template,
    family_template_text,
)

#: Factor applied to the twin's LM head so greedy logits have margins (random init is ~uniform).
HEAD_SCALE = 8.0

#: Families whose own directory has no chat template: the corpus directory whose template they use.
#: Special tokens a chat template writes (Qwen/ChatML, Llama-3, DeepSeek, Kimi, gpt-oss, gemma, MiniMax).
_SPECIAL_RE = re.compile(r"<\|[^<>|'\" ]{1,40}\|>|<｜[^<>｜'\" ]{1,40}｜>|<(?:start|end)_of_turn>|\]~!?b\[|\[e~\[")
#: bos/eos per template family (first marker found in the template wins), when no tokenizer_config says.
_BOS_EOS = (
    ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    ("<|start_header_id|>", "<|begin_of_text|>", "<|eot_id|>"),
    ("<|return|>", "<|startoftext|>", "<|return|>"),
    ("<start_of_turn>", "<bos>", "<end_of_turn>"),
    ("[e~[", "]~!b[", "[e~["),
    ("<|im_middle|>", "[BOS]", "<|im_end|>"),
    ("<|im_start|>", None, "<|im_end|>"),
)
THINK_TOKENS = ("<think>", "</think>")


def families(models_dir: str | Path) -> list[str]:
    """Names of the corpus directories with a `config.json` (sorted): the families the zoo covers."""
    return sorted(p.parent.name for p in Path(models_dir).glob("*/config.json"))


def all_families(models_dir: str | Path) -> list[str]:
    """`families` plus the twins built from transformers' config classes
    (`testing.zoo_extra.EXTRA_FAMILIES`)."""
    from dflash_pipeline.testing.zoo_extra import EXTRA_FAMILIES

    return families(models_dir) + sorted(EXTRA_FAMILIES)


def build_any_twin(
    models_dir: str | Path, family: str, out_dir: str | Path, *, corpus_file: str | Path, seed: int = 0
) -> Path:
    """`build_twin` for a corpus family, an extra one or a transformers model type named `type:<model_type>`."""
    from dflash_pipeline.testing.zoo_extra import (
        EXTRA_FAMILIES,
        TWIN_SEEDS,
        TYPE_PREFIX,
        extra_source_dir,
        type_source_dir,
    )

    if family.startswith(TYPE_PREFIX):  # a transformers model type, from its config class's defaults
        src = type_source_dir(
            models_dir, family[len(TYPE_PREFIX) :], Path(out_dir).parent / f".{Path(out_dir).name}-source"
        )
        return build_twin(src, family, out_dir, corpus_file=corpus_file, seed=seed)
    if family in EXTRA_FAMILIES:
        src = extra_source_dir(models_dir, family, Path(out_dir).parent / f".{Path(out_dir).name}-source")
        return build_twin(src, family, out_dir, corpus_file=corpus_file, seed=seed + TWIN_SEEDS.get(family, 0))
    return build_twin(models_dir, family, out_dir, corpus_file=corpus_file, seed=seed)


def extra_config_files(out: str | Path) -> list[Path]:
    """`config.json` files of the extra families (full size, as their config classes write them), for
    checks that read configs only (the drafter-rotary parity)."""
    from dflash_pipeline.testing.zoo_extra import EXTRA_FAMILIES, extra_config

    files = []
    for name in sorted(EXTRA_FAMILIES):
        d = Path(out) / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(extra_config(name), indent=1) + "\n", encoding="utf-8")
        files.append(d / "config.json")
    return files


# --- config shrinking


# --- tokenizer

_BASE_TOKENIZER: dict = {}


def base_tokenizer(corpus_file: str | Path, *, vocab_size: int = 384, max_texts: int = 600):
    """The demo byte-level BPE trained on the first `max_texts` texts of `corpus_file` (cached)."""
    from ..demo import load_corpus, train_tokenizer

    key = (str(corpus_file), vocab_size, max_texts)
    if key not in _BASE_TOKENIZER:
        convs = load_corpus([corpus_file])[: max_texts // 2]
        _BASE_TOKENIZER[key] = train_tokenizer([m["content"] for c in convs for m in c], vocab_size=vocab_size)
    return copy.deepcopy(_BASE_TOKENIZER[key])


def family_tokenizer(template_text: str, corpus_file: str | Path, tokenizer_config: Optional[dict] = None):
    """Demo BPE + the template's special tokens, the family's bos/eos and its chat template."""
    from tokenizers import AddedToken

    tok = base_tokenizer(corpus_file)
    tc = tokenizer_config or {}

    def content(v):
        return v.get("content") if isinstance(v, dict) else v

    bos, eos = None, None
    for marker, b, e in _BOS_EOS:
        if marker in template_text:
            bos, eos = b, e
            break
    bos = content(tc.get("bos_token")) or bos
    eos = eos or content(tc.get("eos_token"))
    if eos is None:
        raise ValueError("cannot tell the template's end-of-turn token; add its marker to zoo._BOS_EOS")
    specials = sorted(set(_SPECIAL_RE.findall(template_text)) | {t for t in (bos, eos) if t} - set(THINK_TOKENS))
    tok.add_special_tokens(
        {"additional_special_tokens": [AddedToken(s, special=True, normalized=False) for s in specials]},
        replace_extra_special_tokens=False,
    )
    think = [t for t in THINK_TOKENS if t in template_text and t not in tok.get_vocab()]
    if think:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in think])
    tok.eos_token = eos
    tok.bos_token = bos
    tok.chat_template = template_text
    return tok


# --- build


def build_twin(
    models_dir: str | Path, family: str, out_dir: str | Path, *, corpus_file: str | Path, seed: int = 0
) -> Path:
    """Write the tiny twin of `family` into `out_dir`.

    Deterministic in `(family, seed)`. Returns `out_dir`.

    Raises:
        FileNotFoundError: no config.json / chat template for the family.
        dflash_pipeline.target.loading.TargetLoadError: transformers has no class for the family.
    """
    import torch
    from transformers import GenerationConfig

    from dflash_pipeline.core.shards import replace_dir
    from dflash_pipeline.target.loading import causal_lm_class, load_target_config

    from ..demo import padded_vocab_size

    src = Path(models_dir) / family
    raw = json.loads((src / "config.json").read_text(encoding="utf-8"))
    template = family_template_text(models_dir, family)
    tc_path = src / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text(encoding="utf-8")) if tc_path.is_file() else None
    tok = family_tokenizer(template, corpus_file, tc)
    rows = padded_vocab_size(len(tok))
    eos_id = tok.convert_tokens_to_ids(tok.eos_token)
    pad_id = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg_dict = shrink_config(raw, rows, bos_id=tok.bos_token_id, eos_id=eos_id, pad_id=pad_id)

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n", encoding="utf-8")
    config = load_target_config(tmp)
    cls = causal_lm_class(config)
    torch.manual_seed(seed)
    model = cls._from_config(config, dtype=torch.float32) if hasattr(cls, "_from_config") else cls(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    model.save_pretrained(tmp)
    # keep the family's own config.json (model_type, auto_map, nesting) rather than transformers' rewrite
    (tmp / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n", encoding="utf-8")
    tok.save_pretrained(tmp)
    stops = [eos_id] + [tok.convert_tokens_to_ids(t) for t in ("<|end|>", "<|call|>", "<|eom_id|>") if t in template]
    GenerationConfig(
        eos_token_id=stops, pad_token_id=pad_id, bos_token_id=tok.bos_token_id, do_sample=False
    ).save_pretrained(tmp)
    (tmp / "twin.json").write_text(
        json.dumps(
            {
                "family": family,
                "seed": seed,
                "class": cls.__name__,
                "template_from": family_template(models_dir, family).parent.name,
            }
        )
        + "\n"
    )
    replace_dir(tmp, out)
    return out


# --- family × stage table

STAGES = ("build", "probe", "completions", "tokens", "train_fp32", "train_bf16", "eval")


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"


#: Prompts of the completions stage (two single-turn, one multi-turn conversation).
STAGE_PROMPTS = (
    [{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in all?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 6 times 7?"}],
    [{"role": "user", "content": "Name a prime number."}, {"role": "user", "content": "And a larger one?"}],
)


def stage_config(twin: Path, eval_set: Path, device: str = "cpu") -> dict:
    """The validated pipeline config the stages run under."""
    from dflash_pipeline.core.config import validate_config

    return validate_config(
        {
            "target": {"path": str(twin)},
            "drafter": {"block_size": 4, "num_draft_layers": 1},
            "generation": {"backend": "transformers", "max_tokens": 16, "batch_size": 3},
            "tokens": {"max_length": 512},
            "train": {
                "epochs": 2,
                "batch_size": 2,
                "num_anchors": 4,
                "log_every_steps": 1,
                "save_every_steps": 1000,
                "device": device,
            },
            "eval": {
                "max_new_tokens": 12,
                "checkpoint_samples": 0,
                "exclude_training_prompts": False,
                "sets": {"gsm8k": {"path": str(eval_set), "num_samples": 1}},
            },
        }
    )


class _TwinStages:
    """The stages of `run_stages` on one twin (`work/target`), each a method that raises on refusal;
    `cfg` is the twins' config (`stage_config`), filled when the twin is built."""

    def __init__(self, models_dir: Path, family: str, work: Path, corpus_file: Path, eval_set: Path, device: str):
        self.models_dir, self.family, self.work, self.corpus_file = models_dir, family, work, corpus_file
        self.eval_set, self.device = eval_set, device
        self.twin = work / "target"
        self.cfg: dict = {}
        self.probe_record: Any = None

    def build(self):
        build_any_twin(self.models_dir, self.family, self.twin, corpus_file=self.corpus_file)
        self.cfg.update(stage_config(self.twin, self.eval_set, self.device))

    def probe(self):
        from ..probe import probe_target

        n = json.loads((self.twin / "config.json").read_text())
        n = (n.get("text_config") or n)["num_hidden_layers"]
        self.probe_record = probe_target(self.twin, block_size=4, num_draft_layers=1, target_layer_ids=[1, n - 2])

    def completions(self):
        from dflash_pipeline.core import contracts, shards

        from ..completions import generate_shard, preflight_template

        gen = self.cfg["generation"]
        preflight_template(self.twin, gen_cfg=gen, tokens_cfg=self.cfg["tokens"])  # as the rule does
        recs = [
            {"prompt_id": contracts.prompt_id(m), "dataset": "zoo", "messages": m, "metadata": "{}"}
            for m in STAGE_PROMPTS
        ]
        prompts = self.work / "prompts.parquet"
        shards.write_parquet(prompts, shards.table_from_records(recs, contracts.PROMPT_SCHEMA))
        st = generate_shard(prompts, self.work / "completions.parquet", target_dir=self.twin, gen_cfg=gen)
        if st.get("error"):
            raise RuntimeError(f"{st['error']} completion record(s) in error")

    def tokens(self):
        from dflash_pipeline.tokens.shard import tokenize_shard

        st = tokenize_shard(
            self.work / "completions.parquet",
            self.work / "tokens.parquet",
            target_dir=self.twin,
            tokens_cfg=self.cfg["tokens"],
        )
        if not st["records_out"]:
            raise RuntimeError(f"no token rows: dropped {st['dropped']}")

    def train(self, dtype: str, mp: str):
        from dflash_pipeline.train.run import train

        tcfg = {k: v for k, v in self.cfg["train"].items() if k != "device"}  # as the rule passes it
        train(
            token_shards=[self.work / "tokens.parquet"],
            probe=self.probe_record,
            target_dir=self.twin,
            out_dir=self.work / f"train_{dtype}",
            cfg=dict(tcfg, mixed_precision=mp),
            target_dtype=dtype,
            device=self.cfg["train"]["device"],
        )

    def eval(self):
        from dflash_pipeline.evaluate.acceptance import evaluate

        rec = evaluate(
            target_dir=self.twin,
            probe=self.probe_record,
            eval_cfg=self.cfg["eval"],
            thinking=self.cfg["generation"]["thinking"],
            drafters={"trained": self.work / "train_bfloat16" / "final"},
            out_json=self.work / "eval.json",
            target_dtype="bfloat16",
        )
        tau = rec["tau"]["trained"]["gsm8k"]
        if not 1.0 <= tau <= 4.0:
            raise RuntimeError(f"τ {tau} outside [1, block_size]")


def run_stages(
    models_dir: Path,
    family: str,
    work: Path,
    corpus_file: Path,
    eval_set: Path,
    log: Callable[[str], None] = lambda m: None,
    device: str = "cpu",
) -> dict[str, str]:
    """Every stage on one twin, in-process; each `ok` or `refused: <reason>` (the stages after a refused one are
    `skipped`): twin build, probe, completions (transformers backend), tokens (the family's template), training fp32 and
    bf16, eval τ of the bf16-trained drafter."""
    run = _TwinStages(models_dir, family, work, corpus_file, eval_set, device)
    stages = {
        "build": run.build,
        "probe": run.probe,
        "completions": run.completions,
        "tokens": run.tokens,
        "train_fp32": lambda: run.train("float32", "no"),
        "train_bf16": lambda: run.train("bfloat16", "bf16"),
        "eval": run.eval,
    }
    out: dict[str, str] = {}
    for name, fn in stages.items():
        t0 = time.time()
        try:
            fn()
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the table reports the reason
            out[name] = f"refused: {_reason(exc)}"
            log(
                f"{family} {name}: {out[name]}\n{traceback.format_exc()}"
            )  # the table keeps the reason, the log the traceback
            break
        log(f"{family} {name}: ok ({time.time() - t0:.1f} s)")
    return out


def main(argv=None) -> int:
    """CLI: `python -m dflash_pipeline.testing.zoo --table [--models DIR] [--family NAME]…`."""
    import tempfile

    ap = argparse.ArgumentParser(prog="python -m dflash_pipeline.testing.zoo", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=os.environ.get("DFLASH_MODELS_DIR", "../shared/data/models"))
    ap.add_argument("--corpus", default="data/gsm8k/train.jsonl")
    ap.add_argument("--eval-set", default="data/gsm8k/test.jsonl")
    ap.add_argument(
        "--device", choices=("cpu", "auto"), default="cpu", help="train.device of the stages (auto: GPU if any)"
    )
    ap.add_argument("--family", action="append", help="only these families (default: all with a config.json)")
    ap.add_argument("--table", action="store_true", help="run every stage and print the family × stage table")
    ap.add_argument("--out", help="build the twins into this directory (default: a temp dir)")
    ap.add_argument("--no-engine", action="store_true", help="--table without the engine_parity column (vLLM)")
    ap.add_argument(
        "--json",
        help="also write the table as JSON here (docs/results/zoo.json renders the docs' supported-families table)",
    )
    a = ap.parse_args(argv)
    models = Path(a.models)
    fams = a.family or all_families(models)
    root = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="dflash-zoo-"))
    rows = {}
    for fam in fams:
        t0 = time.time()
        if a.table:
            rows[fam] = run_stages(
                models,
                fam,
                root / fam,
                Path(a.corpus).resolve(),
                Path(a.eval_set).resolve(),
                log=lambda m: print(f"[zoo] {m}", file=sys.stderr, flush=True),
                device=a.device,
            )
        else:
            try:
                build_any_twin(models, fam, root / fam / "target", corpus_file=a.corpus)
                rows[fam] = {"build": "ok"}
            except Exception as exc:  # noqa: BLE001 - reported in the table
                rows[fam] = {"build": f"refused: {_reason(exc)}"}
        print(f"[zoo] {fam}: {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    stages = STAGES if a.table else ("build",)
    if a.table and not a.no_engine:  # one vLLM process for every family (dflash_pipeline.testing.engine_parity)
        from dflash_pipeline.core.vllm_env import find_vllm_python
        from dflash_pipeline.testing.engine_parity import engine_parity_column

        col = engine_parity_column({f: root / f for f in rows}, root / "_engine_parity", find_vllm_python())
        for fam, cell in col.items():
            rows[fam]["engine_parity"] = cell if rows[fam].get("train_fp32") == "ok" else "skipped"
        stages = STAGES + ("engine_parity",)
    print("| family | " + " | ".join(stages) + " |")
    print("|---" * (len(stages) + 1) + "|")
    for fam, r in rows.items():
        print(f"| {fam} | " + " | ".join(r.get(s, "skipped") for s in stages) + " |")
    if a.json:
        import shlex

        command = "python -m dflash_pipeline.testing.zoo " + shlex.join(sys.argv[1:] if argv is None else argv)
        write_table_json(a.json, rows, stages, device=a.device, models_dir=models, command=command)
    return 0


def write_table_json(
    path: str | Path, rows: dict, stages, *, device: str, models_dir: str | Path, command: str
) -> None:
    """The family × stage table as JSON (atomic): `{"source": {...}, "stages": [...], "families": [{"family", "kind",
    "cells": {stage: cell}}]}`; `kind` is `corpus` (a real `config.json` of `models_dir`) or `transformers_config`;
    `command` is the command line that produced it."""
    import datetime

    from dflash_pipeline.core.shards import write_json
    from dflash_pipeline.testing.zoo_extra import EXTRA_FAMILIES

    write_json(
        path,
        {
            "source": {
                "command": command,
                "date": datetime.date.today().isoformat(),
                "device": device,
                "models_dir": str(models_dir),
            },
            "stages": list(stages),
            "families": [
                {
                    "family": fam,
                    "kind": "transformers_config" if fam in EXTRA_FAMILIES else "corpus",
                    "cells": {s: r.get(s, "skipped") for s in stages},
                }
                for fam, r in rows.items()
            ],
        },
        skip_if_identical=False,
    )


if __name__ == "__main__":
    raise SystemExit(main())
