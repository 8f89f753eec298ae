"""Read the documentation sources and the built site for the docs tests.

Markdown side: pages, fenced code blocks and the markers that tell the example runner what
to do with a block. HTML side: headings, ids and links of built pages.

Markers are HTML comments on the last non-blank line before a fenced block (invisible to
readers):

``<!-- run: torchrun 2 -->``
    Run this Python block under ``torchrun --standalone --nproc_per_node 2`` (gloo, CPU).
``<!-- run: continue -->``
    Append this block to the latest single-process Python example of the page (or, for a
    shell block, to the latest shell example): they run as one script, for an example
    explained in several steps. torchrun examples are always complete scripts, since
    readers launch them as they are.
``<!-- run: bash -->``
    Run this shell block with bash (shell blocks are otherwise not run).
``<!-- norun: REASON -->``
    Do not run this block. REASON must also be shown to readers in the admonition directly
    above the marker.

Python blocks without a marker are run on their own, in one process.
"""

from __future__ import annotations

import importlib.util
import io
import re
import tokenize
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
ZH = DOCS / "zh"

FENCE_OPEN = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
MARKER = re.compile(r"^[ \t]*<!--[ \t]*(?P<kind>run|norun):[ \t]*(?P<arg>.*?)[ \t]*-->[ \t]*$")
ADMONITION = re.compile(
    r"^(?P<indent>[ \t]*)(?:!!!|\?\?\?\+?)[ \t]+\S+(?:[ \t]+\"(?P<title>[^\"]*)\")?"
)

PYTHON_LANGS = {"python", "py", "python3"}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
HASH_COMMENT_LANGS = SHELL_LANGS | {"yaml", "yml", "toml", "text"}


@dataclass
class CodeBlock:
    """One fenced code block of a page."""

    page: str
    line: int
    lang: str
    code: str
    marker_kind: str | None = None
    marker_arg: str = ""
    text_above: str = ""
    title: str = ""
    """The fence's ``title="..."`` (Material shows it above the block), often a file name."""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def en_pages() -> list[Path]:
    """English pages (everything under docs/ except docs/zh/)."""
    return sorted(p for p in DOCS.rglob("*.md") if ZH not in p.parents)


def zh_pages() -> list[Path]:
    return sorted(ZH.rglob("*.md"))


def rel(path: Path) -> str:
    """Path of a page relative to its language root (docs/ or docs/zh/)."""
    root = ZH if ZH in path.parents else DOCS
    return path.relative_to(root).as_posix()


def _admonition_above(lines: list[str], index: int) -> str:
    """Visible text of the admonition that ends right above ``lines[index]`` (or "")."""
    i = index - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    body: list[str] = []
    while i >= 0:
        line = lines[i]
        match = ADMONITION.match(line)
        if match:
            return " ".join([match.group("title") or "", *reversed(body)])
        if line.strip() and not line.startswith((" ", "\t")):
            return ""
        body.append(line.strip())
        i -= 1
    return ""


def code_blocks(path: Path) -> list[CodeBlock]:
    """Every fenced code block of a Markdown page, with its marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[CodeBlock] = []
    i = 0
    while i < len(lines):
        match = FENCE_OPEN.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = match.group("indent"), match.group("fence"), match.group("info")
        lang = info.strip().split(" ")[0].lstrip(".").lower() if info.strip() else ""
        start = i
        body: list[str] = []
        i += 1
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        while i < len(lines) and not close.match(lines[i]):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1
        block = CodeBlock(rel(path), start + 1, lang, "\n".join(body) + "\n")
        title = re.search(r'\btitle="([^"]*)"', info)
        block.title = title.group(1) if title else ""
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0:
            marker = MARKER.match(lines[j])
            if marker:
                block.marker_kind = marker.group("kind")
                block.marker_arg = marker.group("arg")
                block.text_above = _admonition_above(lines, j)
        blocks.append(block)
    return blocks


def strip_comments(block: CodeBlock) -> str:
    """The code of a block without comments and blank lines (for EN/ZH comparison)."""
    code = block.code
    if block.lang in PYTHON_LANGS:
        try:
            tokens = [
                t
                for t in tokenize.generate_tokens(io.StringIO(code).readline)
                if t.type != tokenize.COMMENT
            ]
            code = tokenize.untokenize(tokens)
        except (tokenize.TokenError, SyntaxError, IndentationError):
            code = re.sub(r"(^|[ \t])#.*$", "", code, flags=re.MULTILINE)
    elif block.lang in HASH_COMMENT_LANGS:
        code = re.sub(r"(^|[ \t])#.*$", "", code, flags=re.MULTILINE)
    return "\n".join(line.rstrip() for line in code.splitlines() if line.strip())


# --------------------------------------------------------------------------- built HTML


@dataclass
class HtmlPage:
    """What the link and parity checks need from one built page."""

    ids: set[str] = field(default_factory=set)
    links: list[str] = field(default_factory=list)
    assets: list[tuple[str, str]] = field(default_factory=list)
    headings: list[tuple[int, str]] = field(default_factory=list)
    alternates: dict[str, str] = field(default_factory=dict)
    text: str = ""


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = HtmlPage()
        self._article_depth = 0
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.page.ids.add(a["id"])
        if tag == "a" and "name" in a:
            self.page.ids.add(a["name"])
        if tag == "a" and "href" in a:
            self.page.links.append(a["href"])
            if "hreflang" in a:
                self.page.alternates[a["hreflang"]] = a["href"]
        if tag in ("script", "img", "iframe", "source", "audio", "video") and a.get("src"):
            self.page.assets.append((tag, a["src"]))
        if tag == "link" and a.get("href"):
            self.page.assets.append((f"link[{a.get('rel', '')}]", a["href"]))
        if tag == "article":
            self._article_depth += 1
        if self._article_depth and re.fullmatch(r"h[1-6]", tag) and a.get("id"):
            self.page.headings.append((int(tag[1]), a["id"]))

    def handle_endtag(self, tag: str) -> None:
        if tag == "article" and self._article_depth:
            self._article_depth -= 1

    def handle_data(self, data: str) -> None:
        if self._article_depth:
            self._text.append(data)

    def close(self) -> None:
        super().close()
        self.page.text = " ".join(" ".join(self._text).split())


def parse_html(path: Path) -> HtmlPage:
    collector = _Collector()
    collector.feed(path.read_text(encoding="utf-8"))
    collector.close()
    return collector.page


def built_page(site: Path, page_rel: str, lang: str = "en") -> Path:
    """The built HTML file of a source page (``use_directory_urls``)."""
    stem = page_rel[: -len(".md")]
    is_index = stem == "index" or stem.endswith("/index")
    out = stem[: -len("index")] if is_index else stem + "/"
    base = site / "zh" if lang == "zh" else site
    return base / out / "index.html"


def load_hook() -> ModuleType:
    """The MkDocs hook module (docs_hooks/generated.py), imported from its file."""
    path = REPO / "docs_hooks" / "generated.py"
    spec = importlib.util.spec_from_file_location("dmuon_docs_generated", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _TableCollector(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tables: list[list[list[str]]] = []
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._row is not None and self._cell is not None:
            self._row.append(" ".join("".join(self._cell).split()))
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].append(self._row)
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def html_tables(path: Path) -> list[list[list[str]]]:
    """Every table of a built page: rows of cell texts (header row first)."""
    collector = _TableCollector()
    collector.feed(path.read_text(encoding="utf-8"))
    collector.close()
    return collector.tables
