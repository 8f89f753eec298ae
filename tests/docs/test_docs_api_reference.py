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
