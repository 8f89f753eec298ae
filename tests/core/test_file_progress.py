"""``--file-progress`` (``tests/file_progress.py``), as ``make test`` runs it.

Oracle: a real pytest session in a folder of its own, on test files whose outcomes are
known, read from its output and from the times table it writes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
#: The plugin and the flags ``make test`` gives it (the Makefile's ``PROGRESS``).
MAKE_TEST_FLAGS = ("-p", "file_progress", "--file-progress", "-o", "console_output_style=classic")

FILES = {
    "tests/core/test_two.py": "def test_a():\n    pass\n\n\ndef test_b():\n    pass\n",
    "tests/server/test_mixed.py": (
        "import pytest\n\n\ndef test_ok():\n    pass\n\n\n"
        "@pytest.mark.skip(reason='no')\ndef test_skipped():\n    pass\n\n\n"
        "def test_fails():\n    assert 1 == 2\n"
    ),
    "tests/docs/test_param.py": (
        "import pytest\n\n\n@pytest.mark.parametrize('n', range(19))\ndef test_n(n):\n    pass\n"
    ),
}


def _session(root: Path, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(TESTS), "PYTEST_ADDOPTS": ""}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", *MAKE_TEST_FLAGS, "-p", "no:cacheprovider", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return run.stdout


def _project(tmp_path: Path) -> Path:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    "workers", [("-p", "no:xdist"), ("-n", "2", "--dist", "loadfile")], ids=["alone", "xdist"]
)
def test_one_line_per_file_with_its_counts_and_nothing_between(
    tmp_path: Path, workers: tuple[str, ...]
) -> None:
    out = _session(_project(tmp_path), *workers, "tests")
    lines = [line for line in out.splitlines() if re.match(r"\[ *\w+\] tests/", line)]
    assert len(lines) == 3, out
    by_file = {re.search(r"\] (\S+):", line).group(1): line for line in lines}  # type: ignore[union-attr]
    assert by_file.keys() == FILES.keys()
    assert by_file["tests/core/test_two.py"].startswith("[  core] ")
    assert ": 2 passed in " in by_file["tests/core/test_two.py"]
    mixed = by_file["tests/server/test_mixed.py"]
    assert mixed.startswith("[server] ")
    assert re.search(r": (?=.*1 passed)(?=.*1 skipped)(?=.*1 failed)", mixed), mixed
    assert ": 19 passed in " in by_file["tests/docs/test_param.py"]
    assert lines[-1].endswith("elapsed)") and "(3/3 files, " in lines[-1]
    # No dots, percentages or lines holding only a file's name; the failure still shows.
    assert not re.search(r"^\.+\s*$|\[\s*\d+%\]|^tests/\S+\.py\s*$", out, re.M), out
    assert "assert 1 == 2" in out


def test_the_times_table_keeps_the_files_of_every_session(tmp_path: Path) -> None:
    root = _project(tmp_path)
    _session(root, "-p", "no:xdist", "tests/core")
    _session(root, "-p", "no:xdist", "tests/docs")
    table = json.loads((root / "test-artifacts" / "file-seconds.json").read_text())
    assert set(table) == {"tests/core/test_two.py", "tests/docs/test_param.py"}
    assert all(isinstance(v, float) and v >= 0 for v in table.values())
