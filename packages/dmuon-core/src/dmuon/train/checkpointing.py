"""Checkpoints of the recipe: a folder of ``step_NNNNNNNN`` DCP directories.

Layout of ``--checkpoint-dir DIR``:

* ``DIR/step_{step:08d}/`` is one complete checkpoint: a ``torch.distributed.checkpoint``
  directory (its ``.metadata`` file and one data file per rank) holding
  ``{"model": ..., "optim": ...}`` from `get_state_dict` (saved from all ranks at once),
  plus ``trainer_state.pt`` (step, LR scheduler, elapsed time, batch geometry; written by
  rank 0) and ``rng_rank{r}.pt`` (rank ``r``'s random number generator states).
* A checkpoint is written as ``DIR/.tmp_step_{step:08d}/`` and renamed by rank 0 after
  every rank has finished writing (a barrier). A process killed during a save therefore
  leaves a ``.tmp_`` folder, which is never a checkpoint and is removed by the next run;
  the previous checkpoint stays the latest.
* The latest checkpoint is the complete ``step_*`` folder with the highest step.

The data position needs no state of its own: the sampler is indexed by the step
(`dmuon.train.data.GlobalBatchSampler.rank_batch`), so a run resumed after step ``k``
draws the batches of steps ``k + 1, k + 2, ...`` exactly as an uninterrupted run does.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

# dmuon's state-dict functions have the signatures of torch.distributed.checkpoint's
# and are torch's on a model without dedicated parameters (the AdamW baseline).
from dmuon import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict

__all__ = [
    "TRAINER_STATE_FILE",
    "CheckpointError",
    "checkpoint_name",
    "find_checkpoints",
    "is_complete",
    "latest_checkpoint",
    "load_training_state",
    "load_weights",
    "read_trainer_state",
    "remove_incomplete",
    "require_checkpoint",
    "restore_rng_state",
    "rng_state",
    "rotate_checkpoints",
    "save_checkpoint",
]

TRAINER_STATE_FILE = "trainer_state.pt"
"""Rank 0's file in a checkpoint: step, scheduler state, elapsed time, batch geometry."""

_NAME = re.compile(r"step_(\d{8})")
_TMP_NAME = re.compile(r"\.tmp_(?:old_)?step_(\d{8})")  # a save cut short, or a replaced one


class CheckpointError(ValueError):
    """A checkpoint path given by the user is missing, incomplete or not a checkpoint."""


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint after ``step``: ``step_`` and 8 digits."""
    return f"step_{step:08d}"


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank}.pt"


def _no_dist() -> bool:
    """True without a process group: DCP then reads and writes as one process."""
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every call without a process group, even when asked for one process.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*uninitialized")
        yield


def is_complete(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a complete checkpoint folder (DCP metadata and trainer state)."""
    path = Path(path)
    return (path / ".metadata").is_file() and (path / TRAINER_STATE_FILE).is_file()


def find_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` as ``(step, path)``, oldest first.

    Only folders named exactly ``step_`` plus 8 digits count; temporary ``.tmp_step_*``
    folders and incomplete ones are skipped. A missing ``directory`` has none.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for entry in directory.iterdir():
        match = _NAME.fullmatch(entry.name)
        if match and entry.is_dir() and is_complete(entry):
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step in ``directory``, or None."""
    found = find_checkpoints(directory)
    return found[-1][1] if found else None


def remove_incomplete(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the ``.tmp_*step_*`` folders left by saves that did not finish; return them."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for entry in sorted(directory.iterdir()):
        if _TMP_NAME.fullmatch(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def rotate_checkpoints(
    directory: str | os.PathLike[str], keep: int, *, protect: Path | None = None
) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (``keep=0`` keeps all).

    ``protect`` (the checkpoint just written) is never deleted, even when newer ones from
    an earlier run are in the folder. Returns the deleted folders.
    """
    if keep <= 0:
        return []
    found = [path for _, path in find_checkpoints(directory)]
    removed = []
    for path in found[:-keep]:
        if protect is not None and path.resolve() == protect.resolve():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def require_checkpoint(path: str | os.PathLike[str], flag: str) -> Path:
    """Check that ``path`` (the value of ``flag``) is a complete checkpoint; return it.

    Raises `CheckpointError` with what to pass instead otherwise; the message starts with
    the path (argparse puts the flag in front of it).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory; pass a step_NNNNNNNN checkpoint")
    if is_complete(path) and not _TMP_NAME.fullmatch(path.name):
        return path
    inside = latest_checkpoint(path)
    if inside is not None:
        hint = f"it is a checkpoint folder; pass one of its checkpoints, e.g. {inside}" + (
            ", or --checkpoint-dir with --resume auto" if flag == "--resume" else ""
        )
    elif _TMP_NAME.fullmatch(path.name):
        hint = "it is a save that did not finish; use an earlier step_NNNNNNNN checkpoint"
    else:
        hint = (
            f"it has no complete checkpoint (.metadata and {TRAINER_STATE_FILE}); pass a "
            "step_NNNNNNNN directory written with --checkpoint-dir"
        )
    raise CheckpointError(f"{path}: not a complete checkpoint: {hint}")


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random number generator states (torch CPU, CUDA if used, Python)."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Set the generators from a `rng_state` result."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    *,
    rank: int,
    barrier: Callable[[], None],
    device: torch.device,
    keep: int = 0,
) -> Path:
    """Write the checkpoint of ``step`` under ``directory`` from every rank; return its path.

    A collective: every rank calls it. The model and optimizer go through DCP (each rank
    writes its part), rank 0 adds ``trainer_state`` and each rank its RNG states; then,
    after a barrier, rank 0 renames the temporary folder, removes leftovers of
    interrupted saves and keeps the newest ``keep`` checkpoints.
    """
    directory = Path(directory)
    final = directory / checkpoint_name(step)
    tmp = directory / f".tmp_{checkpoint_name(step)}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp, no_dist=_no_dist())
    torch.save(rng_state(device), tmp / _rng_file(rank))
    if rank == 0:
        torch.save({"step": step, **trainer_state}, tmp / TRAINER_STATE_FILE)
    barrier()
    if rank == 0:
        if final.exists():  # a later step of an earlier run in the same folder
            old = directory / f".tmp_old_{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        remove_incomplete(directory)
        rotate_checkpoints(directory, keep, protect=final)
    barrier()
    return final


def load_training_state(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    rank: int,
    device: torch.device,
) -> None:
    """Load model, optimizer and this rank's RNG states from checkpoint ``path``.

    A collective: every rank calls it, on the freshly built model and optimizer (any
    world size). RNG states are restored only when the checkpoint has a file for this
    rank (it may have been written at a smaller world size). The trainer state is read
    separately, with `read_trainer_state`.
    """
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path, no_dist=_no_dist())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    rng_path = path / _rng_file(rank)
    if rng_path.is_file():
        restore_rng_state(torch.load(rng_path, weights_only=True), device)


def read_trainer_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Rank 0's trainer state of checkpoint ``path`` (``step``, ``scheduler``, ...)."""
    return torch.load(Path(path) / TRAINER_STATE_FILE, weights_only=True)


def load_weights(path: str | os.PathLike[str], model: nn.Module) -> None:
    """Load only the model part of checkpoint ``path`` into ``model`` (a collective)."""
    model_sd = get_model_state_dict(model)
    state = {"model": model_sd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=Path(path), no_dist=_no_dist())
    set_model_state_dict(model, state["model"])
