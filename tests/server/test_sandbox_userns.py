"""Inside the sandbox a job cannot make a user namespace of its own (``unshare -Urn``
would give it a network and mounts of its choosing), while everything a job does still
runs.

Oracle: the real ``bwrap`` command the server builds (`sandbox.wrap`), run as a normal
account the way the server runs a job, against the same command outside the sandbox.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from accounts import folder_of, normal_account

from dmuon_server.launching import sandbox

UNSHARE = shutil.which("unshare")


@pytest.fixture
def account_dir() -> Iterator[tuple[tuple[int, int], Path]]:
    account = normal_account()
    if account is None or UNSHARE is None:
        pytest.skip("needs root (to run as a normal account) and util-linux's unshare")
    why = sandbox.probe(None)
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the sandbox tests must run in CI: {why}")
        pytest.skip(why)
    with folder_of(account, "dmuon-userns-") as folder:
        yield account, folder


def _run(argv: list[str], account: tuple[int, int], folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=folder, capture_output=True, text=True, timeout=60,
        user=account[0], group=account[1], extra_groups=[],
    )  # fmt: skip


def test_a_sandboxed_job_cannot_unshare_a_user_namespace(
    account_dir: tuple[tuple[int, int], Path],
) -> None:
    account, folder = account_dir
    nested = [UNSHARE, "-Urn", "true"]
    outside = _run(nested, account, folder)
    if outside.returncode != 0:
        pytest.skip(f"this machine refuses user namespaces anyway: {outside.stderr.strip()}")
    inside = _run(
        sandbox.wrap(nested, job_dir=folder, env={}, read_only=(), gpus=False), account, folder
    )
    assert inside.returncode != 0, "a nested user namespace was allowed in the sandbox"
    # The sandbox itself still runs a job, as the job's own account, writing its folder.
    check = ["sh", "-c", "id -u > uid.txt"]
    ran = _run(sandbox.wrap(check, job_dir=folder, env={}, read_only=(), gpus=False),
               account, folder)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert (folder / "uid.txt").read_text().strip() == str(account[0])


GLOO_JOB = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""
HOSTNAME_WARNING = "hostname of the client socket cannot be retrieved"


def test_a_job_on_its_own_network_resolves_loopback_without_warnings(
    account_dir: tuple[tuple[int, int], Path],
) -> None:
    """Two gloo ranks meeting over loopback in the sandbox's network: with the job's
    /etc/hosts they resolve every peer address, and torch warns of no unresolvable
    hostname (it does with the host's file, which may lack an IPv6 loopback line)."""
    import sys

    account, folder = account_dir
    (folder / "job.py").write_text(GLOO_JOB)
    os.chown(folder / "job.py", *account)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", "job.py"]  # fmt: skip
    hosts = sandbox.write_loopback_hosts(folder / ".sandbox-hosts")
    view = {"job_dir": folder, "env": {}, "read_only": (), "gpus": False}
    ran = _run(sandbox.wrap(torchrun, **view, hosts_file=hosts), account, folder)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert HOSTNAME_WARNING not in ran.stderr, ran.stderr[-3000:]
    lines = Path("/etc/hosts").read_text().splitlines()
    # Where the host's file lacks the IPv6 line, it is the cause: without ours, torch warns.
    if not any(line.split()[:1] == ["::1"] for line in lines):
        before = _run(sandbox.wrap(torchrun, **view), account, folder)
        assert HOSTNAME_WARNING in before.stderr, before.stderr[-3000:]
