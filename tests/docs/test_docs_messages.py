"""Every error message the troubleshooting page quotes is one the code can print.

A reader who searches the code (or the output) for a quoted message must find it. Oracle:
the string literals and f-strings of ``packages/*/src``, read with ``ast``. Each becomes a
pattern: its literal text exactly, each ``{...}`` any text. Where an f-string formats a
parameter that every call in its module passes as a string constant (the recipe's
``the {what} split has ...``, called with ``"training"`` and ``"validation"``), the pattern
takes only those constants. A quoted message matches when it is one pattern, or several in
a row (messages assembled from parts); the page's placeholders (``N``, ``...``) stand for
formatted values, and a trailing ``...`` for the rest of a long message (a prefix of a
pattern, found with the ``regex`` module's partial matching).

Quoted messages: the lines of the ``text`` blocks and the first code span of each row of a
"message" table, on the English and the Chinese page (which quotes the same English text).
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import regex
from docs_md import DOCS, REPO, ZH, code_blocks

PAGES = [DOCS / "troubleshooting.md", ZH / "troubleshooting.md"]
SOURCES = sorted((REPO / "packages").glob("*/src/**/*.py"))
#: What the page puts before the code's own text: the exception type (the recipe's own
#: ``StepFailed`` and ``TrainingDiverged`` included), argparse's prefixes, an HTTP status
#: shown as its own code span.
PREFIX = re.compile(
    r"^(?:(?:[A-Z]\w*(?:Error|Exception|Warning)|StepFailed|TrainingDiverged): )?"
    r"(?:[\w.-]+(?: export)?: error: )?(?:argument --[\w-]+: )?"
)
ELLIPSIS = re.compile(r"\s*(?:\.{3,4}|…)\s*$")
#: ``str.format`` fields left in a literal (``"... ({}) ...".format(x)``).
FORMAT_FIELD = re.compile(r"\\\{\w*\\\}")
#: Literal text a pattern needs to stand on its own (shorter pieces match too easily).
MIN_LITERAL = 12
MESSAGE_HEADERS = {"message", "信息", "错误信息"}


@dataclass(frozen=True)
class Pattern:
    regex: regex.Pattern[str]
    where: str


class _Collector(ast.NodeVisitor):
    """String patterns of one module, with the constants its calls pass to each parameter."""

    def __init__(self, tree: ast.Module, where: str) -> None:
        self.where = where
        self.patterns: list[Pattern] = []
        self.functions: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        self.inner: set[int] = set()
        self.calls: dict[str, list[ast.Call]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                self.inner.update(id(v) for v in node.values)
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name:
                    self.calls.setdefault(name, []).append(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and id(node) not in self.inner:
            self._add(re.escape(node.value), len(node.value), node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        parts, literal = [], 0
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(re.escape(str(value.value)))
                literal += len(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                choices = self._constants_for(value.value)
                if choices:
                    parts.append("(?:" + "|".join(map(re.escape, choices)) + r"|\.\.\.)")
                else:
                    parts.append(".*?")
        self._add("".join(parts), literal, node)

    def _add(self, source: str, literal: int, node: ast.AST) -> None:
        if literal >= MIN_LITERAL:
            where = f"{self.where}:{getattr(node, 'lineno', '?')}"
            source = FORMAT_FIELD.sub(".*?", source)
            self.patterns.append(Pattern(regex.compile(source, regex.S), where))

    def _constants_for(self, expr: ast.expr) -> list[str]:
        """The string constants every call passes for ``expr``, a parameter of the
        enclosing function; empty if any call passes something else (or there is none)."""
        if not isinstance(expr, ast.Name) or not self.functions:
            return []
        function = self.functions[-1]
        names = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
        if expr.id not in names:
            return []
        index = names.index(expr.id)
        values = []
        for call in self.calls.get(function.name, []):
            passed = next((k.value for k in call.keywords if k.arg == expr.id), None)
            if passed is None and index < len(call.args):
                passed = call.args[index]
            if not (isinstance(passed, ast.Constant) and isinstance(passed.value, str)):
                return []
            values.append(passed.value)
        return sorted(set(values))


@functools.cache
def patterns() -> tuple[Pattern, ...]:
    found: list[Pattern] = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        collector = _Collector(tree, str(path.relative_to(REPO)))
        collector.visit(tree)
        found.extend(collector.patterns)
    return tuple(found)


def matching(message: str) -> list[str] | None:
    """The patterns (their source lines) that together print ``message``, or None."""
    text = PREFIX.sub("", message, count=1)
    # Breadth-first over positions in the message; each step consumes one pattern.
    frontier: dict[int, list[str]] = {0: []}
    seen: set[int] = set()
    while frontier:
        pos, used = frontier.popitem()
        if pos in seen:
            continue
        seen.add(pos)
        rest = text[pos:]
        if not rest.strip() or (used and ELLIPSIS.fullmatch(rest)):
            return used
        cut = ELLIPSIS.search(rest)
        head = text[: pos + cut.start()] if cut else None  # quoted up to a trailing "..."
        for pattern in patterns():
            if pattern.regex.fullmatch(text, pos):
                return [*used, pattern.where]
            if head is not None and len(head) > pos:
                start = pattern.regex.match(head, pos, partial=True)
                if start and start.end() == len(head):
                    return [*used, pattern.where]
            match = pattern.regex.match(text, pos)
            if match and match.end() > pos:
                end = match.end()
                while end < len(text) and text[end] == " ":
                    end += 1
                frontier.setdefault(end, [*used, pattern.where])
    return None


def quoted_messages(page: Path) -> list[str]:
    """The messages a troubleshooting page quotes: ``text`` block lines and the first code
    span of every row of a message table."""
    messages = [
        line.strip()
        for block in code_blocks(page)
        if block.lang == "text"
        for line in block.code.splitlines()
        if line.strip()
    ]
    in_table = False
    for line in page.read_text(encoding="utf-8").splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        )
        if not cells:
            in_table = False
        elif cells[0] in MESSAGE_HEADERS:
            in_table = True
        elif in_table and not set(cells[0]) <= set("-: "):
            spans = re.findall(r"`([^`]+)`", cells[0])
            if spans:
                messages.append(max(spans, key=len))
    return messages


MESSAGES = [(page, message) for page in PAGES for message in quoted_messages(page)]


def test_the_page_quotes_messages() -> None:
    for page in PAGES:
        assert len(quoted_messages(page)) >= 40, page


@pytest.mark.parametrize(
    ("page", "message"),
    MESSAGES,
    ids=[f"{p.relative_to(DOCS)}:{m[:50]}" for p, m in MESSAGES],
)
def test_quoted_message_is_in_the_code(page: Path, message: str) -> None:
    assert matching(message) is not None, (
        f"{page.relative_to(DOCS)} quotes a message no string of packages/*/src prints:\n{message}"
    )


def test_a_misquoted_message_is_caught() -> None:
    """The check itself: the recipe says "training split", never "train split"."""
    good = (
        "the training split has N tokens, fewer than --seq-len + 1 = ...; "
        "use a shorter --seq-len or more text"
    )
    assert matching(good) is not None
    assert matching(good.replace("training", "train")) is None
    assert matching(good.replace("training", "validation")) is not None
