"""`benchmarks/server_soak.py` on a small scale: a real server with its default token, killed
with SIGKILL halfway and started again, loses no job, runs none twice and leaves nothing
behind. Its checks come from the jobs' records, logs and event streams, not from itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "server_soak.py"


def test_the_soak_benchmark_survives_a_kill_with_every_job_run_once(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    argv = ["--jobs", "6", "--clients", "2", "--steps", "2", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(BENCH), *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["states"] == {"succeeded": 6}
    for check in ("lost", "attempts_not_one", "started_not_once", "points_not_steps",
                  "streams_not_exact", "orphans", "gpu_shared"):  # fmt: skip
        assert result[check] == [], (check, result[check])
    assert result["gpus_busy_at_end"] == 0
    assert result["gpu_samples"] > 0
    assert result["rest"]["POST /v1/jobs"]["n"] == 6
    assert 0 < result["restart_at_s"] < result["wall_s"]
    assert done.stdout.rstrip().endswith("OK")
