"""One Chinese term per concept: the glossary's, never one of its variants.

The Chinese pages, and the Chinese strings the site's hooks generate, use the glossary's
term for the recipe, the masters, tokens and the owner plan; the variants that crept in
are refused here, each with the term to use.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs_hooks"))

#: The glossary's term, and the variants that must not appear.
VARIANTS = {
    "训练配方": ("训练程序",),
    "主副本": ("主权重",),
    "token": ("词元",),
    "所有者规划": ("属主规划",),
}

SOURCES = sorted((ROOT / "docs" / "zh").glob("*.md")) + sorted((ROOT / "docs_hooks").glob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_the_chinese_text_uses_one_term_each(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = [
        f"{variant} (line {text[: m.start()].count(chr(10)) + 1}): use {term}"
        for term, variants in VARIANTS.items()
        for variant in variants
        for m in re.finditer(re.escape(variant), text)
    ]
    assert not found, found


def test_the_terms_are_the_glossarys() -> None:
    import glossary

    chinese = {term.zh for term in glossary.TERMS}
    missing = [term for term in VARIANTS if term not in chinese and term != "所有者规划"]
    assert not missing, f"not glossary terms: {missing}"
    assert "所有者" in chinese  # the owner plan is the owners' plan
