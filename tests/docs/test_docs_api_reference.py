"""Every public name of ``dmuon`` is in the API reference, with its docstring."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
from docs_md import built_page, parse_html

import dmuon

PUBLIC = sorted(getattr(dmuon, "__all__", []))


def _summary(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    first = doc.strip().split("\n\n")[0]
    # What the reader sees: Markdown code marks and links are rendered away.
    first = re.sub(r"`+", "", first)
    first = re.sub(r"\[([^\]]*)\]\[[^\]]*\]", r"\1", first)
    return " ".join(first.split())


def test_dmuon_exports_public_names() -> None:
    assert PUBLIC, "dmuon.__all__ is empty"


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_documented(name: str, lang: str, site: Path) -> None:
    page = parse_html(built_page(site, "reference/api.md", lang))
    obj = getattr(dmuon, name)
    # Listed as dmuon.NAME, or under the path where it is defined.
    origin = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', name)}"
    assert f"dmuon.{name}" in page.ids or origin in page.ids, (
        f"dmuon.{name} has no entry in the API reference"
    )
    summary = _summary(obj)
    assert summary, f"dmuon.{name} has no docstring"
    # Compare on words only: the renderer may change quotes, spacing and markup.
    words = re.findall(r"\w+", summary)
    text_words = " ".join(re.findall(r"\w+", page.text))
    assert " ".join(words) in text_words, f"docstring of dmuon.{name} is not on the page"


#: The packages whose ``__all__`` is the public API, each one a section of the API page.
PACKAGES = (
    "dmuon",
    "dmuon.optim",
    "dmuon.checkpoint",
    "dmuon.plan",
    "dmuon.train",
    "dmuon.reference",
    "dmuon.integrations.transformers",
    "dmuon.integrations.accelerate",
)


def _exported() -> set[str]:
    import importlib

    names = set()
    for package in PACKAGES:
        module = importlib.import_module(package)
        names |= {f"{package}.{name}" for name in module.__all__}
    return names


def _entries(site: Path, lang: str) -> set[str]:
    """The ids of the API page's object entries (members of classes left out)."""
    page = parse_html(built_page(site, "reference/api.md", lang))
    entries = set()
    for anchor in page.ids:
        if not anchor.startswith("dmuon."):
            continue
        package = max((p for p in PACKAGES if anchor.startswith(p + ".")), key=len)
        name = anchor[len(package) + 1 :].split(".")[0]
        entries.add(f"{package}.{name}")
    return entries


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_api_page_shows_exactly_the_exported_names(site: Path, lang: str) -> None:
    exported, shown = _exported(), _entries(site, lang)
    assert exported - shown == set(), f"exported but not on the page: {sorted(exported - shown)}"
    assert shown - exported == set(), f"on the page but not exported: {sorted(shown - exported)}"


def test_implementation_modules_are_private() -> None:
    import pkgutil

    import dmuon

    public = []
    for info in pkgutil.walk_packages(dmuon.__path__, "dmuon."):
        parts = info.name.split(".")
        if parts[1] in ("train", "integrations") or info.name in PACKAGES:
            continue  # the recipe and the integrations are laid out for reading
        if parts[-1] == "__main__" or any(part.startswith("_") for part in parts[1:]):
            continue
        public.append(info.name)
    assert public == [], f"modules with public names outside the documented packages: {public}"


def test_no_import_cycles_inside_dmuon() -> None:
    """Imports between dmuon's modules (type-only ones included) form no cycle."""
    import ast
    import pkgutil

    import dmuon

    root = Path(dmuon.__file__).parent
    graph: dict[str, set[str]] = {}
    for info in pkgutil.walk_packages(dmuon.__path__, "dmuon."):
        relative = Path(*info.name.split(".")[1:])
        path = root / relative / "__init__.py" if info.ispkg else root / relative.with_suffix(".py")
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("dmuon.")
            ):
                targets.add(node.module)
        graph[info.name] = targets - {info.name}
    packages = {
        name for name in graph if (root / Path(*name.split(".")[1:]) / "__init__.py").exists()
    }
    visiting, done = set(), set()

    def visit(node: str, trail: list[str]) -> None:
        if node in done or node not in graph or node in packages:
            return
        if node in visiting:
            raise AssertionError("import cycle: " + " -> ".join([*trail, node]))
        visiting.add(node)
        for target in graph[node]:
            visit(target, [*trail, node])
        visiting.discard(node)
        done.add(node)

    for name in graph:
        visit(name, [])
