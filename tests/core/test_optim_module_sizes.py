"""Modules stay small enough to read: none under ``dmuon/optim`` over 500 lines."""

from __future__ import annotations

from pathlib import Path

import dmuon.optim

LIMIT = 500


def test_no_optimizer_module_is_over_500_lines() -> None:
    root = Path(dmuon.optim.__file__).parent
    sizes = {p.name: len(p.read_text().splitlines()) for p in root.glob("*.py")}
    assert len(sizes) > 5, sizes
    assert not {n: s for n, s in sizes.items() if s > LIMIT}, sizes
