"""`.ci/slurm-up.sh` decides whether a daemon runs from its pid file. After a machine is
restored from a snapshot, a pid file can name a live process that is not the daemon; the
script then must start the daemon, not wait for a controller that is not there."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

DAEMONS = Path(__file__).resolve().parents[2] / ".ci" / "daemons.sh"


def call(function: str, pid_file: Path, name: str) -> subprocess.CompletedProcess[str]:
    """``function PIDFILE NAME`` of the helpers, in a fresh bash with the script's `die`."""
    script = f'die() {{ echo "$*" >&2; exit 1; }}; source "{DAEMONS}"; {function} "$1" "$2"'
    return subprocess.run(
        ["bash", "-c", script, "_", str(pid_file), name],
        capture_output=True,
        text=True,
        timeout=30,
    )


def is_running(pid_file: Path, name: str) -> bool:
    """What the script's ``running PIDFILE NAME`` answers."""
    out = call("running", pid_file, name)
    assert out.stderr == "", out.stderr
    return out.returncode == 0


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "120"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_pid_file_naming_another_process_is_not_the_daemon(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    pid_file = tmp_path / "slurmctld.pid"
    pid_file.write_text(f"{sleeper.pid}\n")
    assert not is_running(pid_file, "slurmctld")
    assert is_running(pid_file, "sleep")


def test_missing_empty_and_dead_pid_files_are_not_running(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    assert not is_running(tmp_path / "absent.pid", "sleep")
    (tmp_path / "empty.pid").write_text("")
    assert not is_running(tmp_path / "empty.pid", "sleep")
    dead = subprocess.Popen(["sleep", "0"])
    dead.wait()
    (tmp_path / "dead.pid").write_text(f"{dead.pid}\n")
    assert not is_running(tmp_path / "dead.pid", "sleep")


def test_stop_leaves_another_process_alone_and_removes_the_stale_file(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    pid_file = tmp_path / "slurmd.pid"
    pid_file.write_text(f"{sleeper.pid}\n")
    out = call("stop", pid_file, "slurmd")
    assert out.returncode == 0, out.stderr
    assert sleeper.poll() is None, "stop killed a process that was not the daemon"
    assert not pid_file.exists()
