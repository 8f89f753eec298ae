"""Starting an attempt's runner: its session, log, cgroup and account, and, for a root
server without the sandbox, a ``/tmp`` and ``/dev/shm`` of its own.

Without the sandbox a job would share the host's ``/tmp`` and ``/dev/shm``: what it left
there would outlive it, and a file in ``/dev/shm`` keeps its memory taken after the job is
killed (tmpfs pages are not freed with the job's cgroup). A root server therefore starts
each attempt in a mount namespace of its own (``unshare --mount``) with fresh tmpfs
mounts on both; the folders under ``/tmp`` the job needs (its own folder, its code, the
data and model roots, and those its environment names, such as a tracking store) are
bound back in. The namespace, and with it both tmpfs and their
pages, goes away with the attempt's last process; the pages are charged to the job's
memory cgroup while they exist. The mounts are made as root, then ``setpriv`` drops to
the job's account before the runner starts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from dmuon_server.launching import attempts
from dmuon_server.launching.cgroups import JobCgroup
from dmuon_server.launching.identity import Account, drop_privileges

#: What makes the private mounts, in the new mount namespace, before the runner runs:
#: the host's /tmp is reached through a bind on a staging tmpfs while the new /tmp is
#: mounted, the kept folders are bound back (recursively: a user's volume mounted on a job
#: folder comes along), then the staging goes and /dev/shm is new.
_MOUNTS = """set -e
given=$(umask)
umask 022
n=$1; shift
mount -t tmpfs -o nosuid,nodev,mode=700 dmuon-stage /dev/shm
mkdir /dev/shm/host
mount --rbind /tmp /dev/shm/host
mount -t tmpfs -o nosuid,nodev,mode=1777 dmuon-tmp /tmp
while [ "$n" -gt 0 ]; do
  mkdir -p "/tmp/$1"
  mount --rbind "/dev/shm/host/$1" "/tmp/$1"
  n=$((n - 1)); shift
done
umount -R /dev/shm/host
umount /dev/shm
mount -t tmpfs -o nosuid,nodev,mode=1777 dmuon-shm /dev/shm
umask "$given"
exec "$@"
"""
_TOOLS = ("unshare", "setpriv", "mount", "umount")


def env_folders(env: dict[str, str]) -> list[Path]:
    """The existing folders the job's environment names: a path, each entry of a
    ``:``-separated list, or a ``file:`` / ``sqlite:`` URI (a tracking store the operator
    points jobs at); for a file, its folder."""
    found: list[Path] = []
    for value in env.values():
        for part in value.split(os.pathsep):
            path = re.sub(r"^(?:file|sqlite):/*", "/", part) if ":" in part[:8] else part
            if not path.startswith("/"):
                continue
            if os.path.isdir(path):
                found.append(Path(path))
            elif os.path.isfile(path) or os.path.isdir(os.path.dirname(path)):
                found.append(Path(os.path.dirname(path)))
    return found


def private_tmp_unavailable() -> str | None:
    """Why this server cannot give jobs a private /tmp and /dev/shm, or None."""
    if os.geteuid() != 0:
        return "the server does not run as root"
    missing = [tool for tool in _TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not found (install util-linux)"
    return None


def with_private_tmp(argv: list[str], account: Account | None, keep: Iterable[Path]) -> list[str]:
    """``argv`` started in a mount namespace with its own /tmp and /dev/shm, the folders
    ``keep`` that lie under /tmp bound back in, as ``account`` (None: as the server)."""
    candidates = sorted(
        {
            os.path.relpath(real, "/tmp")
            for real in (os.path.realpath(p) for p in keep)
            if real.startswith("/tmp/") and os.path.isdir(real)
        },
        key=len,
    )
    # A folder inside another comes with it: a bind of its own would make it a mount
    # point, which the job could then not remove (a checkpoint it resumed from, say).
    under_tmp: list[str] = []
    for path in candidates:
        if not any(path == kept or path.startswith(kept + "/") for kept in under_tmp):
            under_tmp.append(path)
    drop = []
    if account is not None:
        drop = [shutil.which("setpriv") or "setpriv", f"--reuid={account.uid}",
                f"--regid={account.gid}", "--clear-groups", "--"]  # fmt: skip
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _MOUNTS,
            "sh", str(len(under_tmp)), *under_tmp, *drop, *argv]  # fmt: skip


def start_process(
    argv: list[str],
    job_dir: Path,
    start: attempts.AttemptStart,
    cgroup: JobCgroup | None,
    private_tmp: Iterable[Path] | None = None,
) -> subprocess.Popen:
    """Start an attempt's runner in a session of its own, as the job's account, with its
    output appended to the job's log; it enters ``cgroup`` before it runs anything. With
    ``private_tmp`` (the folders the job needs), it gets a /tmp and /dev/shm of its own
    (see the module docstring) and drops to its account after making them."""
    fds, enroll = cgroup.enroller() if cgroup is not None else ([], None)
    privileges = drop_privileges(start.account)
    if private_tmp is not None:
        argv = with_private_tmp(argv, start.account, private_tmp)
        privileges = {"umask": privileges["umask"]} if "umask" in privileges else {}
    try:
        with os.fdopen(attempts.open_job_log(job_dir, start.account), "ab") as logf:
            return subprocess.Popen(
                argv,
                cwd=job_dir,
                env=start.env,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
                preexec_fn=enroll,
                **privileges,
            )
    finally:
        for fd in fds:
            os.close(fd)
