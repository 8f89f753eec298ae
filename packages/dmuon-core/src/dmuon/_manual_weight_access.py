"""`parameters_updated`: tell DMuon that dedicated weights changed outside the optimizer;
`wait_for_updates`: wait until the last step's values reached every replica (HSDP)."""

from __future__ import annotations

from torch import nn

from dmuon._ownership.dedication_state import require_dedication


def parameters_updated(model: nn.Module) -> None:
    """Refresh the broadcast buffers after changing dedicated weights by hand.

    ``optimizer.step()`` and ``model.load_state_dict`` do this themselves. Call it after
    any other change of an owner's dedicated weights (a manual edit, swapping in EMA
    weights), on every rank, before the next forward: in Z2 the packed buffers stay
    resident between optimizer steps, and the next forward would otherwise reuse the old
    values. Such an in-place change without this call is detected at the next forward,
    which raises a ``RuntimeError`` naming the parameter.

    Under HSDP with a forward dtype narrower than float32, only the replica that steps a
    matrix holds its float32 master; the other replicas' owners hold a copy in the
    forward's dtype. This call then sends every stepping owner's values to those copies
    (the stepping replica's edit wins), so the replicas stay identical.

    Raises:
        ValueError: ``model`` was never passed to `dmuon.dedicate_params`.
    """
    runtime = require_dedication(model).runtime
    runtime.replica_updates.resend_values()  # HSDP: the copies follow the stepping owners
    runtime.invalidate_buffers()


def wait_for_updates(model: nn.Module) -> None:
    """Wait until every replica's dedicated weights hold the last step's values.

    Under HSDP the values a step computed travel to the other replicas while the next
    forward runs: each hook boundary waits for its own matrices before it uses them.
    Everything DMuon offers that reads or writes the weights waits for all of them first
    (the next step, state dicts and ``model.state_dict()``, loads, export,
    `parameters_updated`; clipping reads gradients only); call this before reading or
    writing ``p.data`` of a dedicated parameter yourself (an EMA of the weights, a custom
    check). On a 1-D mesh there is nothing to wait for. Call it on every rank.

    Raises:
        ValueError: ``model`` was never passed to `dmuon.dedicate_params`.
    """
    require_dedication(model).runtime.wait_for_updates()
