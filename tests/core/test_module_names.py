"""Each concern of the library has one obvious file: no two modules of ``dmuon`` share a
name (leading underscores aside), and none is named like packaging (``setup.py``).

The server is left out on purpose: its layers repeat a resource's name by design
(``http/routes/jobs.py`` serves what ``storage/jobs.py`` stores), and
``test_server_layout.py`` holds their order."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DMUON = ROOT / "packages" / "dmuon-core" / "src" / "dmuon"
#: Names every package may repeat: they mark a package, not a concern.
PACKAGE_MARKERS = {"__init__", "__main__"}


def modules_by_name(root: Path) -> dict[str, list[str]]:
    """The package's module paths, keyed by their name without leading underscores."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.stem not in PACKAGE_MARKERS:
            found[path.stem.lstrip("_")].append(str(path.relative_to(root)))
    return found


def test_no_two_modules_share_a_name() -> None:
    shared = {name: paths for name, paths in modules_by_name(DMUON).items() if len(paths) > 1}
    assert not shared, f"modules that read as one concern: {shared}"


def test_no_module_reads_as_packaging() -> None:
    assert "setup" not in modules_by_name(DMUON)


def test_the_scan_finds_a_shared_name(tmp_path: Path) -> None:
    for relative in ("a/state.py", "b/_state.py", "b/__init__.py", "a/__init__.py", "c.py"):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text("")
    found = modules_by_name(tmp_path)
    assert found["state"] == ["a/state.py", "b/_state.py"]
    assert found["c"] == ["c.py"] and "__init__" not in found and "init__" not in found
