"""Per-model dedication state: what `dedicate_params` attaches to a model.

The state only describes; the `DedicationRuntime` it holds is the one owner of everything
that changes during training (broadcast buffers, gradient attributes, the sync flag).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from dmuon._ownership.param import DedicatedParam

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from dmuon._comm_audit import CommAudit
    from dmuon._ownership.planner import OwnerPlan
    from dmuon._ownership.runtime import DedicationRuntime
    from dmuon._ownership.split_iterations import SplitBlock

STATE_ATTR = "_dmuon_state"
#: On every module of a dedicated model: a weak reference to the model.
ROOT_ATTR = "_dmuon_dedicated_root"


@dataclass(eq=False)
class DedicationState:
    """Everything a `dedicate_params` call attached to its model."""

    rank: int
    world_size: int
    runtime: DedicationRuntime
    params: list[DedicatedParam] = field(default_factory=list)
    plan: OwnerPlan | None = None
    #: This rank's block of ranks sharing Newton-Schulz iterations (``ns_split``), where
    #: the plan splits one stepped in it.
    split_block: SplitBlock | None = None
    #: The mesh passed to `dedicate_params`, or one over the default process group
    #: (``None`` in one process); state dicts place dedicated tensors on it.
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


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a ``DistributedDataParallel`` wrapper (``model`` itself otherwise).

    Every public function takes the model or its wrapper; keys and names are the
    unwrapped model's, as torch's own state-dict functions give them.
    """
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def get_dedication(model: nn.Module) -> DedicationState | None:
    """Return the dedication state `dedicate_params` attached to ``model`` (or to the model
    a DDP wrapper holds), or ``None``."""
    return getattr(unwrap(model), STATE_ATTR, None)


def attach(model: nn.Module, state: DedicationState) -> None:
    """Attach ``state`` to ``model``, and tell each of its modules which model it is in."""
    setattr(model, STATE_ATTR, state)
    root = weakref.ref(model)
    for module in model.modules():
        object.__setattr__(module, ROOT_ATTR, root)


def dedicated_root(module: nn.Module) -> nn.Module | None:
    """The dedicated model ``module`` is part of (itself, an ancestor), or ``None``."""
    ref = getattr(module, ROOT_ATTR, None)
    root = ref() if ref is not None else None
    return root if root is not None and get_dedication(root) is not None else None


def require_dedication(model: nn.Module) -> DedicationState:
    """Return the dedication state of ``model``; raise a `ValueError` that says what to do."""
    state = get_dedication(model)
    if state is None:
        raise ValueError(
            "this model has no dedicated parameters; call dmuon.dedicate_params(model, mesh) "
            "before fully_shard and before creating the optimizer"
        )
    return state
