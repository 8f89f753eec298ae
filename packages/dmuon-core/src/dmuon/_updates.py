"""`parameters_updated`: tell DMuon that dedicated weights changed outside the optimizer."""

from __future__ import annotations

from torch import nn

from dmuon._ownership.state import require_dedication


def parameters_updated(model: nn.Module) -> None:
    """Refresh the broadcast buffers after changing dedicated weights by hand.

    ``optimizer.step()`` and ``model.load_state_dict`` do this themselves. Call it after
    any other change of an owner's dedicated weights (a manual edit, swapping in EMA
    weights), on every rank, before the next forward: in Z2 the packed buffers stay
    resident between optimizer steps, and the next forward would otherwise reuse the old
    values. Such an in-place change without this call is detected at the next forward,
    which raises a ``RuntimeError`` naming the parameter.

    Raises:
        ValueError: ``model`` was never passed to `dmuon.dedicate_params`.
    """
    require_dedication(model).runtime.invalidate_buffers()
