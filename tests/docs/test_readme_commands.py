"""The README's job-service commands run as written, as the account that runs the tests
(root in CI, where the server refuses to run jobs as root unless told, as the README says).

The one change: the README's port 8000 becomes a free one (tests never take a fixed
port). Oracles: the shell's exit status under ``set -euo pipefail``, the server's own
answers (the job ``succeeded`` with 60 stored steps; the closing cancel is answered 409,
the job being over), and the token file the server made, mode 600.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

from conftest import docs_env

README = Path(__file__).resolve().parents[2] / "README.md"
TIMEOUT_S = 300


def _service_block() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## The job service") :]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match is not None, "the README's job-service section has no bash block"
    return match.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readmes_service_commands_run_as_written(tmp_path: Path) -> None:
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
    (tmp_path / "readme.sh").write_text(script)
    env = docs_env()
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "readme.sh"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
    job = json.loads((tmp_path / "job.json").read_text())
    assert job["state"] == "succeeded", job
    assert job["name"] == "tiny-accum4"
    stored = re.findall(r'"step":(\d+)', out)
    assert "60" in stored, out[-2000:]
    assert '"status":409' in out  # the README's cancel, once the job is over
    token = tmp_path / ".dmuon" / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
