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
  ``/dev/shm``;
* no user namespace of its own to make: the sandbox is a user namespace that refuses
  nested ones (``--disable-userns``, bubblewrap 0.8 and later), so a job cannot
  ``unshare -Urn`` its way to a network or mounts of its own choosing;
* a network of its own: a network namespace with nothing but loopback, so its torchrun
  rendezvous store, its ports and its abstract Unix sockets are its alone, and no other
  job's are reachable. A job whose user may use the host's network (``host_network`` in
  the users file, or ``--job-network host``) keeps it instead.

The data directory, the server's working directory, its users and token files and every
other job's folder are absent: a code folder that holds one of them shows it empty. ``bwrap``
runs as the job's account and needs unprivileged user namespaces; :func:`probe` tells
whether it works.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from dmuon_server.launching.identity import Account, drop_privileges
from dmuon_server.launching.job_process import private_tmp_unavailable
from dmuon_server.storage.datadir import StartupError

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


def _server_path() -> list[str]:
    """The server's ``sys.path`` without the folder it was started from: ``python -m``
    puts the working directory first, and that folder holds no code a job needs (the
    packages are installed) but may hold the server's own files."""
    cwd = os.path.realpath(os.getcwd())
    return [p for p in sys.path if p and os.path.realpath(p) != cwd]


def code_dirs(extra: Iterable[str]) -> list[str]:
    """Folders holding the code a job imports: the interpreter's installation and every
    existing folder on ``sys.path`` (but the server's working directory) and in ``extra``
    (the job's ``PYTHONPATH``), outermost first and without folders nested in others."""
    candidates = {sys.prefix, sys.base_prefix, sys.exec_prefix, *_server_path(), *extra}
    real = sorted({os.path.realpath(c) for c in candidates if c and os.path.isdir(c)})
    kept: list[str] = []
    for path in real:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return [p for p in kept if not p.startswith(("/usr/", "/etc/", "/opt/")) and p != "/"]


def _inside(path: str, folders: Iterable[str]) -> bool:
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in folders)


def _masks(hidden: Iterable[Path], shown: list[str], roots: list[str]) -> list[str]:
    """bwrap arguments that hide each of ``hidden`` lying inside a folder of ``shown``: an
    empty folder over a folder, an empty file over a file; then ``roots`` (folders the
    job must see) that a masked folder covered, bound again."""
    out: list[str] = []
    masked: list[str] = []
    for path in sorted({os.path.realpath(p) for p in hidden}):  # a parent before its children
        if not _inside(path, shown) or _inside(path, masked):
            continue
        if os.path.isdir(path):
            out += ["--tmpfs", path]
            masked.append(path)
        elif os.path.lexists(path):
            out += ["--ro-bind", "/dev/null", path]
    for root in roots:
        if _inside(root, masked) and root not in masked:
            out += ["--ro-bind", root, root]
    return out


@functools.cache
def _refuses_nested_userns() -> bool:
    """Whether this bwrap can refuse nested user namespaces (``--disable-userns``)."""
    bwrap = bwrap_path()
    if bwrap is None:
        return False
    out = subprocess.run([bwrap, "--help"], capture_output=True, text=True)
    return "--disable-userns" in out.stdout + out.stderr


def write_loopback_hosts(path: Path) -> Path:
    """Write at ``path`` the ``/etc/hosts`` of a job with a loopback-only network: the
    loopback names and this host's name on both address families. Without an IPv6 line
    every connection over ``::1`` costs a failed name lookup, and torch's c10d warns
    ("The hostname of the client socket cannot be retrieved") on each."""
    names = " ".join(dict.fromkeys(["localhost", socket.gethostname()]))
    path.write_text(f"127.0.0.1 {names}\n::1 {names} ip6-localhost ip6-loopback\n")
    path.chmod(0o644)
    return path


def wrap(
    argv: list[str],
    *,
    job_dir: Path,
    env: dict[str, str],
    read_only: Iterable[Path],
    gpus: bool,
    host_network: bool = False,
    hidden: Iterable[Path] = (),
    hosts_file: Path | None = None,
) -> list[str]:
    """``argv`` run inside the sandbox of a job (see the module docstring).

    ``read_only`` are the code, data and model roots; ``env`` is the job's environment
    (its ``PYTHONPATH`` entries are bound read-only too). ``host_network`` keeps the
    host's network instead of a loopback-only one; ``hidden`` are the server's own files
    and folders (data directory, users and token files, working directory), masked where a
    bound folder holds them. ``hosts_file`` (see :func:`write_loopback_hosts`) becomes the
    job's ``/etc/hosts`` when its network is its own.
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
        *(("--unshare-user", "--disable-userns") if _refuses_nested_userns() else ()),
        *(() if host_network else ("--unshare-net",)),
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
    shown = [*code_dirs(pythonpath), *(os.path.realpath(r) for r in read_only)]
    for d in shown:
        args += ["--ro-bind", d, d]
    system = [d for d in _SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    roots = [os.path.realpath(r) for r in read_only]
    args += _masks(hidden, [*system, *shown], roots)
    if hosts_file is not None and not host_network:
        args += ["--ro-bind", str(hosts_file), "/etc/hosts"]
    args += ["--bind", str(job_dir), str(job_dir), "--chdir", str(job_dir), "--", *argv]
    return args


def unsandboxed() -> str:
    """What a server without a sandbox says at start-up: what its jobs share."""
    why = private_tmp_unavailable()
    tmp = (
        "each job still gets a /tmp and /dev/shm of its own"
        if why is None
        else f"they also share the host's /tmp and /dev/shm ({why}), where what a job "
        "leaves outlives it (a file in /dev/shm keeps its memory taken after the job is "
        "killed)"
    )
    return (
        "every job shares the host's network, so a job can reach another job's torchrun "
        f"rendezvous store, ports and sockets (and, as the same account, its files); {tmp}; "
        "install bubblewrap (Debian package bubblewrap) and pass --sandbox bwrap to keep "
        "jobs apart"
    )


def choose(
    mode: str, launcher: str, account: Account | None, network: str
) -> tuple[Literal["bwrap", "none"], str]:
    """``(sandbox, what the server says once listening)`` for ``--sandbox mode``
    (``auto``, ``bwrap`` or ``none``), where jobs run as ``account``. Raises
    :class:`~dmuon_server.storage.datadir.StartupError` when bwrap was required and does not
    work."""
    if launcher != "local":
        return "none", "jobs run under Slurm, which keeps them apart"
    if mode == "none":
        return "none", f"WARNING: jobs run without a sandbox (--sandbox none): {unsandboxed()}"
    why = probe(account)
    if why is None:
        kept = (
            "the host's network (--job-network host)"
            if network == "host"
            else "a loopback-only network of their own (users with host_network keep the host's)"
        )
        nested = (
            "" if _refuses_nested_userns()
            else "; WARNING: this bubblewrap (before 0.8) cannot refuse nested user namespaces"
        )  # fmt: skip
        return "bwrap", f"jobs run in a bubblewrap sandbox ({bwrap_path()}), with {kept}{nested}"
    if mode == "bwrap":
        raise StartupError(f"--sandbox bwrap: {why}; install bubblewrap, or pass --sandbox none")
    return "none", f"WARNING: jobs run without a sandbox ({why}): {unsandboxed()}"


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
