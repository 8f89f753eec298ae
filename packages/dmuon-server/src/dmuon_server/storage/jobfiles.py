"""The files in a job's working folder, and what the server reads from them.

``<job-dir>/``: ``spec.json`` (the submitted spec), ``job.log`` (torchrun and every rank,
teed, all attempts), ``metrics.jsonl`` (the recipe's metrics file of the first attempt;
``metrics.attempt-N.jsonl`` for attempt N >= 2), ``exit.json`` (the runner's exit report of
the latest attempt, see :mod:`dmuon_server.runner`), ``torchrun-logs/`` (one folder per
rank), ``checkpoints/`` (the recipe's ``step_XXXXXXXX`` checkpoint folders) and ``init/``
(the checkpoint named by ``init_from``, linked in at submission) and ``export/`` (the
Hugging Face directory of a job with ``train.export_hf``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract

from dmuon_server.config import EXIT_FILE
from dmuon_server.storage.accounts import Account, chown_to
from dmuon_server.storage.safefiles import open_in, open_path_in

METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
#: Where a job with ``train.export_hf`` writes its Hugging Face model directory.
EXPORT_DIR = "export"
#: The recipe's ``--tracking-dir`` in a job's folder (TensorBoard events, a local MLflow
#: store unless the server's environment names one, W&B run folders).
TRACKING_DIR = "tracking"
INIT_DIR = "init"
#: A complete checkpoint folder, as the recipe names it (temporary ones start with a dot).
_CHECKPOINT_NAME = re.compile(f"^{contract.CHECKPOINT_NAME_PATTERN.pattern}$")
LOG_FILE = "job.log"
SPEC_FILE = "spec.json"
TORCHRUN_LOG_DIR = "torchrun-logs"
#: Longest exception message a failure's ``reason`` quotes in full.
_REASON_MESSAGE_CHARS = 300
#: The runner's report is a few KiB; a larger file is not one.
_EXIT_REPORT_MAX_BYTES = 1 << 20


def metrics_file(attempt: int) -> str:
    """Name of the metrics file of attempt ``attempt`` (1-based) in the job folder.

    Each attempt writes a file of its own, so a relaunched recipe never rewrites a file
    the server is reading.
    """
    return METRICS_FILE if attempt <= 1 else f"metrics.attempt-{attempt}.jsonl"


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint of ``step`` (``step_00000005``)."""
    return contract.checkpoint_name(step)


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint folder."""

    step: int
    path: Path
    bytes: int
    mtime: float


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue  # pruned while we looked
    return total


def list_checkpoints(folder: Path, *, sizes: bool = True) -> list[CheckpointInfo]:
    """The complete checkpoints in ``folder`` (``step_<8 digits>`` folders), oldest first.

    Temporary folders (``.tmp_step_...``) and anything else are not checkpoints. With
    ``sizes=False`` the ``bytes`` are 0 (no walk through the files).
    """
    found: list[CheckpointInfo] = []
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        m = _CHECKPOINT_NAME.match(entry.name)
        if m is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            mtime = entry.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        path = Path(entry.path)
        size = _tree_bytes(path) if sizes else 0
        found.append(CheckpointInfo(int(m.group(1)), path, size, mtime))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(folder: Path, *, recipe: bool = True) -> CheckpointInfo | None:
    """The newest checkpoint in ``folder`` that the job would resume from, or None.

    A script job's checkpoints are its own: the newest ``step_`` folder. A recipe job's
    are read as the recipe's ``--resume auto`` reads them (`dmuon_recipe_contract`): a
    folder without its DCP metadata, trainer state and manifest is not complete, and one
    whose files are not all there with the sizes its manifest lists is damaged; both are
    passed over for the one before. (The recipe also compares checksums when it loads;
    reading every file here would cost a full read of the checkpoint each time a job is
    looked at.)
    """
    for info in reversed(list_checkpoints(folder, sizes=False)):
        if not recipe or (
            contract.is_complete_checkpoint(info.path)
            and not contract.checkpoint_problems(info.path, checksums=False)
        ):
            return info
    return None


def trained_to_the_end(job_dir: Path, steps: int, *, recipe: bool = True) -> bool:
    """Whether the job saved the checkpoint of its last step (``steps``): a run that did
    has nothing left to train, whatever stopped its processes afterwards (a cancel that
    came during the final evaluation, say)."""
    latest = latest_checkpoint(job_dir / CHECKPOINT_DIR, recipe=recipe)
    return latest is not None and latest.step >= steps


def link_tree(source: Path, target: Path, owner: Account | None = None) -> None:
    """Copy the folder ``source`` (another job's checkpoint) to ``target`` for a job running
    as ``owner``, so that the copy outlives ``source``.

    Files ``owner`` already owns are hard-linked (no space taken; plain copies across file
    systems); others are copied and given to ``owner``. Only folders and regular files are
    taken: a link or FIFO the source job left is skipped, never followed.
    """
    target.mkdir(parents=True, mode=0o700)
    chown_to(target, owner)
    owner_uid = owner.uid if owner is not None else os.geteuid()
    for entry in os.scandir(source):
        st = entry.stat(follow_symlinks=False)
        dst = target / entry.name
        if stat.S_ISDIR(st.st_mode):
            link_tree(Path(entry.path), dst, owner)
        elif stat.S_ISREG(st.st_mode):
            _link_or_copy(Path(entry.path), dst, owner, linkable=st.st_uid == owner_uid)


def _link_or_copy(src: Path, dst: Path, owner: Account | None, *, linkable: bool) -> None:
    if linkable:
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            pass
        else:
            if stat.S_ISREG(os.lstat(dst).st_mode):
                return
            dst.unlink()  # replaced by a link between the look and the link: skip it
            return
    fd = open_in(src.parent, src.name)
    with os.fdopen(fd, "rb") as fin:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(out, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
            chown_to(fout.fileno(), owner)


def tail_lines(
    path: Path, n: int, max_bytes: int = 1 << 20, *, root: Path
) -> tuple[list[str], bool]:
    """Return the last ``n`` lines of a text file below the job folder ``root`` (reading at
    most ``max_bytes``; no link below ``root`` is followed, see
    :mod:`dmuon_server.storage.safefiles`).

    The second value tells whether the file has more lines than returned.
    """
    try:
        with os.fdopen(open_path_in(root, path), "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read()
    except OSError:  # missing, or a link or FIFO the job put there
        return [], False
    lines = data.decode("utf-8", "replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first line is probably cut
    truncated = start > 0 or len(lines) > n
    return lines[-n:] if n else [], truncated


def read_exit_report(job_dir: Path) -> dict[str, Any] | None:
    """The runner's exit report, or None when it wrote none (yet)."""
    try:
        with os.fdopen(open_in(job_dir, EXIT_FILE), "rb") as f:
            data = json.loads(f.read(_EXIT_REPORT_MAX_BYTES))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9, ``signal 99`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _rank_log_tail(job_dir: Path, failure: dict[str, Any], n: int) -> tuple[Path, list[str]]:
    """The last lines a failed rank wrote (its stderr, else its stdout)."""
    rank_dir: Path | None = None
    if failure.get("log_dir"):
        rank_dir = Path(failure["log_dir"])
    else:
        local = failure.get("local_rank", failure.get("rank"))
        candidates = sorted(
            (job_dir / TORCHRUN_LOG_DIR).glob(f"*/attempt_*/{local}"),
            key=lambda p: p.stat().st_mtime,
        )
        rank_dir = candidates[-1] if candidates else None
    if rank_dir is None:
        lines, _ = tail_lines(job_dir / LOG_FILE, n, root=job_dir)
        return job_dir / LOG_FILE, lines
    for name in ("stderr.log", "stdout.log"):
        lines, _ = tail_lines(rank_dir / name, n, root=job_dir)
        if any(line.strip() for line in lines):
            return rank_dir / name, lines
    return rank_dir / "stderr.log", []


def _relative(job_dir: Path, path: Path) -> str:
    """``path`` relative to the job's folder (never an absolute server path)."""
    try:
        return path.relative_to(job_dir).as_posix()
    except ValueError:
        return path.name


def _quote(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else ""
    if len(first) > _REASON_MESSAGE_CHARS:
        first = first[: _REASON_MESSAGE_CHARS - 3] + "..."
    return first


#: What a failure's reason adds when the data directory's disk was full.
DISK_FULL_TEXT = (
    "the data directory's disk is full: free space there (delete finished jobs or their "
    "checkpoints), then resume the job"
)


def describe_failure(
    job_dir: Path,
    report: dict[str, Any] | None,
    launcher_rc: int | None,
    n: int,
    *,
    disk_full: bool = False,
) -> dict[str, Any]:
    """Why a job failed, from its exit report (or the launcher's exit status without one).

    Returns the ``failure`` fields of the API (``rank``, ``exit_code``, ``signal``,
    ``error_type``, ``message``, ``log_file`` relative to the job folder, ``log_tail``)
    plus ``reason``, the one-line summary for the job's history. ``disk_full`` (the data
    directory's disk had no room left when the attempt ended) is named first: the runner
    may have been unable to write its report.
    """
    failure = _describe_failure(job_dir, report, launcher_rc, n)
    if disk_full and failure["exit_code"] != contract.EXIT_CHECKPOINT_WRITE:
        failure["reason"] = f"{DISK_FULL_TEXT} ({failure['reason']})"
        if report is None:
            failure["message"] = f"{DISK_FULL_TEXT}; {failure['message']}"
    return failure


def _describe_failure(
    job_dir: Path, report: dict[str, Any] | None, launcher_rc: int | None, n: int
) -> dict[str, Any]:
    if report is None:
        if launcher_rc is not None and launcher_rc < 0:
            why = f"the job's launcher was killed by {signal_name(-launcher_rc)}"
        elif launcher_rc is not None:
            why = f"the job's launcher exited with code {launcher_rc} without an exit report"
        else:
            why = "the job's processes vanished while the server was down (no exit report)"
        lines, _ = tail_lines(job_dir / LOG_FILE, n, root=job_dir)
        sig = signal_name(-launcher_rc) if launcher_rc is not None and launcher_rc < 0 else None
        return {
            "reason": why,
            "rank": None,
            "exit_code": launcher_rc,
            "signal": sig,
            "error_type": None,
            "message": why,
            "log_file": LOG_FILE,
            "log_tail": lines,
        }
    first = report.get("first_failure")
    if first:
        rank = first.get("rank")
        code = first.get("exitcode")
        sig = first.get("signal")
        error_type = first.get("error_type")
        message = first.get("message") or None
        if code == contract.EXIT_CHECKPOINT_WRITE:
            reason = (
                f"rank {rank} could not write a checkpoint (exit code {code}: the disk is "
                f"full, or the folder cannot be written): {_quote(message or '') or 'see its log'}"
                "; not retried: free space, then resume the job"
            )
        elif error_type:
            reason = f"rank {rank} failed (exit code {code}): {error_type}: {_quote(message or '')}"
        elif sig:
            reason = f"rank {rank} killed by {sig}"
        else:
            reason = f"rank {rank} exited with code {code}"
        log_path, lines = _rank_log_tail(job_dir, first, n)
        return {
            "reason": reason,
            "rank": rank,
            "exit_code": code,
            "signal": sig,
            "error_type": error_type,
            "message": message,
            "log_file": _relative(job_dir, log_path),
            "log_tail": lines,
        }
    rc = report.get("returncode")
    sig = report.get("signal")
    err = report.get("error")
    if sig:
        why = f"torchrun received {sig}"
    elif err:
        why = f"torchrun failed: {err}"
    else:
        why = f"torchrun exited with code {rc}"
    lines, _ = tail_lines(job_dir / LOG_FILE, n, root=job_dir)
    return {
        "reason": why,
        "rank": None,
        "exit_code": rc,
        "signal": sig,
        "error_type": None,
        "message": err,
        "log_file": LOG_FILE,
        "log_tail": lines,
    }


#: Exit codes of the recipe (its contract's) that say a rerun would fail the same way:
#: invalid flags or inputs, a diverged run, a checkpoint that could not be written (a full
#: disk stays full until someone frees space).
NOT_RETRIED_EXIT_CODES = frozenset(
    {contract.EXIT_USAGE, contract.EXIT_DIVERGED, contract.EXIT_CHECKPOINT_WRITE}
)
#: Exception types the recipe records for the same cases.
NOT_RETRIED_ERROR_TYPES = frozenset({"UsageError", "TrainingDiverged", "CheckpointWriteError"})


def restartable(report: dict[str, Any] | None, launcher_rc: int | None) -> bool:
    """Whether a failed attempt is worth relaunching (``max_restarts``).

    Retried: a rank killed by a signal (SIGKILL, which is also how the kernel's
    out-of-memory killer ends a process, SIGSEGV, SIGBUS, ...) or exiting with any other
    code (an uncaught exception, e.g. a rank that lost its peers), and a launcher killed by
    a signal. Not retried: the recipe's usage/input errors (exit code 2, ``UsageError``),
    divergence (exit code 3, ``TrainingDiverged``) and a checkpoint that could not be
    written (exit code 4, ``CheckpointWriteError``), which a rerun repeats; a torchrun
    that could not start (``error`` in the report) or was itself stopped by a signal.
    """
    if report is None:
        return launcher_rc is not None and launcher_rc < 0
    if report.get("returncode") == 0 or report.get("error") or report.get("signal"):
        return False
    failures = report.get("failures") or []
    if not failures:
        return False
    for f in failures:
        if f.get("error_type") in NOT_RETRIED_ERROR_TYPES:
            return False
        if f.get("exitcode") in NOT_RETRIED_EXIT_CODES:
            return False
    return True
