"""Every command answers ``--help`` with exit status 0: the console scripts (as installed),
the ``python -m`` entry points of both packages, and the benchmark scripts (found by their
``__main__`` guard, so a new one is covered too). The modules and scripts run in one
interpreter (``help_runner.py``), which imports torch once."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from server_helpers import SERVER_TESTS

REPO = SERVER_TESTS.parents[1]
#: Modules run as ``python -m``: each package's ``__main__`` modules and guarded modules.
MODULES = (
    "dmuon.train",
    "dmuon.checkpoint",
    "dmuon_server",
    "dmuon_server.cli",
    "dmuon_server.demo",
)
#: Run in a process of their own: the runner ends its process with ``os._exit``.
OWN_PROCESS = ("dmuon_server.runner",)


def _benchmark_scripts() -> list[Path]:
    return sorted(
        p
        for p in (REPO / "benchmarks").glob("*.py")
        if 'if __name__ == "__main__"' in p.read_text()
    )


def test_every_command_answers_help() -> None:
    consoles = sorted(
        ep.name
        for ep in entry_points(group="console_scripts")
        if ep.value.startswith(("dmuon.", "dmuon_server."))
    )
    assert {"dmuon-server", "dmuon-train"} <= set(consoles), consoles
    bindir = Path(sys.executable).parent
    commands = {name: [str(bindir / name), "--help"] for name in consoles}
    commands |= {f"python -m {m}": [sys.executable, "-m", m, "--help"] for m in OWN_PROCESS}
    commands["bash benchmarks/gpu_check.sh"] = [
        "bash",
        str(REPO / "benchmarks" / "gpu_check.sh"),
        "--help",
    ]
    scripts = _benchmark_scripts()
    assert len(scripts) >= 10, scripts
    runs = {
        name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, argv in commands.items()
    }
    bench = subprocess.run(
        [sys.executable, str(SERVER_TESTS / "help_runner.py"), *MODULES, *map(str, scripts)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    failed = {}
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=300)
        expected = "gpu_check.sh" if name.endswith("gpu_check.sh") else "usage"
        if proc.returncode != 0 or expected not in out.lower():
            failed[name] = (proc.returncode, out[-500:])
    assert bench.returncode == 0, bench.stdout[-2000:] + bench.stderr[-2000:]
    for target, (status, out) in json.loads(bench.stdout.splitlines()[-1]).items():
        if status != 0 or "usage:" not in out:
            failed[target] = (status, out[-500:])
    assert not failed, failed
