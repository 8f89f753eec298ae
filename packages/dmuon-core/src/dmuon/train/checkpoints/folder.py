"""Checkpoints of the recipe: a folder of ``step_NNNNNNNN`` DCP directories.

Layout of ``--checkpoint-dir DIR``:

* ``DIR/step_{step:08d}/`` is one complete checkpoint: a ``torch.distributed.checkpoint``
  directory (its ``.metadata`` file and one data file per rank) holding the
  ``Stateful`` objects ``{"model": ModelState, "optim": OptimizerState}`` (saved from all
  ranks at once), plus ``trainer_state.pt`` (``{"train": TrainState, "scheduler": ...}``,
  written by rank 0), ``rng_rank{r}.pt`` (rank ``r``'s `RNGState`) and ``hf/`` (what an
  HF export needs besides the weights: ``config.json``, the tokenizer's files and, for a
  preset, ``keys.json`` mapping its names to HF's; see `dmuon.checkpoint._hf_export`).
  The names come from `dmuon_recipe_contract`.
* A checkpoint is written as ``DIR/.tmp_step_{step:08d}/`` and renamed by rank 0 after
  every rank has finished writing (a barrier). A process killed during a save therefore
  leaves a ``.tmp_`` folder, which is never a checkpoint and is removed by the next run;
  the previous checkpoint stays the latest.
* Once every rank's files are written, rank 0 flushes them to disk and writes the
  folder's manifest last (`dmuon.checkpoint.write_manifest`: every file's size and
  SHA-256); only then is the folder renamed into place. A folder without a manifest is
  not complete.
* A save that cannot be written (a full disk, ENOSPC) is agreed on by every rank and raised
  as `CheckpointWriteError`, naming the folder, the space the checkpoint needs and the
  space left; the temporary folder is removed and the earlier checkpoints are untouched.
* The latest checkpoint is the complete ``step_*`` folder with the highest step whose files
  match its manifest; `latest_checkpoint` skips a damaged one (a file missing, truncated or
  altered) and reports it.

The data position needs no state of its own: the sampler is indexed by the step
(`dmuon.train.data.GlobalBatchSampler.rank_batch`), so a run resumed after step ``k``
draws the batches of steps ``k + 1, k + 2, ...`` exactly as an uninterrupted run does.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dmuon_recipe_contract as contract
import torch
import torch.distributed as dist

from dmuon.checkpoint import _manifest as manifest

if TYPE_CHECKING:
    from torch.distributed.checkpoint.stateful import Stateful

__all__ = [
    "TRAINER_STATE_FILE",
    "CheckpointError",
    "CheckpointWriteError",
    "checkpoint_name",
    "find_checkpoints",
    "is_complete",
    "latest_checkpoint",
    "load_checkpoint",
    "read_trainer_state",
    "remove_incomplete",
    "require_checkpoint",
    "rotate_checkpoints",
    "save_checkpoint",
]

TRAINER_STATE_FILE = contract.TRAINER_STATE_FILE
"""Rank 0's file in a checkpoint: the train state and the LR scheduler."""

_NAME = contract.CHECKPOINT_NAME_PATTERN
_TMP_NAME = re.compile(
    re.escape(contract.TEMPORARY_PREFIX) + r"(?:old_)?" + contract.CHECKPOINT_NAME_PATTERN.pattern
)  # a save cut short, or a replaced one


class CheckpointError(ValueError):
    """A checkpoint path given by the user is missing, incomplete or not a checkpoint."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, say); nothing earlier was lost."""


checkpoint_name = contract.checkpoint_name


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
    """Whether ``path`` is a complete checkpoint folder: DCP metadata, trainer state, and
    the manifest written last (whether the files still match it is `verify`'s question)."""
    return contract.is_complete_checkpoint(path)


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


def latest_checkpoint(
    directory: str | os.PathLike[str],
    on_damaged: Callable[[Path, list[str]], None] | None = None,
) -> Path | None:
    """The newest complete checkpoint in ``directory`` whose files match its manifest.

    A damaged one (a file missing, truncated or changed since it was written) is skipped
    and passed to ``on_damaged(path, problems)``; None when no checkpoint verifies.
    """
    for _, path in reversed(find_checkpoints(directory)):
        problems = manifest.verify_checkpoint(path)
        if not problems:
            return path
        if on_damaged is not None:
            on_damaged(path, problems)
    return None


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
        problems = manifest.verify_checkpoint(path)
        if problems:
            raise CheckpointError(
                f"{path}: the checkpoint is damaged: " + "; ".join(problems) + ". Pass an "
                "earlier checkpoint, or --resume auto with --checkpoint-dir to take the "
                "newest one that verifies"
            )
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
            f"it has no complete checkpoint (.metadata, {TRAINER_STATE_FILE} and "
            f"{manifest.MANIFEST}); pass a step_NNNNNNNN directory written with --checkpoint-dir"
        )
    raise CheckpointError(f"{path}: not a complete checkpoint: {hint}")


def _bytes_of(states: Mapping[str, Stateful]) -> int:
    """Bytes of the tensors this rank holds in ``states`` (a DTensor counts its shard)."""
    total = 0

    def count(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
        elif isinstance(value, Mapping):
            for item in value.values():
                count(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                count(item)

    for state in states.values():
        count(state.state_dict())
    return total


def _first_cause(error: BaseException) -> OSError:
    """The OSError behind ``error`` (DCP wraps each rank's exception), or one describing it."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        for wrapped, _ in error.failures.values():
            return _first_cause(wrapped)
    if isinstance(error, OSError):
        return error
    return OSError(f"{type(error).__name__}: {error}")


def _any_rank(flag: bool, distributed: bool) -> bool:
    """Whether ``flag`` holds on any rank (one all-reduce when distributed)."""
    if not distributed:
        return flag
    value = torch.tensor([float(flag)], dtype=torch.float64)
    # not audited: the recipe's agreement on a checkpoint's fate, not dedicated traffic
    dist.all_reduce(value)
    return bool(value.item())


def _bytes_needed(
    directory: Path, states: Mapping[str, Stateful], rank: int, distributed: bool
) -> int:
    """About the bytes a checkpoint of ``states`` takes (a collective): the tensors of every
    rank, or the newest complete checkpoint's files if larger (they hold the ``hf/`` copy
    and the serialization's overhead too)."""
    newest = 0
    if rank == 0:
        found = find_checkpoints(directory)
        if found:
            newest = sum(p.stat().st_size for p in found[-1][1].rglob("*") if p.is_file())
    value = torch.tensor([float(_bytes_of(states)), float(newest)], dtype=torch.float64)
    if distributed:
        # not audited: the recipe's agreement on a checkpoint's size, not dedicated traffic
        dist.all_reduce(value)
    return int(value.max().item())


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    *,
    distributed: Mapping[str, Stateful],
    rank_zero: Mapping[str, Stateful],
    rng: Stateful,
    rank: int,
    barrier: Callable[[], None],
    keep: int = 0,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write the checkpoint of ``step`` under ``directory`` from every rank; return its path.

    A collective: every rank calls it. ``distributed`` goes through DCP (each rank writes
    its part), ``rank_zero`` into rank 0's ``trainer_state.pt``, ``rng`` into this rank's
    ``rng_rank{r}.pt``; ``write_extra(folder)`` runs on rank 0 (the ``hf/`` files). Then,
    after a barrier, rank 0 flushes the folder to disk, writes its manifest, renames it
    into place, removes leftovers of interrupted saves and keeps the newest ``keep``
    checkpoints.

    Raises:
        CheckpointWriteError: on every rank alike, when any rank could not write its part
            (ENOSPC, a read-only folder): the folder, the space the checkpoint needs and
            the space left are named, the temporary folder is gone and the earlier
            checkpoints are as they were.
    """
    directory = Path(directory)
    final = directory / checkpoint_name(step)
    tmp = directory / f"{contract.TEMPORARY_PREFIX}{checkpoint_name(step)}"
    multi = not _no_dist()
    error: OSError | None = None
    try:
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
    except OSError as e:
        error = e
    barrier()
    # DCP (about 1 s to import) is loaded by the first checkpoint, not by every run.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet_single_process():
            dcp.save(dict(distributed), checkpoint_id=tmp, no_dist=_no_dist())
    except (Exception, CheckpointException) as e:  # DCP's is raised on every rank alike
        error = error or _first_cause(e)
    if error is None:
        try:
            torch.save(rng.state_dict(), tmp / _rng_file(rank))
            if rank == 0:
                if write_extra is not None:
                    write_extra(tmp)
                torch.save(
                    {k: s.state_dict() for k, s in rank_zero.items()}, tmp / TRAINER_STATE_FILE
                )
        except OSError as e:
            error = e
    barrier()
    if rank == 0 and error is None:
        try:
            manifest.write_manifest(tmp)
        except OSError as e:
            error = e
    if _any_rank(error is not None, multi):
        needed = _bytes_needed(directory, distributed, rank, multi)
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        barrier()
        raise _write_error(step, directory, error, needed)
    if rank == 0:
        _put_in_place(tmp, final, keep)
    barrier()
    return final


def _write_error(
    step: int, directory: Path, error: OSError | None, needed: int
) -> CheckpointWriteError:
    """The error every rank raises for a checkpoint some rank could not write."""
    free = shutil.disk_usage(directory).free if directory.is_dir() else 0
    # A full disk often surfaces as a short write inside torch.save, not as ENOSPC.
    if error is None or error.errno == errno.ENOSPC or free < needed:
        code, cause = errno.ENOSPC, os.strerror(errno.ENOSPC)
    else:
        code, cause = error.errno or errno.EIO, str(error.strerror or error)
    return CheckpointWriteError(
        code,
        f"the checkpoint of step {step} could not be written to {directory} ({cause}): it "
        f"needs about {needed / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free there. "
        "Free space (or pass a --checkpoint-dir with room, or lower --keep-checkpoints); "
        "the earlier checkpoints are intact",
    )


def _put_in_place(tmp: Path, final: Path, keep: int) -> None:
    """Rename a written checkpoint into place (replacing one of an earlier run), durably,
    then clear interrupted saves and keep the newest ``keep``."""
    directory = final.parent
    # An existing final folder: a later step of an earlier run in the same folder.
    manifest.replace_folder(tmp, final, directory / f"{contract.TEMPORARY_PREFIX}old_{final.name}")
    manifest.fsync_dir(directory)  # the rename itself is durable
    remove_incomplete(directory)
    rotate_checkpoints(directory, keep, protect=final)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    distributed: Mapping[str, Stateful],
    rank_zero: Mapping[str, Stateful] | None = None,
    rng: Stateful | None = None,
    rank: int = 0,
) -> None:
    """Load checkpoint ``path`` into the given ``Stateful`` objects (a collective).

    Every rank calls it, on freshly built objects (any world size). Pass only
    ``{"model": ...}`` as ``distributed`` to take the weights alone. RNG states are
    restored only when the checkpoint has a file for this rank (it may have been written
    at a smaller world size).
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    with _quiet_single_process():
        dcp.load(dict(distributed), checkpoint_id=path, no_dist=_no_dist())
    if rank_zero:
        blob = read_trainer_state(path)
        for key, state in rank_zero.items():
            state.load_state_dict(blob[key])
    rng_path = path / _rng_file(rank)
    if rng is not None and rng_path.is_file():
        rng.load_state_dict(torch.load(rng_path, weights_only=True))


def read_trainer_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Rank 0's file of checkpoint ``path``: ``{"train": {"step": ...}, "scheduler": ...}``."""
    return torch.load(Path(path) / TRAINER_STATE_FILE, weights_only=True)
