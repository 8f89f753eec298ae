"""Per-model dedication state: what `dedicate_params` attaches to a model.

The optimizer and `no_sync` read this state; only the ownership package mutates it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from dmuon.comm import CommAudit
    from dmuon.ownership.planner import OwnerPlan
    from dmuon.ownership.runtime import DedicationRuntime

STATE_ATTR = "_dmuon_state"


@dataclass(eq=False)
class DedicatedParam:
    """One Muon-target matrix and where it lives.

    ``param`` is the parameter registered on the module between forwards: the full float32
    master on the owner, a 0-element placeholder on every other rank. The owner's averaged
    gradient is ``param._reduced_grad``; local accumulation under `no_sync` is
    ``param._accumulated_grad`` (both ``None`` after ``zero_grad``).
    """

    fqn: str
    module: nn.Module
    attr: str
    owner: int
    shape: torch.Size
    param: nn.Parameter
    boundary: str
    is_owned: bool

    @property
    def numel(self) -> int:
        """Number of elements of the full matrix."""
        return self.shape.numel()


@dataclass(eq=False)
class DedicationState:
    """Everything a `dedicate_params` call attached to its model."""

    rank: int
    world_size: int
    params: list[DedicatedParam] = field(default_factory=list)
    plan: OwnerPlan | None = None
    audit: CommAudit | None = None
    runtime: DedicationRuntime | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> DedicationState:
        raise ValueError(
            "a model passed to dmuon.dedicate_params cannot be deep-copied: its dedicated "
            "parameters live on their owners and in freed broadcast buffers. Copy the model "
            "before calling dedicate_params, or save and load a state dict."
        )

    def owned(self) -> list[DedicatedParam]:
        """The dedicated parameters this rank owns (and steps)."""
        return [p for p in self.params if p.is_owned]

    def mark_parameters_updated(self) -> None:
        """Tell the runtime that owners changed their masters (called by ``Muon.step``).

        Z2 keeps broadcast buffers resident across micro-batches; this invalidates them so
        the next forward broadcasts the new values.
        """
        if self.runtime is not None:
            self.runtime.parameters_updated()


def get_dedication(model: nn.Module) -> DedicationState | None:
    """Return the dedication state `dedicate_params` attached to ``model``, or ``None``."""
    return getattr(model, STATE_ATTR, None)
