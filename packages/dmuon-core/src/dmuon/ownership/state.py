"""Per-model dedication state: what `dedicate_params` attaches to a model.

The state only describes; the `DedicationRuntime` it holds is the one owner of everything
that changes during training (broadcast buffers, gradient attributes, the sync flag).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from dmuon.ownership.param import DedicatedParam

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from dmuon.comm import CommAudit
    from dmuon.ownership.planner import OwnerPlan
    from dmuon.ownership.runtime import DedicationRuntime

STATE_ATTR = "_dmuon_state"


@dataclass(eq=False)
class DedicationState:
    """Everything a `dedicate_params` call attached to its model."""

    rank: int
    world_size: int
    runtime: DedicationRuntime
    params: list[DedicatedParam] = field(default_factory=list)
    plan: OwnerPlan | None = None
    #: The mesh passed to `dedicate_params` (``None``: the default process group).
    mesh: DeviceMesh | None = None

    def __deepcopy__(self, memo: dict[int, object]) -> DedicationState:
        raise ValueError(
            "a model passed to dmuon.dedicate_params cannot be deep-copied: its dedicated "
            "parameters live on their owners and in freed broadcast buffers. Copy the model "
            "before calling dedicate_params, or save and load a state dict."
        )

    @property
    def audit(self) -> CommAudit:
        """The communication audit of this model's dedicated parameters."""
        return self.runtime.comm.audit

    def owned(self) -> list[DedicatedParam]:
        """The dedicated parameters this rank owns (and steps)."""
        return [p for p in self.params if p.is_owned]


def get_dedication(model: nn.Module) -> DedicationState | None:
    """Return the dedication state `dedicate_params` attached to ``model``, or ``None``."""
    return getattr(model, STATE_ATTR, None)


def require_dedication(model: nn.Module) -> DedicationState:
    """Return the dedication state of ``model``; raise a `ValueError` that says what to do."""
    state = get_dedication(model)
    if state is None:
        raise ValueError(
            "this model has no dedicated parameters; call dmuon.dedicate_params(model, mesh) "
            "before fully_shard and before creating the optimizer"
        )
    return state
