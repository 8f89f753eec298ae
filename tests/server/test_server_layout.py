"""The server is laid out by concern, in modules small enough to read: none over 500 lines,
and none left at the top of the package but the wiring, the settings, the users and the
entry points."""

from __future__ import annotations

import ast
from pathlib import Path

import dmuon_server

LIMIT = 500
TOP_LEVEL = {
    "__init__", "__main__", "app", "cli", "config", "demo", "flags", "runner", "users",
}  # fmt: skip
PACKAGES = {"http", "launching", "recipe", "scheduling", "schemas", "storage", "streams"}


def test_no_server_module_is_over_500_lines_and_each_concern_has_its_package() -> None:
    root = Path(dmuon_server.__file__).parent
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert len(sizes) > 30, sizes
    assert not {n: s for n, s in sizes.items() if s > LIMIT}
    assert {p.stem for p in root.glob("*.py")} == TOP_LEVEL
    assert {p.name for p in root.iterdir() if (p / "__init__.py").exists()} == PACKAGES


#: The server's layers, top first: a module may import its own package and the layers
#: below it, never one above (streams and recipe are side by side: neither imports the
#: other). The entry points (app, cli and its flags, runner, demo, __main__) stand above
#: them all and are imported by none of the layers.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"http"}),
    frozenset({"scheduling"}),
    frozenset({"launching"}),
    frozenset({"streams", "recipe"}),
    frozenset({"schemas"}),
    frozenset({"storage"}),
    frozenset({"config", "users"}),
)
ENTRY_POINTS = frozenset({"app", "cli", "flags", "runner", "demo", "__main__"})


def _imported(tree: ast.AST) -> set[str]:
    """The ``dmuon_server`` sub-package or top module each import of ``tree`` names."""
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "dmuon_server" and len(parts) > 1 and not parts[1].startswith("__"):
                found.add(parts[1])  # (the package's __version__ is no layer)
    return found


def test_the_sub_packages_import_downward_only() -> None:
    """Every import between the server's parts, read from the source (``ast``, lazy
    imports inside functions included), against the layer order."""
    root = Path(dmuon_server.__file__).parent
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    upward: list[str] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        part = relative.parts[0].removesuffix(".py")
        if part in ENTRY_POINTS or part == "__init__":
            continue
        assert part in level, f"{relative} belongs to no layer"
        for target in _imported(ast.parse(path.read_text(), str(path))) - {part}:
            if target in ENTRY_POINTS or target not in level or level[target] <= level[part]:
                upward.append(f"{relative} imports dmuon_server.{target}")
    assert not upward, "\n".join(upward)
