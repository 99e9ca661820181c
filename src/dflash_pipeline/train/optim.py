"""The drafter's optimizer (`train.optimizer`): AdamW (dflash.md §4.7), or torch's Muon on the 2-D weight
matrices with AdamW on the rest, as speculators and Moonlight run it.

Muon (`torch.optim.Muon`, torch ≥ 2.9) scales its learning rate per matrix to AdamW's update RMS
(`adjust_lr_fn="match_rms_adamw"`), so one `train.learning_rate` serves both, and keeps one momentum
buffer per matrix where AdamW keeps two. `MuonWithAdamW` is one `torch.optim.Optimizer` over both
halves, so checkpointing, the scheduler and clipping see a single optimizer.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

#: `train.optimizer` values.
OPTIMIZERS = ("adamw", "muon")
#: AdamW's settings (dflash.md §4.7); the AdamW half of Muon runs uses them too.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8
#: Muon's momentum (Keller Jordan's and torch's default) and its per-matrix LR scaling.
MUON_MOMENTUM = 0.95
MUON_ADJUST_LR = "match_rms_adamw"


def muon_parameters(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """`(matrices, rest)` of `module`'s trainable parameters: the 2-D weights of its `nn.Linear` layers go to Muon;
    every other parameter to AdamW. Order follows `module.parameters()`."""
    linear = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    matrices, rest = [], []
    for p in module.parameters():
        if p.requires_grad:
            (matrices if id(p) in linear and p.ndim == 2 else rest).append(p)
    return matrices, rest


class MuonWithAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` over `matrices` and `torch.optim.AdamW` over `rest` as one optimizer.

    Both inner optimizers share this optimizer's `state` and its group dicts, so `state_dict` / `load_state_dict` cover
    both, and an LR scheduler's change to a group reaches the optimizer that steps it.

    Raises:
        ValueError: no 2-D parameter for Muon, or a torch without `torch.optim.Muon` (before 2.9).
    """

    def __init__(
        self,
        matrices: Iterable[nn.Parameter],
        rest: Iterable[nn.Parameter],
        *,
        lr: float,
        weight_decay: float = 0.0,
        momentum: float = MUON_MOMENTUM,
        betas: tuple[float, float] = ADAMW_BETAS,
        eps: float = ADAMW_EPS,
    ):
        matrices, rest = list(matrices), list(rest)
        if not hasattr(torch.optim, "Muon"):
            raise ValueError(
                f"train.optimizer: muon needs torch >= 2.9 (torch.optim.Muon); this is torch {torch.__version__}"
            )
        if not matrices:
            raise ValueError("train.optimizer: muon needs 2-D weight matrices; the drafter has none")
        self._muon = torch.optim.Muon(
            matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, adjust_lr_fn=MUON_ADJUST_LR
        )
        groups = [dict(g, use_muon=True) for g in self._muon.param_groups]
        self._adamw = None
        if rest:
            self._adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
            groups += [dict(g, use_muon=False) for g in self._adamw.param_groups]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        self._link()

    def _link(self) -> None:
        """Point the inner optimizers at this optimizer's group dicts and state (after init and every load)."""
        self._muon.param_groups = [g for g in self.param_groups if g["use_muon"]]
        self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        """As `torch.optim.Optimizer.load_state_dict`; the inner optimizers follow the loaded groups."""
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on the matrices, one AdamW step on the rest; returns `closure()`'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon.step()
        if self._adamw is not None:
            self._adamw.step()
        return loss


def make_optimizer(module: nn.Module, name: str, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """`train.optimizer` `name` over `module`'s trainable parameters: `adamw` (betas 0.9/0.999,
    eps 1e-8) or `muon` (`MuonWithAdamW`).

    Raises:
        ValueError: an unknown `name`.
    """
    if name == "adamw":
        return torch.optim.AdamW(
            module.parameters(), lr=lr, weight_decay=weight_decay, betas=ADAMW_BETAS, eps=ADAMW_EPS
        )
    if name == "muon":
        matrices, rest = muon_parameters(module)
        return MuonWithAdamW(matrices, rest, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"train.optimizer: {name!r} is not one of {', '.join(OPTIMIZERS)}")
