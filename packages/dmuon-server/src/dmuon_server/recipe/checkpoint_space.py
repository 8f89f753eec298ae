"""Whether a job's checkpoints can fit its user's disk quota, decided at submission.

A recipe checkpoint holds the float32 weights and the optimizer's state: AdamW keeps two
float32 moments per parameter, Muon one momentum per matrix element (and AdamW's two for
the other parameters). So one checkpoint takes at least ``12 * P`` bytes under AdamW and
``8 * P`` under dmuon, for ``P`` parameters (the metadata, random states and the
tokenizer come on top). At its peak a job holds ``keep + 1`` of them (the new one is
written before the oldest goes) or, keeping all, every one it saves.

The figures are lower bounds: a job refused here could not have fitted, and one accepted
may still fill the quota (it is then stopped, naming it).
"""

from __future__ import annotations

from dmuon_server.config import format_gib
from dmuon_server.schemas import TrainSpec
from dmuon_server.schemas.responses import FieldError, field_error

#: Bytes per parameter a checkpoint takes at least, by optimizer.
BYTES_PER_PARAMETER = {"adamw": 12, "dmuon": 8}


def checkpoint_bytes(num_params: int, optimizer: str) -> int:
    """The least one checkpoint of a model of ``num_params`` parameters takes."""
    return BYTES_PER_PARAMETER.get(optimizer, 8) * num_params


def checkpoints_held(steps: int, every: int, keep: int) -> int:
    """How many checkpoints a run of ``steps`` steps holds at once at most, saving every
    ``every`` steps (0: only at its end) and keeping the newest ``keep`` (0: all)."""
    saves = steps // every + (1 if steps % every else 0) if every > 0 else 1
    return min(saves, keep + 1) if keep > 0 else saves


def quota_refusal(
    train: TrainSpec, num_params: int, free: int, quota_name: str
) -> FieldError | None:
    """The refusal of a job whose checkpoints cannot fit the ``free`` bytes of its user's
    quota (``quota_name`` says which), or None."""
    optimizer = str(train.optimizer or "dmuon")
    held = checkpoints_held(train.steps, train.checkpoint_every, train.keep_checkpoints)
    need = held * checkpoint_bytes(num_params, optimizer)
    if need <= free:
        return None
    return field_error(
        ("body", "train", "keep_checkpoints"),
        f"the job's checkpoints need at least {format_gib(need)} ({held} at once of "
        f"{format_gib(checkpoint_bytes(num_params, optimizer))} each: {num_params:,} "
        f"parameters under {optimizer}), and {quota_name} has {format_gib(free)} free; "
        "lower keep_checkpoints, raise checkpoint_every, or delete finished jobs",
        "admission",
    )
