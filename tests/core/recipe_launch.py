"""The environment of a recipe run the core tests launch (``python -m dmuon.train`` or
torchrun)."""

from __future__ import annotations

import os
from pathlib import Path


def recipe_env(cache_dir: str | Path, tmp: str | Path) -> dict[str, str]:
    """This process's environment with one thread per rank, the corpus cache
    ``cache_dir``, and ``tmp`` as TMPDIR: torchrun makes a log folder there per launch and
    leaves it, so it goes to the test's own folder instead of /tmp."""
    return dict(os.environ, OMP_NUM_THREADS="1", DMUON_CACHE_DIR=str(cache_dir), TMPDIR=str(tmp))
