"""Diagrams are inline SVG in the built pages of both languages, with nothing to fetch."""

from __future__ import annotations

import re
import sys
from html import unescape as html_unescape
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


def _diagram_texts(html: str) -> list[tuple[str, str, str]]:
    """(x, y, text) of every ``<text>``, ``<title>`` and caption of every diagram, in order."""
    items: list[tuple[str, str, str]] = []
    for figure in re.findall(r'<figure class="dmuon-diagram".*?</figure>', html, re.S):
        for match in re.finditer(
            r'<text x="([\d.]+)" y="([\d.]+)"[^>]*>(.*?)</text>'
            r"|<(?:title|figcaption)>(.*?)</(?:title|figcaption)>",
            figure,
        ):
            x, y, text, title = match.groups()
            items.append((x or "", y or "", html_unescape(text if title is None else title)))
    return items


def _boxes(items: list[tuple[str, str, str]]) -> list[str]:
    """Texts as readers see them: single elements, and runs of wrapped lines (same x, one
    line below the other) joined into the label they came from."""
    found = [text for _, _, text in items]
    run: list[tuple[str, str, str]] = []
    for item in [*items, ("", "", "")]:
        if run and item[0] == run[-1][0] and item[0] and float(item[1]) > float(run[-1][1]):
            run.append(item)
            continue
        if len(run) > 1:
            found.append(" ".join(text for _, _, text in run))
        run = [item]
    return found


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_every_diagram_label_is_shown_in_full(site: Path, lang: str) -> None:
    """Each label of docs_hooks/diagrams.py appears whole in a drawn diagram: on one line,
    or wrapped over lines of one box (a label cut short, like "... one reduce to the" with
    "owner" dropped, fails)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs_hooks"))
    import diagrams

    shown = []
    for page in PAGES:
        shown += _boxes(_diagram_texts(built_page(site, page, lang).read_text(encoding="utf-8")))
    squeezed = [_squeeze(text) for text in shown]
    missing = [
        label
        for label in diagrams.TEXT[lang].values()
        if "{" not in label and not any(_squeeze(label) in text for text in squeezed)
    ]
    assert not missing, f"{lang}: labels not drawn in full: {missing}"


@pytest.mark.parametrize("width", range(40, 241, 20))
def test_chinese_labels_break_between_words(width: int) -> None:
    """A wrapped Chinese label never cuts a word (不⏎通信, 归约一⏎次), never starts a line
    with closing punctuation and never ends one with opening punctuation."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs_hooks"))
    import diagrams

    for label in diagrams.TEXT["zh"].values():
        lines = diagrams.wrap_lines(label, width)
        assert "".join(lines).replace(" ", "") == label.replace(" ", "")
        joined = "\n".join(lines)
        for word in ("不通信", "一次"):
            if word in label:
                assert word in joined, (width, lines)
        for line in lines:
            assert not line or line[0] not in "，。、；：）", (width, lines)
            assert not line or line[-1] not in "（《“", (width, lines)
