"""What both sides of the comparison share: the data, the freezing schedule, the settings.

The global batch of a step is the same whatever the layout; each data-parallel rank takes
its rows (``tensor_split``, so sizes may differ by one), each micro-batch its rows of
those, each forward its rows of the micro-batch. A piece's mean loss is weighted by its
share of the global batch (times the data-parallel size, which the gradient averaging
divides by), so the gradients are those of the global batch's mean loss, however it is cut.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from fuzzing.cases import AFTER_DEDICATION, BEFORE_DEDICATION, Case

LR, ADAMW_LR, ADAMW_WD = 0.02, 3e-3, 0.01
#: The "custom" groups: layer 0's matrices, and the AdamW part of the no-decay group.
CUSTOM_MUON = {"lr": 0.04, "momentum": 0.9, "weight_decay": 0.05}
CUSTOM_NO_DECAY_LR = 0.01


def global_batch(case: Case, step: int) -> torch.Tensor:
    """Token ids of step ``step``: ``rows`` sequences of ``seq + 1``."""
    gen = torch.Generator().manual_seed(case.seed * 131 + step)
    return torch.randint(0, case.model.vocab, (case.rows, case.seq + 1), generator=gen)


def pieces(tokens: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """``tokens`` cut by rows into ``parts`` pieces whose sizes differ by at most one."""
    return list(torch.tensor_split(tokens, parts))


def static_frozen(case: Case, when: int) -> list[str]:
    """Parameters frozen at ``when`` (before or after dedication)."""
    assert when in (BEFORE_DEDICATION, AFTER_DEDICATION)
    return [f.param for f in case.freezes if f.at == when]


def schedule_changes(case: Case, step: int) -> Iterator[tuple[str, bool]]:
    """``(name, requires_grad)`` to set before step ``step``."""
    for freeze in case.freezes:
        if freeze.at == step:
            yield freeze.param, False
        if freeze.until == step:
            yield freeze.param, True


def apply_schedule(model: nn.Module, case: Case, steps: range) -> None:
    """Apply the freezing schedule's changes of ``steps`` to ``model``, in order."""
    for step in steps:
        for name, wanted in schedule_changes(case, step):
            model.get_parameter(name).requires_grad_(wanted)


def frozen_at_construction(case: Case) -> set[str]:
    """Parameters frozen when the optimizer is built: they go to its default groups."""
    return {f.param for f in case.freezes if f.at < 0}


def layer0_prefix(case: Case) -> str:
    """Names of layer 0's parameters start with this."""
    return f"{case.model.container}.0."
