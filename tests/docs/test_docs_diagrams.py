"""Diagrams are inline SVG in the built pages of both languages, with nothing to fetch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_md import built_page

PAGES = {
    "concepts.md": "ownership",
    "z2-vs-z3.md": "z2-z3-timeline",
    "gradient-accumulation.md": "no-sync-flow",
}


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("page", sorted(PAGES))
def test_diagram_is_inline_svg(site: Path, page: str, lang: str) -> None:
    html = built_page(site, page, lang).read_text(encoding="utf-8")
    match = re.search(
        rf'<figure class="dmuon-diagram" data-diagram="{PAGES[page]}">(.*?)</figure>', html, re.S
    )
    assert match, f"{lang} {page}: diagram {PAGES[page]!r} missing"
    figure = match.group(1)
    assert "<svg" in figure and "<text" in figure
    assert not re.search(r'(?:href|src)="', figure), "a diagram must not load anything"
    caption = re.search(r"<figcaption>(.*?)</figcaption>", figure, re.S)
    assert caption, "no caption"
    has_han = bool(re.search(r"[\u4e00-\u9fff]", caption.group(1)))
    assert has_han == (lang == "zh"), f"{lang} caption: {caption.group(1)!r}"


def test_ownership_diagram_shows_the_planned_owners(site: Path) -> None:
    """Every matrix chip carries the owner that dmuon.plan_owners gives it."""
    import dmuon

    html = built_page(site, "concepts.md", "en").read_text(encoding="utf-8")
    chips = re.findall(r'class="dg-chip dg-r(\d)"><title>(\S+) (\d+)×(\d+)', html)
    assert chips
    shapes = {fqn: (int(r), int(c)) for _, fqn, r, c in chips}
    boundaries = {fqn: fqn.rsplit(".", 3)[0] for fqn in shapes}
    plan = dmuon.plan_owners(shapes, 3, boundaries)
    assert {fqn: int(rank) for rank, fqn, _, _ in chips} == plan.owners
