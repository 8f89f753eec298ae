"""MkDocs hook: let inline code in table cells wrap between words, never inside one.

Narrow table cells used to break identifiers such as ``reshard_after_forward`` at any
letter. The theme's stylesheet (``docs/stylesheets/layout.css``) now keeps code words whole;
this hook marks where a long identifier may wrap instead: after ``_ = , /``, and after
``-`` or ``.`` between letters.
"""

from __future__ import annotations

import re

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

CELL = re.compile(r"<(?P<tag>t[dh])(?P<attrs>[^>]*)>(?P<body>.*?)</(?P=tag)>", re.S)
CODE = re.compile(r"<code>(?P<text>[^<]*)</code>")
# After "_", "=", "," or "/"; after "-" or "." only between letters (never inside a number
# or a leading "--").
BREAK_AFTER = re.compile(
    r"(?<=[_=,/])(?=\S)|(?<=[A-Za-z0-9]-)(?=[A-Za-z])|(?<=[A-Za-z_)]\.)(?=[A-Za-z_])"
)


def soften(code_text: str) -> str:
    """``code_text`` with ``<wbr>`` after each punctuation mark that may end a line."""
    return BREAK_AFTER.sub("<wbr>", code_text)


def on_page_content(html: str, /, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Add wrap points to the inline code of every table cell."""

    def cell(match: re.Match[str]) -> str:
        body = CODE.sub(lambda m: f"<code>{soften(m.group('text'))}</code>", match.group("body"))
        tag = match.group("tag")
        return f"<{tag}{match.group('attrs')}>{body}</{tag}>"

    return CELL.sub(cell, html)
