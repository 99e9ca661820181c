"""The block sizes a drafter runs with: the one rule for "B ≥ 2" and for "no more than the trained B".

A block is [bonus token, MASK × (B − 1)] (reference/dflash.md §2.5), so fewer than 2 slots draft nothing,
and the drafter's masks, positions and decay weights (§4) are laid out for at most its trained size. Free
of heavy imports: the plan-time config checks call it.
"""

from __future__ import annotations

from typing import Optional

from dflash_pipeline.core.errors import ConfigError


class BlockSizeError(ConfigError, ValueError):
    """A block size below 2 or above the drafter's trained one (message names the config key)."""


def check_block_size(block_size: int, *, key: str = "block_size") -> int:
    """`block_size` as an int when it is ≥ 2 (slot 0 is the bonus token, dflash.md §2.5).

    Raises:
        BlockSizeError: `block_size` < 2, naming `key` (e.g. `drafter.block_size`).
    """
    if isinstance(block_size, bool) or int(block_size) != block_size or int(block_size) < 2:
        raise BlockSizeError(f"{key} {block_size} must be >= 2 (slot 0 of a block is the bonus token)")
    return int(block_size)


def resolve_block_size(requested: Optional[int], trained: int, *, key: str = "eval.block_size") -> int:
    """The block size to run: `requested` (`eval.block_size`; None = the trained one), never more than
    `trained` (the drafter's `block_size`, as trained).

    Raises:
        BlockSizeError: the result is < 2, or `requested` exceeds `trained` (naming `key`).
    """
    trained = check_block_size(trained, key="drafter.block_size")
    if requested is None:
        return trained
    bs = check_block_size(requested, key=key)
    if bs > trained:
        raise BlockSizeError(f"{key}: {bs} exceeds the drafter's trained block size {trained} (null = the trained one)")
    return bs
