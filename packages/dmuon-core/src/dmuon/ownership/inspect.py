"""Read-only views of what `dedicate_params` set up: owners, placement, traffic."""

from __future__ import annotations

from torch import nn

from dmuon.comm import CommAudit
from dmuon.ownership.planner import OwnerPlan
from dmuon.ownership.state import DedicatedParam, DedicationState, get_dedication


def _require_state(model: nn.Module) -> DedicationState:
    state = get_dedication(model)
    if state is None:
        raise ValueError(
            "this model has no dedicated parameters; call dmuon.dedicate_params(model, mesh) "
            "before fully_shard and before creating the optimizer"
        )
    return state


def comm_audit(model: nn.Module) -> CommAudit:
    """The communication audit of a dedicated model.

    ``comm_audit(model).last_step()`` describes the collectives DMuon issued for dedicated
    parameters during the most recent optimizer step (kind, count, elements, bytes) and
    their total in units of (N-1)/N x P_M, where P_M is the number of dedicated elements.

    Raises:
        ValueError: If ``model`` was never passed to `dmuon.dedicate_params`.
    """
    audit = _require_state(model).audit
    assert audit is not None
    return audit


def dedicated_parameters(model: nn.Module) -> list[DedicatedParam]:
    """Every dedicated parameter of ``model`` with its name, owner and shape.

    Raises:
        ValueError: If ``model`` was never passed to `dmuon.dedicate_params`.
    """
    return list(_require_state(model).params)


def owner_plan(model: nn.Module) -> OwnerPlan:
    """The owner plan `dmuon.dedicate_params` used: owners, per-rank loads, imbalance.

    Raises:
        ValueError: If ``model`` was never passed to `dmuon.dedicate_params`.
    """
    plan = _require_state(model).plan
    assert plan is not None
    return plan
