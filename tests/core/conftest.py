"""Fixtures shared by the core test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The recipe's corpus cache, shared by every recipe test of the session (built once)."""
    path = tmp_path_factory.getbasetemp() / "dmuon-train-corpus-cache"
    path.mkdir(exist_ok=True)
    return str(path)
