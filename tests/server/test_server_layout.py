"""The server is laid out by concern, in modules small enough to read: none over 500 lines,
and none left at the top of the package but the wiring, the settings, the users and the
entry points."""

from __future__ import annotations

from pathlib import Path

import dmuon_server

LIMIT = 500
TOP_LEVEL = {"__init__", "__main__", "app", "cli", "config", "demo", "runner", "users"}
PACKAGES = {"http", "launching", "recipe", "scheduling", "schemas", "storage", "streams"}


def test_no_server_module_is_over_500_lines_and_each_concern_has_its_package() -> None:
    root = Path(dmuon_server.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert len(sizes) > 30, sizes
    assert not {n: s for n, s in sizes.items() if s > LIMIT}
    assert {p.stem for p in root.glob("*.py")} == TOP_LEVEL
    assert {p.name for p in root.iterdir() if (p / "__init__.py").exists()} == PACKAGES
