"""Flags ``dmuon-server`` refuses before it touches anything: each gives one
``dmuon-server: error:`` line naming the flag and exit status 2, and no data directory is
made. Oracle: the process's own exit status and stderr (``cli.main`` in this process, as
the console script runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmuon_server import cli


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--max-concurrent-jobs", "0"], "--max-concurrent-jobs must be at least 1"),
        (["--max-nproc", "0"], "--max-nproc must be at least 1"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be at least 1"),
        (["--gpus", "0,0"], "--gpus"),
        (["--cancel-grace-s", "-1"], "--cancel-grace-s >= 0"),
        (["--max-job-memory", "0"], "--max-job-memory must be a positive number"),
        (["--max-job-cpus", "-2"], "--max-job-cpus must be a positive number"),
        (["--max-job-pids", "8"], "--max-job-pids must be at least 16"),
        (["--data-root", "/no/such/folder"], "--data-root /no/such/folder is not an existing"),
        (["--code-root", "/no/such/code"], "--code-root /no/such/code is not an existing"),
    ],
)
def test_a_bad_flag_is_one_error_line_and_exit_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], why: str
) -> None:
    data = tmp_path / "data"
    code = cli.main(["--no-auth", "--port", "0", "--data-dir", str(data), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dmuon-server: error: "), err
    assert why in lines[0], err
    assert not data.exists()
