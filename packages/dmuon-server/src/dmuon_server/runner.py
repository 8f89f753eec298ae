"""The process the server spawns for a job: torchrun, plus an exit report.

``python -m dmuon_server.runner --job-dir DIR -- <torchrun arguments>`` runs torchrun
(``torch.distributed.run.main``, exactly what the ``torchrun`` console script runs) in this
process and, however it ends, writes ``DIR/exit.json`` atomically::

    {"returncode": 3, "signal": null, "error": null, "finished_at": 1700000000.0,
     "first_failure": {"rank": 1, "local_rank": 1, "exitcode": 3, "signal": null,
                       "pid": 1234, "timestamp": 1700000000,
                       "error_type": "ValueError", "message": "...", "traceback": "...",
                       "log_dir": "DIR/torchrun-logs/<run>/attempt_0/1"},
     "failures": [...]}

``error_type``, ``message`` and ``traceback`` come from torchrun's error file: a recipe
whose entry point is decorated with
``torch.distributed.elastic.multiprocessing.errors.record`` writes its exception there,
and torchrun hands it over with the failure. Without an error file they are torchrun's
generic message (and ``error_type`` is null).

While torchrun runs, the runner also kills, at once, a rank that is stopped (SIGSTOP, a
debugger) while torchrun tells it to end because another rank failed
(:func:`dmuon_server.launching.procs.kill_stopped_ranks`); torchrun itself would wait 30 s before
its SIGKILL. The runner is the job's process on every node, so this holds under every
launcher (the local host, each node of a Slurm allocation).

Why a wrapper: the server must learn a job's exit status even when the job outlived the
server (a restarted server is not the job's parent and cannot ``wait()`` for it), and
torchrun knows which rank failed first only in memory (its ``ChildFailedError``). Running
torchrun in-process keeps both. This module imports torch; the server itself never does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from dmuon._startup import imports_kept_for_life
from dmuon_server.config import EXIT_FILE

#: Seconds between two looks for ranks stopped while told to end.
STOPPED_RANK_POLL_S = 0.5


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` so that readers see all of it or nothing."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _signal_name(signum: int) -> str | None:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return None


def split_error_message(message: Any) -> tuple[str | None, str, str | None]:
    """``(type, message, traceback)`` of a torchrun failure message.

    An error file makes it ``{"message": "ValueError: ...", "extraInfo": {"py_callstack":
    ...}}``; otherwise it is torchrun's own text.
    """
    if isinstance(message, dict):
        text = str(message.get("message", ""))
        extra = message.get("extraInfo")
        stack = extra.get("py_callstack") if isinstance(extra, dict) else None
        head, sep, rest = text.partition(": ")
        if sep and head.replace(".", "").replace("_", "").isalnum():
            return head, rest, stack
        return None, text, stack
    return None, str(message or ""), None


def _failure_dict(rank: int, failure: Any) -> dict[str, Any]:
    exitcode = int(failure.exitcode)
    error_file = str(getattr(failure, "error_file", "") or "")
    error_type, message, stack = split_error_message(getattr(failure, "message", ""))
    return {
        "rank": int(rank),
        "local_rank": int(getattr(failure, "local_rank", -1)),
        "exitcode": exitcode,
        "signal": _signal_name(-exitcode) if exitcode < 0 else None,
        "pid": int(getattr(failure, "pid", -1)),
        "timestamp": float(getattr(failure, "timestamp", 0) or 0),
        "error_type": error_type,
        "message": message,
        "traceback": stack,
        "log_dir": os.path.dirname(error_file) if os.path.isabs(error_file) else None,
    }


def first_failure(failures: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Pick the rank that failed first.

    torchrun ends the surviving ranks with SIGTERM once one fails, and its timestamps have
    one-second resolution, so ranks ended by SIGTERM are only considered when no other rank
    failed; among the rest the earliest wins, torchrun's own order breaking ties.
    """
    if not failures:
        return None
    candidates = [f for f in failures if f["exitcode"] != -signal.SIGTERM] or failures
    order = {id(f): i for i, f in enumerate(failures)}
    return min(candidates, key=lambda f: (f["timestamp"], order[id(f)]))


def _kill_stopped_ranks_until(done: threading.Event) -> None:
    """Until ``done``: SIGKILL this process's children (torchrun's ranks) that are stopped
    while told to end, each named on stderr (the job's log)."""
    import psutil

    from dmuon_server.launching.procs import kill_stopped_ranks

    me = psutil.Process()
    while not done.wait(STOPPED_RANK_POLL_S):
        for pid in kill_stopped_ranks(me):
            why = "it is stopped (SIGSTOP) with a SIGTERM pending it cannot act on"
            with contextlib.suppress(OSError):
                print(f"dmuon_server.runner: SIGKILL to rank pid {pid}: {why}", file=sys.stderr)
                sys.stderr.flush()


def run(job_dir: Path, torchrun_args: list[str]) -> int:
    """Run torchrun with ``torchrun_args``, write the exit report, return the exit code."""
    report: dict[str, Any] = {
        "returncode": None,
        "signal": None,
        "error": None,
        "first_failure": None,
        "failures": [],
        "started_at": time.time(),
    }
    rc = 1
    done = threading.Event()
    watchdog = threading.Thread(
        target=_kill_stopped_ranks_until, args=(done,), name="stopped-rank-watchdog", daemon=True
    )
    watchdog.start()
    try:
        with imports_kept_for_life():
            from torch.distributed.elastic.multiprocessing.api import SignalException
            from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
            from torch.distributed.run import main as torchrun_main

        try:
            torchrun_main(torchrun_args)
            rc = 0
        except ChildFailedError as e:
            failures = [_failure_dict(r, f) for r, f in e.failures.items()]
            first = first_failure(failures)
            report["failures"] = failures
            report["first_failure"] = first
            code = first["exitcode"] if first else 1
            rc = code if 0 < code < 256 else (128 - code if code < 0 else 1)
        except SignalException as e:
            signum = int(e.sigval)
            report["signal"] = _signal_name(signum)
            rc = 128 + signum
    except SystemExit as e:  # torchrun's argument parser
        rc = e.code if isinstance(e.code, int) else 2
        report["error"] = f"torchrun exited: {e.code}"
    except BaseException as e:
        report["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()
        traceback.print_exc()
        rc = 1
    finally:
        done.set()
    report["returncode"] = rc
    report["finished_at"] = time.time()
    try:
        write_json_atomic(job_dir / EXIT_FILE, report)
    except OSError as e:
        # A full disk, say: the exit status still tells the server how torchrun ended
        # (and the log may not take this line either).
        with contextlib.suppress(OSError):
            print(f"dmuon_server.runner: could not write {EXIT_FILE}: {e}", file=sys.stderr)
    return rc


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m dmuon_server.runner --job-dir DIR -- <torchrun args>``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m dmuon_server.runner",
        usage="%(prog)s --job-dir DIR [--ignore-sigterm] -- <torchrun args>",
        description="Run torchrun for a job of dmuon-server and write DIR/exit.json, however "
        "it ends (the server spawns this; it is not meant to be run by hand).",
    )
    parser.add_argument("--job-dir", type=Path, required=True)
    parser.add_argument(
        "--ignore-sigterm",
        action="store_true",
        help="let SIGTERM pass this process by (the ranks get their own); for launchers "
        "that signal every process of a job at once, such as Slurm's scancel",
    )
    if "--" not in argv:
        if {"-h", "--help"} & set(argv):
            parser.print_help()
            return 0
        parser.print_usage(sys.stderr)
        return 2
    split = argv.index("--")
    args = parser.parse_args(argv[:split])
    if args.ignore_sigterm:
        # A Python handler, not SIG_IGN: the ranks torchrun starts get the default action
        # back when they exec, and then install the recipe's own handler. torchrun must be
        # told not to handle SIGTERM itself (--signals-to-handle without it), or it would
        # forward a second SIGTERM, which the recipe takes as "stop without saving".
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    sys.stdout.flush()
    return run(args.job_dir, argv[split + 1 :])


if __name__ == "__main__":
    code = main()
    # The exit report is on disk and torchrun has shut its workers down; skip the
    # interpreter teardown (torch's atexit hooks and threads take up to a second or two).
    # A full disk must not turn the exit status into a traceback's.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):
            stream.flush()
    os._exit(code)
