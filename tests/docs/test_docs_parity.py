"""Every English page has a Chinese page at the same path with the same structure and code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docs_md import (
    DOCS,
    ZH,
    built_page,
    code_blocks,
    en_pages,
    parse_html,
    rel,
    strip_comments,
    zh_pages,
)

PAGES = [rel(p) for p in en_pages()]


def test_same_set_of_pages() -> None:
    en = {rel(p) for p in en_pages()}
    zh = {rel(p) for p in zh_pages()}
    assert en - zh == set(), f"English pages without a Chinese page: {sorted(en - zh)}"
    assert zh - en == set(), f"Chinese pages without an English page: {sorted(zh - en)}"


@pytest.mark.parametrize("page", PAGES)
def test_same_code_blocks(page: str) -> None:
    """Same code in the same order; only comments may differ (and norun reasons)."""
    zh_path = ZH / page
    if not zh_path.exists():
        pytest.fail(f"missing docs/zh/{page}")
    en_blocks = code_blocks(DOCS / page)
    zh_blocks = code_blocks(zh_path)
    assert len(en_blocks) == len(zh_blocks), (
        f"{page}: {len(en_blocks)} code blocks in English, {len(zh_blocks)} in Chinese"
    )
    for en, zh in zip(en_blocks, zh_blocks, strict=True):
        assert en.lang == zh.lang, f"{en.where} vs zh {zh.where}: language differs"
        assert strip_comments(en) == strip_comments(zh), (
            f"{en.where} vs zh {zh.where}: code differs beyond comments"
        )
        assert en.marker_kind == zh.marker_kind, f"{en.where}: run marker differs in zh"
        if en.marker_kind == "run":
            assert en.marker_arg == zh.marker_arg, f"{en.where}: run marker differs in zh"


@pytest.mark.parametrize("page", PAGES)
def test_same_sections(page: str, site: Path) -> None:
    """Same headings (levels and anchors) in the same order on the built pages."""
    en = parse_html(built_page(site, page, "en")).headings
    zh = parse_html(built_page(site, page, "zh")).headings
    assert [lvl for lvl, _ in en] == [lvl for lvl, _ in zh], (
        f"{page}: heading levels differ\nen: {en}\nzh: {zh}"
    )
    # Section anchors are shared, so links and the language switcher keep their target.
    en_ids = [hid for lvl, hid in en if lvl > 1]
    zh_ids = [hid for lvl, hid in zh if lvl > 1]
    assert en_ids == zh_ids, f"{page}: section anchors differ\nen: {en_ids}\nzh: {zh_ids}"


CJK = "\u3000-\u303f\u4e00-\u9fff\uff00-\uffef"


def test_chinese_prose_has_no_hard_breaks_between_characters() -> None:
    """A line break between two Chinese characters shows as a stray space in the page."""
    pattern = re.compile(rf"[{CJK}]\n[ \t]*[{CJK}]")
    problems = []
    for path in zh_pages():
        text = path.read_text(encoding="utf-8")
        prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
        for match in pattern.finditer(prose):
            problems.append(f"zh/{rel(path)}: {match.group(0)!r}")
    assert not problems, "\n".join(problems[:20])


def _list_items_per_section(path: Path) -> list[tuple[str, int]]:
    """(heading anchor or text, top-level list items under it), outside code blocks."""
    sections: list[tuple[str, int]] = [("(top)", 0)]
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif in_code:
            continue
        elif heading := re.match(r"#+ .*?(\{#([\w-]+)\})?\s*$", line):
            sections.append((heading.group(2) or line, 0))
        elif re.match(r"(-|\*|\d+\.) ", line):
            name, count = sections[-1]
            sections[-1] = (name, count + 1)
    return sections


@pytest.mark.parametrize("page", PAGES)
def test_same_list_items(page: str) -> None:
    """Every section has as many top-level list items in Chinese as in English: a
    changelog entry or a bullet of a guide is not left untranslated."""
    en = [count for _, count in _list_items_per_section(DOCS / page)]
    zh = _list_items_per_section(ZH / page)
    differ = [
        f"{name}: {e} in English, {z} in Chinese"
        for e, (name, z) in zip(en, zh, strict=False)
        if e != z
    ]
    assert not differ, f"{page}:\n" + "\n".join(differ)
