"""Tables that restate the code list exactly what the code has, in both languages.

Flags of ``dmuon-server`` (job service page), the job
states, and the keys of the metrics file: a change in the code fails here until both
languages follow.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import pytest
from docs_md import DOCS, ZH


def _server_parser() -> argparse.ArgumentParser:
    from dmuon_server.cli import build_parser

    return build_parser()


# The recipe's flag table is rendered from its parser (test_docs_recipe_tables.py checks it).
TABLES: dict[str, tuple[str, str, Callable[[], argparse.ArgumentParser]]] = {
    "dmuon-server": ("job-service.md", "{#starting}", _server_parser),
}


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags: set[str] = set()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:  # internal, such as --token-fd
            continue
        flags.update(s for s in action.option_strings if s.startswith("--") and s != "--help")
    return flags


def table_flags(text: str, anchor: str) -> set[str]:
    section = text.split(anchor, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(--[a-z0-9-]+)", section, flags=re.MULTILINE))


@pytest.mark.parametrize("lang", ["en", "zh"])
@pytest.mark.parametrize("program", sorted(TABLES))
def test_flag_table_matches_the_parser(program: str, lang: str) -> None:
    page, anchor, parser = TABLES[program]
    root = ZH if lang == "zh" else DOCS
    documented = table_flags((root / page).read_text(encoding="utf-8"), anchor)
    actual = parser_flags(parser())
    assert actual - documented == set(), (
        f"{program} flags missing from {page}: {actual - documented}"
    )
    assert documented - actual == set(), (
        f"{page} lists flags {program} lacks: {documented - actual}"
    )


def table_first_column(text: str, anchor: str) -> set[str]:
    section = text.split(anchor, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)`", section, flags=re.MULTILINE))


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_job_states_table(lang: str) -> None:
    from dmuon_server.schemas import ALL_STATES

    root = ZH if lang == "zh" else DOCS
    text = (root / "job-service.md").read_text(encoding="utf-8")
    assert table_first_column(text, "{#states}") == set(ALL_STATES)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_metrics_file_keys_table(lang: str) -> None:
    from dmuon_recipe_contract import OPTIONAL_METRIC_KEYS

    from dmuon.train.reporting.metrics_file import REQUIRED_KEYS

    root = ZH if lang == "zh" else DOCS
    text = (root / "training.md").read_text(encoding="utf-8")
    assert table_first_column(text, "{#metrics-file}") == {*REQUIRED_KEYS, *OPTIONAL_METRIC_KEYS}


def _code_strings() -> str:
    """Every string literal of the packages, f-string holes shown as NUL, one per line."""
    import ast

    roots = [DOCS.parent / "packages" / name / "src" for name in ("dmuon-core", "dmuon-server")]
    out: list[str] = []
    for root in roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    out.append(node.value)
                elif isinstance(node, ast.JoinedStr):
                    out.append(
                        "".join(
                            v.value if isinstance(v, ast.Constant) else "\0" for v in node.values
                        )
                    )
    return "\n".join(out)


PLACEHOLDERS_AND_PUNCTUATION = (
    r"\.\.\.|\bDIR/step_N\b|\bN\b|\bM\b|0\.0\.0\.0|DMUON_SERVER_TOKEN|; |, |: |\(|\)|'"
)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_troubleshooting_table_messages_exist_in_the_code(lang: str) -> None:
    """Messages quoted in the recipe and job-service tables are the code's own words.

    Placeholders (``...``, ``N``, ``M``, an address) stand for the values of one occurrence, so each
    message is cut at placeholders and punctuation, and its longest piece (when at least 20
    characters long) must appear in a string literal of the code.
    """
    root = ZH if lang == "zh" else DOCS
    text = (root / "troubleshooting.md").read_text(encoding="utf-8")
    code = _code_strings()
    problems = []
    for anchor in ("{#recipe}", "{#job-service}"):
        section = text.split(anchor, 1)[1].split("\n## ", 1)[0]
        for row in re.findall(r"^\| (?:`\d{3}`[:：] ?)?`([^`]+)`", section, flags=re.MULTILINE):
            # argparse's own prefix, and the values of this one occurrence, are not the code's.
            message = re.sub(
                r"^dmuon-(?:train|server): (?:error|warning): (argument --[a-z-]+: )?", "", row
            )
            pieces = re.split(PLACEHOLDERS_AND_PUNCTUATION, message)
            longest = max((piece.strip() for piece in pieces), key=len)
            if len(longest) >= 20 and longest not in code:
                problems.append(f"{row!r}: {longest!r} is not in the code")
    assert not problems, "\n".join(problems)
