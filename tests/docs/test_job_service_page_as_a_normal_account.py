"""The job-service page's shell session (every ``bash`` example of the page, the team
setup included) runs as written as a normal account too, not only as the account of the
tests: a server started by a person on a machine of their own.

Oracle: the session's exit status under ``set -euo pipefail`` (each example checks what
it shows: the answers' status codes, the jobs' final states). Needs root to run as the
other account (skipped otherwise, saying why).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import account_env, normal_account, run_shell_script
from docs_examples import TIMEOUT_S, collect

PAGE = "job-service.md"


def test_the_pages_shell_session_runs_as_a_normal_account() -> None:
    account = normal_account()
    if account is None:
        pytest.skip("running as another account needs root (and useradd)")
    examples = [e for e in collect()[0] if e.blocks[0].page == PAGE and e.launcher == "bash"]
    assert len(examples) == 1, [e.id for e in examples]
    folder = Path(tempfile.mkdtemp(prefix="dmuon-page-", dir="/tmp"))
    try:
        script = folder / "example.sh"
        script.write_text(examples[0].script, encoding="utf-8")
        code, out, err = run_shell_script(script, account_env(folder), TIMEOUT_S, account)
        assert code == 0, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
        assert "bob reads ada's job: 404" in out, out[-3000:]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
