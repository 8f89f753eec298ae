"""Flag tables list exactly the flags of the programs they document.

The training guide documents ``dmuon-train`` and the job service page ``dmuon-server``; a
flag added to or removed from either parser fails here until both languages follow.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import pytest
from docs_md import DOCS, ZH


def _recipe_parser() -> argparse.ArgumentParser:
    from dmuon.train.cli import build_parser

    return build_parser()


def _server_parser() -> argparse.ArgumentParser:
    from dmuon_server.cli import build_parser

    return build_parser()


TABLES: dict[str, tuple[str, str, Callable[[], argparse.ArgumentParser]]] = {
    "dmuon-train": ("training.md", "{#flags}", _recipe_parser),
    "dmuon-server": ("job-service.md", "{#starting}", _server_parser),
}


def parser_flags(parser: argparse.ArgumentParser) -> set[str]:
    flags: set[str] = set()
    for action in parser._actions:
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
