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
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from accounts import normal_account

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
    folder = Path(tempfile.mkdtemp(prefix="dmuon-userns-", dir="/tmp"))
    os.chown(folder, *account)
    try:
        yield account, folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
