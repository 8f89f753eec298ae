"""Import a module of ``benchmarks/`` (not a package) from its folder, for the tests that
check a benchmark."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def import_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (``bench``, ``traffic``, ``recipe_startup``)."""
    sys.path.insert(0, str(BENCH_DIR))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH_DIR))
