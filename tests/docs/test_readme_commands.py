"""The README's job-service commands run as written, once: as a normal account when the
tests run as root (the README is written for a person at a workstation; a root server
runs jobs as root with ``--allow-same-user-jobs``, the flag every live-server test of
``tests/server`` starts with), as the tests' own account otherwise.

The one change: the README's port 8000 becomes a free one (tests never take a fixed
port). Oracles: the shell's exit status under ``set -euo pipefail``, the server's own
answers (the job ``succeeded`` with 60 stored steps; the closing cancel is answered 409,
the job being over), and the token file the server made, mode 600.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
from pathlib import Path

import pytest
from accounts import folder_of
from conftest import account_env, normal_account, run_shell_script

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The job service package's README shows the same commands.
PACKAGE_README = ROOT / "packages" / "dmuon-server" / "README.md"
TIMEOUT_S = 300


def _service_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The job service") :]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match is not None, "the README's job-service section has no bash block"
    assert match.group(0) in PACKAGE_README.read_text(encoding="utf-8"), (
        "packages/dmuon-server/README.md must show the README's (tested) commands"
    )
    return match.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readmes_service_commands_run_as_written(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        _run_readme(tmp_path, None)
        return
    account = normal_account()
    if account is None:
        pytest.skip("the README's commands need a normal account to run as (useradd)")
    # pytest's own folders are the tests' account's alone: the run gets one in /tmp.
    with folder_of(account, "dmuon-readme-") as folder:
        _run_readme(folder, account)


def _run_readme(folder: Path, account: tuple[int, int] | None) -> None:
    block = _service_block()
    assert "8000" in block and "$ID" in block and "ID=$(" in block
    port = _free_port()
    script = block.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace(
        "dmuon-server --data-dir", f"dmuon-server --port {port} --data-dir"
    )
    # Afterwards: what the server says of the job the README submitted.
    script += f"""
curl -s http://127.0.0.1:{port}/v1/jobs/$ID -H "$H" > job.json
kill %1
"""
    (folder / "readme.sh").write_text(script)
    env = account_env(folder)
    if account is None:
        env["HOME"] = os.environ.get("HOME", str(folder))
    code, out, err = run_shell_script(folder / "readme.sh", env, TIMEOUT_S, account)
    assert code == 0, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
    job = json.loads((folder / "job.json").read_text())
    assert job["state"] == "succeeded", (job.get("reason"), job.get("failure"), err[-3000:])
    assert job["name"] == "tiny-accum4"
    stored = re.findall(r'"step":(\d+)', out)
    assert "60" in stored, out[-2000:]
    assert '"status":409' in out  # the README's cancel, once the job is over
    token = folder / ".dmuon" / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    if account is not None:  # the server and its job ran as the account
        assert token.stat().st_uid == account[0]
