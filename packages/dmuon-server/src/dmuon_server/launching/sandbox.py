"""Running a local job in a bubblewrap sandbox (Debian's ``bubblewrap``, ``bwrap``).

With ``--sandbox bwrap`` (or ``auto`` where ``bwrap`` works) each local job's command is
wrapped so that the job sees, besides the operating system's read-only folders (``/usr``,
``/etc``, ...):

* its own folder, writable (and its working directory and ``HOME``);
* its code read-only: the Python installation and every folder on the server's
  ``sys.path`` and the job's ``PYTHONPATH``, and the code roots;
* the data and model roots, read-only;
* a private ``/proc`` (its own processes only: not the server's, not other jobs'), a fresh
  ``/dev`` (plus the GPU device nodes when the server has GPUs), an empty ``/tmp`` and
  ``/dev/shm``.

The data directory, the server's files and every other job's folder are absent. The job
keeps the host's network (torchrun's rendezvous and NCCL use it). ``bwrap`` runs as the
job's account and needs unprivileged user namespaces; :func:`probe` tells whether it works.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from dmuon_server.launching.identity import Account, drop_privileges

#: Read-only system folders every job sees (a link, as ``/bin`` is on merged-/usr systems,
#: stays a link).
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
#: Read-only folders the CUDA stack reads to find devices and their topology.
_GPU_DIRS = ("/sys",)
_PROBE_TIMEOUT_S = 20.0


def bwrap_path() -> str | None:
    """The ``bwrap`` program, or None when bubblewrap is not installed."""
    return shutil.which("bwrap")


def _system_binds() -> list[str]:
    out: list[str] = []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            out += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            out += ["--ro-bind", d, d]
    return out


def _code_dirs(extra: Iterable[str]) -> list[str]:
    """Folders holding the code a job imports: the interpreter's installation and every
    existing folder on ``sys.path`` and in ``extra`` (the job's ``PYTHONPATH``), outermost
    first and without folders nested in others."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path, *extra}
    real = sorted({os.path.realpath(c) for c in candidates if c and os.path.isdir(c)})
    kept: list[str] = []
    for path in real:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return [p for p in kept if not p.startswith(("/usr/", "/etc/", "/opt/")) and p != "/"]


def wrap(
    argv: list[str],
    *,
    job_dir: Path,
    env: dict[str, str],
    read_only: Iterable[Path],
    gpus: bool,
) -> list[str]:
    """``argv`` run inside the sandbox of a job (see the module docstring).

    ``read_only`` are the code, data and model roots; ``env`` is the job's environment
    (its ``PYTHONPATH`` entries are bound read-only too).
    """
    bwrap = bwrap_path()
    if bwrap is None:
        raise FileNotFoundError("bwrap is not installed (Debian package bubblewrap)")
    args = [
        bwrap,
        # No --die-with-parent: a job outlives the server (a restarted server re-attaches).
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        *_system_binds(),
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/dev/shm",
        "--tmpfs",
        "/tmp",
    ]
    if gpus:
        for d in _GPU_DIRS:
            if os.path.isdir(d):
                args += ["--ro-bind", d, d]
        for node in sorted(glob.glob("/dev/nvidia*")):
            args += ["--dev-bind", node, node]
    pythonpath = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for d in _code_dirs(pythonpath):
        args += ["--ro-bind", d, d]
    for root in read_only:
        args += ["--ro-bind", str(root), str(root)]
    args += ["--bind", str(job_dir), str(job_dir), "--chdir", str(job_dir), "--", *argv]
    return args


def probe(account: Account | None) -> str | None:
    """Why the sandbox cannot run a job as ``account`` here, or None when it can.

    Runs ``true`` in a sandbox like a job's, as ``account``."""
    if bwrap_path() is None:
        return "bwrap is not installed (Debian package bubblewrap)"
    argv = wrap(["true"], job_dir=Path(tempfile.gettempdir()), env={}, read_only=(), gpus=False)
    try:
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            **drop_privileges(account),
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not run: {e}"
    if out.returncode != 0:
        return f"bwrap failed ({out.stderr.strip() or f'exit status {out.returncode}'})"
    return None
