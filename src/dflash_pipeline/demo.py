"""The tiny demo target: a Qwen3-architecture causal LM with its own BPE tokenizer and chat template.

Used when `target.path: demo`. `build_demo_target` trains a byte-level BPE tokenizer on the bundled
corpus and a small `Qwen3ForCausalLM` (≈2 minutes on 2 CPU cores) on GSM8K and ShareGPT exchanges
rendered as chat with thinking disabled, loss on assistant tokens only.

Facts other stages rely on:

* The chat template behaves like Qwen3's: with `enable_thinking=False` the generation prompt ends in
  `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`.
* `config.vocab_size` = `len(tokenizer)` rounded up to a multiple of 64 and strictly greater (row
  `len(tokenizer)` becomes the drafter's mask token).
* eos is `<|im_end|>`; `generation_config.eos_token_id` is `[<|im_end|>, <|endoftext|>]`; pad is
  `<|endoftext|>`.
* Same arguments (and `num_threads`) → byte-identical tokenizer and weights.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from dflash_pipeline.core.errors import DataError
from dflash_pipeline.core.shards import replace_dir, write_json

DEMO_SCHEMA_VERSION = 1

#: Corpus files bundled in the repo (relative to the repo root / working directory).
DEFAULT_CORPUS_FILES = ("data/gsm8k/train.jsonl", "data/sharegpt/sharegpt.json")

ENDOFTEXT, IM_START, IM_END, THINK_OPEN, THINK_CLOSE = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
)
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # special: skipped by decode(skip_special_tokens=True)
THINK_TOKENS = (THINK_OPEN, THINK_CLOSE)  # added but not special, as in Qwen3 (ids 151667/151668 there)

MAX_SEQ_LEN = 256  # training sequence length and the tokenizer's model_max_length is 4x this
MODEL_MAX_LENGTH = 1024

#: Qwen3's chat template without the tool-calling branches; same output for system/user/assistant
#: messages, `reasoning_content`, multi-turn and `enable_thinking` (checked in tests/unit/demo/test_demo.py).
CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""


# --- corpus


def load_corpus(corpus_files: Sequence[str | os.PathLike]) -> list[list[dict]]:
    """Read chat conversations from the bundled corpus files.

    Accepted shapes: `.jsonl` with `question`/`answer` (GSM8K) → `[user, assistant]`;
    `.json` list of ShareGPT records (`conversations` of `{from, value}`) → the first
    human/gpt exchange. Returns conversations as lists of `{role, content}` in file order.

    Raises:
        DataError: unreadable file or a record of neither shape (names file and line/index).
    """
    convs: list[list[dict]] = []
    for f in corpus_files:
        path = Path(f)
        if not path.is_file():
            raise DataError(f"demo corpus file {path} does not exist (bundled files: {DEFAULT_CORPUS_FILES})")
        if path.suffix == ".jsonl":
            with open(path, "r", encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    rec = json.loads(line)
                    if not isinstance(rec.get("question"), str) or not isinstance(rec.get("answer"), str):
                        raise DataError(f"{path}:{lineno}: expected string fields `question` and `answer`")
                    convs.append(
                        [{"role": "user", "content": rec["question"]}, {"role": "assistant", "content": rec["answer"]}]
                    )
        elif path.suffix == ".json":
            with open(path, "r", encoding="utf-8") as fh:
                records = json.load(fh)
            for i, rec in enumerate(records):
                turns = rec.get("conversations") if isinstance(rec, dict) else None
                if not isinstance(turns, list):
                    raise DataError(f"{path}[{i}]: expected a ShareGPT record with a `conversations` list")
                if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
                    q, a = turns[0].get("value"), turns[1].get("value")
                    if isinstance(q, str) and isinstance(a, str) and q.strip() and a.strip():
                        convs.append([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
        else:
            raise DataError(f"demo corpus file {path}: unsupported suffix {path.suffix!r} (use .jsonl or .json)")
    if not convs:
        raise DataError(f"demo corpus {list(map(str, corpus_files))} holds no conversations")
    return convs


# --- tokenizer


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 1024):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer.

    `vocab_size` counts the 3 special tokens; `<think>`/`</think>` are added on top (not special), so `len(tokenizer) ==
    vocab_size + 2` when the corpus yields enough merges. Returns a `PreTrainedTokenizerFast` with eos `<|im_end|>`, pad
    `<|endoftext|>`, no bos, the demo chat template and `model_max_length` = 1024.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        additional_special_tokens=[IM_START, ENDOFTEXT],
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def padded_vocab_size(num_tokens: int, multiple: int = 64) -> int:
    """Embedding rows for `num_tokens` real tokens: next multiple of `multiple` strictly above it.

    >>> padded_vocab_size(1026), padded_vocab_size(1024)
    (1088, 1088)
    """
    return (num_tokens // multiple + 1) * multiple


# --- training data


def encode_conversation(tokenizer, messages: list[dict], max_len: int = MAX_SEQ_LEN) -> tuple[list[int], list[int]]:
    """Render `messages` (thinking disabled, i.e. an empty think block before the last answer) and
    return `(input_ids, loss_mask)`, both of length ≤ `max_len`.

    The mask is 1 on the tokens of the assistant's answer text and its `<|im_end|>`, 0 on the prompt
    and the template scaffolding (`<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`).
    """
    prompt = tokenizer.apply_chat_template(
        messages[:-1], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    answer = messages[-1]["content"] + IM_END
    p_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    ids = (p_ids + a_ids)[:max_len]
    mask = ([0] * len(p_ids) + [1] * len(a_ids))[:max_len]
    return ids, mask


def _batches(examples: list[tuple[list[int], list[int]]], batch_size: int, steps: int, rng: random.Random):
    """Yield `steps` batches; each epoch shuffles, then groups by length so padding stays small."""
    emitted = 0
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        chunk = batch_size * 16
        batches = []
        for s in range(0, len(order), chunk):
            part = sorted(order[s : s + chunk], key=lambda i: len(examples[i][0]))
            batches.extend(part[j : j + batch_size] for j in range(0, len(part), batch_size))
        rng.shuffle(batches)
        for b in batches:
            if len(b) < batch_size:
                continue
            yield [examples[i] for i in b]
            emitted += 1
            if emitted >= steps:
                return


def _collate(batch, pad_id: int):
    import torch

    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [b, T]
    labels = torch.full((len(batch), width), -100, dtype=torch.long)  # [b, T]
    attn = torch.zeros((len(batch), width), dtype=torch.long)  # [b, T]
    for r, (ids, mask) in enumerate(batch):
        n = len(ids)
        input_ids[r, :n] = torch.tensor(ids)
        attn[r, :n] = 1
        labels[r, :n] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    return input_ids, attn, labels


# --- build


def build_demo_target(
    out_dir: str | os.PathLike,
    corpus_files: Sequence[str | os.PathLike] = DEFAULT_CORPUS_FILES,
    *,
    seed: int = 0,
    vocab_size: int = 1024,
    hidden_size: int = 128,
    num_hidden_layers: int = 8,
    train_steps: int = 600,
    batch_size: int = 8,
    lr: float = 3e-3,
    num_threads: int | None = None,
    log=lambda msg: print(msg, flush=True),
) -> Path:
    """Build the tiny demo target into `out_dir` (atomically: a sibling temp dir renamed into place,
    replacing an existing one) and return `out_dir`.

    Args:
        corpus_files: GSM8K-style `.jsonl` and/or ShareGPT `.json` files (`load_corpus`).
        seed: seeds corpus shuffling, model init and batch order.
        vocab_size: BPE vocabulary (incl. 3 special tokens; `<think>`/`</think>` on top); the model's is
            `padded_vocab_size(len(tokenizer))`.
        hidden_size: model width; head_dim 32, KV heads = heads // 2, intermediate = 3 * hidden_size.
        num_hidden_layers: decoder layers (≥ 4 so the DFlash layer formula applies).
        train_steps: AdamW steps (5% warmup then cosine to 10% of `lr`) on `batch_size` conversations of
            ≤ 256 tokens; 0 leaves the random init.
        num_threads: torch intra-op threads (None = torch's); determinism holds for a fixed count.
        log: callable for progress lines (None = silent).

    Writes the model and tokenizer files, `chat_template.jinja` and `demo_target.json` (build facts: seed,
    steps, final loss, seconds, `len(tokenizer)`, `vocab_size`, ...; and `params`, the settings asked for as config
    `target.demo` names them).

    Raises:
        DataError: unreadable corpus."""
    log = log or (lambda msg: None)
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    settings = _Settings(seed, vocab_size, hidden_size, num_hidden_layers, train_steps, batch_size, lr)
    with _seeded_deterministic_torch(seed, num_threads):
        convs = load_corpus(corpus_files)
        tokenizer, model = _init_tokenizer_and_model(convs, settings, log)
        examples = _training_examples(tokenizer, convs)
        losses, train_s = _train_demo(model, tokenizer, examples, settings, log)
        facts = _build_facts(model, losses, train_s, settings, len(examples), corpus_files, len(tokenizer))
        _write_demo(out_dir, model, tokenizer, facts, t0)
        log(f"demo target written to {out_dir} in {facts['seconds']:.1f}s (final loss {facts['final_loss']})")
        return out_dir


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The build settings of `build_demo_target` (its arguments of the same names) that its steps share."""

    seed: int
    vocab_size: int  # asked of the BPE trainer (the model's is padded_vocab_size(len(tokenizer)))
    hidden_size: int
    num_hidden_layers: int
    train_steps: int
    batch_size: int
    lr: float


@contextlib.contextmanager
def _seeded_deterministic_torch(seed: int, num_threads: int | None) -> Iterator[None]:
    """Set torch's intra-op threads (when given; left so afterwards), seed `random` and torch with `seed`
    and turn on torch's deterministic algorithms for the `with` block (the previous setting is restored)."""
    import torch

    if num_threads is not None:
        torch.set_num_threads(num_threads)
    random.seed(seed)
    torch.manual_seed(seed)
    prev_det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_det)


def _init_tokenizer_and_model(convs: list[list[dict]], settings: _Settings, log):
    """Train the BPE tokenizer on every message of `convs`, then build the randomly initialised `Qwen3ForCausalLM`;
    returns `(tokenizer, model)`."""
    import torch

    tokenizer = train_tokenizer([m["content"] for c in convs for m in c], vocab_size=settings.vocab_size)
    n_tok = len(tokenizer)
    log(f"demo target: {len(convs)} conversations, len(tokenizer)={n_tok}, vocab_size={padded_vocab_size(n_tok)}")
    torch.manual_seed(settings.seed)
    from transformers import Qwen3ForCausalLM

    return tokenizer, Qwen3ForCausalLM(_demo_config(tokenizer, settings.hidden_size, settings.num_hidden_layers))


def _training_examples(tokenizer, convs: list[list[dict]]) -> list[tuple[list[int], list[int]]]:
    """`(input_ids, loss_mask)` of every conversation (`encode_conversation`), leaving out those
    whose answer was cut off entirely (no loss token)."""
    examples = [encode_conversation(tokenizer, c) for c in convs]
    return [e for e in examples if sum(e[1]) > 0]


def _build_facts(
    model,
    losses: list[float],
    train_s: float,
    settings: _Settings,
    num_examples: int,
    corpus_files: Sequence[str | os.PathLike],
    len_tokenizer: int,
) -> dict:
    """The build facts written to `demo_target.json`; `final_loss` is the mean of the last 20 training losses;
    `params` the `target.demo` settings it was built with, which `workflow.keyed_paths` reads back as
    the directory's key."""
    import torch

    tail = losses[-20:]
    s = settings
    return {
        "schema_version": DEMO_SCHEMA_VERSION,
        "seed": s.seed,
        "train_steps": s.train_steps,
        "batch_size": s.batch_size,
        "lr": s.lr,
        "max_seq_len": MAX_SEQ_LEN,
        "num_conversations": num_examples,
        "corpus_files": [str(f) for f in corpus_files],
        "final_loss": round(sum(tail) / len(tail), 4) if tail else None,
        "first_loss": round(losses[0], 4) if losses else None,
        "train_seconds": round(train_s, 2),
        "seconds": None,  # set when written
        "len_tokenizer": len_tokenizer,
        "vocab_size": model.config.vocab_size,
        "hidden_size": s.hidden_size,
        "num_hidden_layers": s.num_hidden_layers,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(),
        "params": {
            "seed": s.seed,
            "vocab_size": s.vocab_size,
            "hidden_size": s.hidden_size,
            "num_hidden_layers": s.num_hidden_layers,
            "train_steps": s.train_steps,
        },
    }


def _demo_config(tokenizer, hidden_size: int, num_hidden_layers: int):
    """The demo's `Qwen3Config`: head_dim 32, GQA 2:1, tied embeddings, padded vocab (module docstring)."""
    from transformers import Qwen3Config

    heads = max(1, hidden_size // 32)
    return Qwen3Config(
        vocab_size=padded_vocab_size(len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden_size // heads,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
    )


def _train_demo(model, tokenizer, examples, settings: _Settings, log):
    """AdamW (5% warmup, cosine to 10%) on the assistant tokens; returns `(losses, seconds)`; model in eval mode."""
    import torch

    seed, train_steps, batch_size, lr = settings.seed, settings.train_steps, settings.batch_size, settings.lr
    model.train()
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warm = max(1, train_steps // 20)

    def lr_at(step: int) -> float:
        if step < warm:
            return lr * (step + 1) / warm
        frac = (step - warm) / max(1, train_steps - warm)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    losses: list[float] = []
    t_train = time.perf_counter()
    for step, batch in enumerate(_batches(examples, batch_size, train_steps, rng)):
        input_ids, attn, labels = _collate(batch, tokenizer.pad_token_id)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        out = model(input_ids=input_ids, attention_mask=attn, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
        if step % 50 == 0 or step == train_steps - 1:
            log(f"  step {step:4d}/{train_steps}  loss {losses[-1]:.3f}  {time.perf_counter() - t_train:.1f}s")
    model.eval()
    return losses, time.perf_counter() - t_train


def _write_demo(out_dir: Path, model, tokenizer, facts: dict, t0: float) -> None:
    """Write model, tokenizer, generation config and `demo_target.json` via a sibling temp dir + rename."""
    from transformers import GenerationConfig

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        gen = GenerationConfig(
            eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(ENDOFTEXT)],
            pad_token_id=tokenizer.pad_token_id,
            do_sample=False,
        )
        gen.save_pretrained(tmp)
        facts["seconds"] = round(time.perf_counter() - t0, 2)
        write_json(tmp / "demo_target.json", facts)
        for p in tmp.iterdir():
            os.chmod(p, 0o644)  # save_pretrained writes safetensors 0600
        os.chmod(tmp, 0o755)
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def greedy_answer(target_dir: str | os.PathLike, question: str, *, max_new_tokens: int = 96) -> str:
    """Greedy answer of the target at `target_dir` to one user `question` (thinking disabled).

    A convenience for eyeballing the demo target; returns the decoded new text without special tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir))
    model.eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: `python -m dflash_pipeline.demo OUT_DIR [--train-steps N] [--seed S] ...`."""
    ap = argparse.ArgumentParser(prog="python -m dflash_pipeline.demo", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--corpus", nargs="+", default=list(DEFAULT_CORPUS_FILES), dest="corpus_files", metavar="CORPUS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-hidden-layers", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("--threads", type=int, default=None, dest="num_threads", metavar="THREADS")
    ap.add_argument("--sample", action="store_true", help="print a greedy answer to a GSM8K test question")
    build_args = vars(ap.parse_args(argv))  # every flag but --sample is build_demo_target's argument of its dest
    sample = build_args.pop("sample")
    out = build_demo_target(**build_args)
    if sample:
        q = (
            "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
            "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 "
            "per fresh duck egg. How much in dollars does she make every day at the farmers' market?"
        )
        print(f"Q: {q}\nA: {greedy_answer(out, q)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
