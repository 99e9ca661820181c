"""Token level of the tokens stage: training sequences -> `input_ids` int32 and `loss_mask` uint8.

Steps 4 and 5 of docs/DESIGN.md §5: each `TrainSequence` is tokenized once; a token is supervised iff its
character span lies inside a supervised span (`span_token_ranges`; reference `mask_from_offsets`); text
the target generated is spliced in as its output ids or encoded without parsing special tokens
(`plain_text_tokenizer`). `server_ids_sequence` builds a row from server token ids.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np

from dflash_pipeline.core.errors import TokenizationError
from dflash_pipeline.target.spans import TrainSequence


def mask_from_offsets(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """Loss mask from token character offsets.

    Args:
        offsets: int array [num_tokens, 2] of `(start, end)` character offsets into the sequence text.
        spans: supervised character spans, sorted and non-overlapping.

    Returns:
        `(mask, straddling)`: uint8 [num_tokens] (1 iff the token's non-empty span lies inside a
        supervised span) and the number of tokens that overlap a span without lying inside it.
    """
    n = len(offsets)
    mask = np.zeros(n, dtype=np.uint8)
    if n == 0 or not spans:
        return mask, 0
    starts = offsets[:, 0]
    ends = offsets[:, 1]
    sp = np.asarray(spans, dtype=np.int64)
    idx = np.searchsorted(sp[:, 0], starts, side="right") - 1
    valid = idx >= 0
    idx_c = np.clip(idx, 0, None)
    s_end = sp[idx_c, 1]
    nonempty = ends > starts
    inside = valid & nonempty & (ends <= s_end) & (starts < s_end)
    mask[inside] = 1
    # overlap without inclusion: token starts before a span and ends after its start, or starts inside
    # a span and ends after its end
    nxt = np.clip(idx + 1, 0, len(sp) - 1)
    over_next = (idx + 1 < len(sp)) & (ends > sp[nxt, 0]) & nonempty
    over_cur = valid & nonempty & (starts < s_end) & (ends > s_end)
    straddling = int(np.count_nonzero((over_next | over_cur) & ~inside))
    return mask, straddling


def span_token_ranges(
    encoding, spans: Sequence[tuple[int, int]], n_chars: int
) -> tuple[list[tuple[int, int]], int] | None:
    """Token index ranges of supervised character spans, from the span boundaries only: the same as
    `mask_from_offsets` when offsets are non-decreasing, at two `char_to_token` lookups per span.

    Args:
        encoding: a `tokenizers.Encoding` of the sequence text (`add_special_tokens=False`).
        spans: supervised character spans, sorted and non-overlapping.
        n_chars: length of the sequence text in characters.

    Returns:
        `([(first_token, end_token), ...], straddling_tokens)`, or None when a boundary character maps to
        no token: callers then use `mask_from_offsets`."""
    ranges: list[tuple[int, int]] = []
    straddlers: set[int] = set()  # a token can straddle two spans (or both ends of one): count it once
    n_tokens = len(encoding.ids)
    for s, e in spans:
        if e <= s:
            continue
        t = encoding.char_to_token(s)
        if t is None:
            return None
        first = t
        if encoding.token_to_chars(t)[0] < s:
            straddlers.add(t)
            first = t + 1
        if e >= n_chars:
            end = n_tokens
        else:
            end = encoding.char_to_token(e)
            if end is None:
                return None
            if encoding.token_to_chars(end)[0] < e:
                straddlers.add(end)
        ranges.append((first, max(first, end)))
    return ranges, len(straddlers)


def _encoding_mask(encoding, spans: Sequence[tuple[int, int]], n_chars: int) -> tuple[np.ndarray, int]:
    """`(loss_mask uint8 [num_tokens], straddling_tokens)` of a `tokenizers.Encoding` of a text of
    `n_chars` characters: from the span boundaries (`span_token_ranges`), else from every token's
    offsets (`mask_from_offsets`)."""
    found = span_token_ranges(encoding, spans, n_chars)
    if found is None:
        return mask_from_offsets(np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2), spans)
    ranges, straddling = found
    mask = np.zeros(len(encoding.ids), dtype=np.uint8)
    for a, b in ranges:
        mask[a:b] = 1
    return mask, straddling


def plain_text_tokenizer(tokenizer):
    """The target's Rust tokenizer without its added-token vocabulary, so special-token strings in text are encoded
    as the ordinary characters they are, and with no prefix space prepended (the text it encodes continues a sequence).
    Cached on the tokenizer.

    Returns None for a tokenizer without `backend_tokenizer`.
    """
    cached = getattr(tokenizer, "_dflash_plain_backend", None)
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    spec["added_tokens"] = []

    def no_prepend(node):  # Metaspace pre-tokenizers / Prepend normalizers add "▁" at a text's start
        if isinstance(node, dict):
            if node.get("type") == "Metaspace":
                node["prepend_scheme"] = "never"
                node.pop("add_prefix_space", None)
            for key in ("normalizers", "pretokenizers"):
                if isinstance(node.get(key), list):
                    node[key] = [n for n in node[key] if not (isinstance(n, dict) and n.get("type") == "Prepend")]
                    for n in node[key]:
                        no_prepend(n)
        return node

    if isinstance(spec.get("normalizer"), dict) and spec["normalizer"].get("type") == "Prepend":
        spec["normalizer"] = None
    no_prepend(spec.get("normalizer"))
    no_prepend(spec.get("pre_tokenizer"))
    plain = Tokenizer.from_str(json.dumps(spec))
    try:
        tokenizer._dflash_plain_backend = plain
    except AttributeError:
        pass
    return plain


def _segmented(tokenizer, seq: TrainSequence) -> tuple[np.ndarray, np.ndarray, int]:
    """Tokenize a sequence with `verbatim` entries piece by piece: template text as the target's tokenizer
    encodes it (special tokens parsed), each verbatim range as its output ids or as plain text
    (`plain_text_tokenizer`), supervised in full. Returns `(input_ids, loss_mask, straddling)`."""
    backend = tokenizer.backend_tokenizer
    plain = plain_text_tokenizer(tokenizer)
    ids_parts: list[np.ndarray] = []
    mask_parts: list[np.ndarray] = []
    straddling = 0
    cur = 0

    def template_piece(a: int, b: int):
        nonlocal straddling
        if b <= a:
            return
        piece = seq.text[a:b]
        enc = backend.encode(piece, add_special_tokens=False)
        spans = [(max(s, a) - a, min(e, b) - a) for s, e in seq.spans if s < b and e > a]
        mask, n = _encoding_mask(enc, spans, len(piece))
        straddling += n
        ids_parts.append(np.asarray(enc.ids, dtype=np.int32))
        mask_parts.append(mask)

    for a, b, ids in seq.verbatim:
        template_piece(cur, a)
        if ids is None:
            ids = plain.encode(seq.text[a:b], add_special_tokens=False).ids
        ids_parts.append(np.asarray(ids, dtype=np.int32))
        mask_parts.append(np.ones(len(ids), dtype=np.uint8))
        cur = b
    template_piece(cur, len(seq.text))
    return np.concatenate(ids_parts), np.concatenate(mask_parts), straddling


def tokenize_sequences(tokenizer, seqs: Sequence[TrainSequence]) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Tokenize sequences (one batched call) and build their masks.

    A sequence with `verbatim` entries is tokenized piece by piece (`_segmented`): the target's output ids, or the text
    encoded without parsing special tokens, with loss 1; the template text around as usual.

    Returns:
        Per sequence `(input_ids int32 [n], loss_mask uint8 [n], straddling_tokens)`.

    Raises:
        TokenizationError: the tokenizer is not a fast tokenizer (no offset mapping).
    """
    if not seqs:
        return []
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizationError(
            "the target tokenizer is not a fast tokenizer (no offset mapping); install `tokenizers` and use a "
            "tokenizer.json"
        )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and any(s.verbatim for s in seqs):
        simple = [s for s in seqs if not s.verbatim]
        done = iter(tokenize_sequences(tokenizer, simple))
        return [_segmented(tokenizer, s) if s.verbatim else next(done) for s in seqs]
    texts = [s.text for s in seqs]
    out = []
    if backend is not None:  # the Rust tokenizer directly: masks from the span boundaries only
        for seq, enc in zip(seqs, backend.encode_batch(texts, add_special_tokens=False)):
            mask, straddling = _encoding_mask(enc, seq.spans, len(seq.text))
            out.append((np.asarray(enc.ids, dtype=np.int32), mask, straddling))
        return out
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    for seq, ids, offs in zip(seqs, enc["input_ids"], enc["offset_mapping"]):
        offsets = np.asarray(offs, dtype=np.int64).reshape(-1, 2)
        mask, straddling = mask_from_offsets(offsets, seq.spans)
        out.append((np.asarray(ids, dtype=np.int32), mask, straddling))
    return out


def server_ids_sequence(turn: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray] | None:
    """Exact sequence from server token ids for one turn: `prompt_token_ids + output_token_ids`.

    Returns `(input_ids int32 [n], loss_mask uint8 [n])` with 1 on the output ids, or None when either list is
    missing. No template is involved. The end-of-turn token is supervised when the server included it in the output
    ids (vLLM does on `finish_reason == "stop"`).
    """
    p, o = turn.get("prompt_token_ids"), turn.get("output_token_ids")
    if not p or not o:
        return None
    ids = np.asarray(list(p) + list(o), dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[len(p) :] = 1
    return ids, mask
