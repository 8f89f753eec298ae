"""The recipe's start-up: its imports are kept out of the garbage collector's reach only
when it runs as a program of its own (``dmuon-train``, ``python -m dmuon.train``), and a
run started that way trains exactly as one started through ``main``.

Oracles: the ``gc`` module's own state (seen from a fresh interpreter, since freezing is
for the whole process), and the metrics of the same run started through ``main``.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
from bench_modules import import_benchmark
from recipe_launch import recipe_env

from dmuon.train.__main__ import main

GC_STATE = """
import gc, json
from dmuon._startup import imports_kept_for_life

states = {}
before = gc.get_freeze_count()
with imports_kept_for_life():
    states["enabled_inside"] = gc.isenabled()
    import decimal, email.parser  # noqa: F401
states["enabled_after"] = gc.isenabled()
states["frozen"] = gc.get_freeze_count() - before
try:
    with imports_kept_for_life():
        raise ImportError("no such module")
except ImportError:
    states["enabled_after_an_error"] = gc.isenabled()
gc.disable()
with imports_kept_for_life():
    pass
states["left_disabled"] = not gc.isenabled()
print(json.dumps(states))
"""


def test_the_collector_is_paused_inside_then_restored_and_the_imports_frozen() -> None:
    out = subprocess.run(
        [sys.executable, "-c", GC_STATE], capture_output=True, text=True, check=True
    ).stdout
    states = json.loads(out)
    assert states == {
        "enabled_inside": False,
        "enabled_after": True,
        "frozen": states["frozen"],
        "enabled_after_an_error": True,
        "left_disabled": True,
    }
    assert states["frozen"] > 1000  # the modules' objects (decimal alone makes thousands)


class _Cycle:
    """An object in a reference cycle: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_main_called_in_process_freezes_nothing(tmp_path: Path, cache_dir: str) -> None:
    alive_during_main = _Cycle()
    ref = weakref.ref(alive_during_main)
    enabled = gc.isenabled()
    flags = ["--model", "tiny", "--steps", "1", "--eval-every", "0", "--progress", "plain",
             "--device", "cpu", "--cache-dir", cache_dir]  # fmt: skip
    assert main(flags) == 0
    assert gc.isenabled() == enabled
    del alive_during_main
    gc.collect()
    assert ref() is None, "main froze what was alive while it ran: it is never collected"


def test_the_program_trains_as_main_does(
    tmp_path: Path, cache_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The benchmark's runs (one as ``dmuon-train`` starts, one through ``main``) write the
    same losses, gradient norms and learning rates; it stops with the difference if not."""
    for name, value in recipe_env(cache_dir, tmp_path).items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "startup.json"
    argv = ["--rounds", "1", "--steps", "2", "--warmup", "0", "--json", str(out)]
    assert import_benchmark("recipe_startup").main(argv) == 0
    result = json.loads(out.read_text())
    (round_,) = result["rounds"]
    assert set(round_) == {"kept", "plain"}
    assert all(r["cpu_s"] > 0 and r["wall_s"] > 0 for r in round_.values())
    ratio = result["median_cpu_ratio_kept_over_plain"]
    assert ratio == round_["kept"]["cpu_s"] / round_["plain"]["cpu_s"]
