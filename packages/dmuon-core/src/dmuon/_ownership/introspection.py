"""Read-only views of what `dedicate_params` set up: owners, placement, traffic."""

from __future__ import annotations

from torch import nn

from dmuon._comm_audit import CommAudit
from dmuon._ownership.dedication_state import require_dedication as _require_state
from dmuon._ownership.param import DedicatedParam
from dmuon._ownership.planner import OwnerPlan


class DedicatedParameters(tuple[DedicatedParam, ...]):
    """The dedicated parameters of a model, in order; also usable as FSDP2's ``ignored_params``.

    Iterating yields `DedicatedParam` records (name, owner, shape, boundary); a stack split
    by experts yields one record per range (``dp.experts``, ``dp.name``). ``x in it``
    is true for a record and for the ``nn.Parameter`` it describes, which is what
    ``fully_shard(..., ignored_params=...)`` asks.
    """

    def __contains__(self, item: object) -> bool:
        return any(item is dp or item is dp.param or item is dp.registered for dp in self)

    def parameters(self) -> set[nn.Parameter]:
        """The registered ``nn.Parameter`` objects (masters on owners, placeholders elsewhere).

        A stack split by experts adds its placeholder and every range's master.
        """
        return {p for dp in self for p in (dp.param, dp.registered) if p is not None}


def comm_audit(model: nn.Module) -> CommAudit:
    """The communication audit of a dedicated model.

    ``comm_audit(model).last_step()`` describes the collectives DMuon issued for dedicated
    parameters during the most recent optimizer step (kind, count, elements, bytes) and
    their total in units of (N-1)/N x P_M, where P_M is the number of dedicated elements.
    On a 2-D (HSDP) mesh N is the shard group's size, and the cross-replica all-reduces
    are reported apart (``StepComm.replicate``, ``StepComm.replicate_units``, and a
    ``"dimensions"`` entry of ``as_dict()``).

    Raises:
        ValueError: If ``model`` was never passed to `dmuon.dedicate_params`.
    """
    return _require_state(model).audit


def dedicated_parameters(model: nn.Module) -> DedicatedParameters:
    """Every dedicated parameter of ``model`` with its name, owner and shape.

    The result can be passed to ``fully_shard(..., ignored_params=...)`` for users who
    prefer to keep FSDP2 away from the dedicated parameters explicitly.

    Raises:
        ValueError: If ``model`` was never passed to `dmuon.dedicate_params`.
    """
    return DedicatedParameters(_require_state(model).params)


def owner_plan(model: nn.Module) -> OwnerPlan:
    """The owner plan `dmuon.dedicate_params` used: owners, per-rank loads, imbalance.

    A stack split by experts shows one owner per range, named ``fqn[start:stop]``
    (``owners``), and its ranges in ``expert_ranges[fqn]``.

    Raises:
        ValueError: If ``model`` was never passed to `dmuon.dedicate_params`.
    """
    plan = _require_state(model).plan
    assert plan is not None
    return plan
