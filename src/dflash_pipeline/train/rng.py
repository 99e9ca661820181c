"""The random streams of a training run, and how `state/` keeps them: a resumed run is the run.

Killed at any step and restarted from its last `state/`, a run ends with the weights of an uninterrupted
run (bit-identical in fp32 on CPU: `tests/unit/train/test_resume.py`). Every random stream is a function
of `train.seed` and of `state/`:

- **the data order**: Accelerate's `SeedableRandomSampler`; epoch e's permutation is seeded
  `train.seed + e` on every rank, so `skip_first_batches` on a resume skips the right batches (a plain
  `RandomSampler` is neither reseeded by `set_epoch` nor saved).
- **the anchor generator** of each rank (`RankStreams`), registered for checkpointing
  (`state/custom_checkpoint_<i>.pkl`).
- **the global generators** (python, numpy, torch CPU and CUDA): `state/random_states_<rank>.pkl`.

A state without `STATE_VERSION` in `state/step.json` resumes with a warning that the run will not match.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

#: `state/step.json["version"]`: 2 = data order (seeded per epoch) and per-rank anchor streams in state;
#: a state without the key is version 1 (sampler and anchor generator not saved).
STATE_VERSION = 2


def dataloader_config(seed: int):
    """Accelerate's `DataLoaderConfiguration` of the run: the seedable sampler."""
    from accelerate import DataLoaderConfiguration

    return DataLoaderConfiguration(use_seedable_sampler=True, data_seed=int(seed))


class RankStreams:
    """The per-rank `torch.Generator` s the trainer draws from (the anchor generator), as one object
    Accelerate checkpoints (`register_for_checkpointing`).

    Accelerate writes a custom object from the main process only, so `state_dict` gathers every
    rank's generator states (a collective: every rank calls it, as `save_state` does) and
    `load_state_dict` takes this rank's. State: `{"world_size": int, "ranks": [{name: uint8 state}]}`.
    """

    def __init__(self, generators: Mapping[str, torch.Generator], *, rank: int, world_size: int):
        self.generators = dict(generators)
        self.rank = int(rank)
        self.world_size = int(world_size)

    def state_dict(self) -> dict:
        """Every rank's generator states, gathered (collective)."""
        from accelerate.utils import gather_object

        mine = {name: g.get_state() for name, g in self.generators.items()}
        ranks = gather_object([mine]) if self.world_size > 1 else [mine]
        return {"world_size": self.world_size, "ranks": list(ranks)}

    def load_state_dict(self, state: dict) -> None:
        """Set this rank's generators to their saved states.

        Raises:
            ValueError: the state was saved by another number of ranks, or lacks one of the generators.
        """
        saved = int(state.get("world_size", -1))
        if saved != self.world_size:
            raise ValueError(
                f"state/ was saved by {saved} rank(s) and this run has {self.world_size}: its per-rank anchor "
                f"streams cannot continue; run with train.num_processes × num_machines = {saved}, or delete "
                "state/ to restart from step 0"
            )
        mine = state["ranks"][self.rank]
        missing = sorted(set(self.generators) - set(mine))
        if missing:
            raise ValueError(
                f"state/ holds no saved stream {missing} (it has {sorted(mine)}); delete state/ to restart"
            )
        for name, g in self.generators.items():
            g.set_state(mine[name])
