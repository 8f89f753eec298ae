"""Search finds identifiers whole and puts the right page first, in both languages.

Oracle: the theme's own search (Material's search worker with lunr and its language
scripts, from the built site) run in Node.js on each language's built index, with the
queries a reader types. Without Node.js these tests skip, except in CI (``CI=true``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

NODE = shutil.which("node")
RUNNER = Path(__file__).with_name("material_search.js")

if not NODE and os.environ.get("CI") != "true":
    pytest.skip("Node.js is not installed; the search tests run in CI", allow_module_level=True)

#: query -> pages the first result may be on (and for the guide: the one it must be on).
EXPECTED: dict[str, dict[str, tuple[str, ...]]] = {
    "en": {
        "no_sync": ("gradient-accumulation/",),
        "clip_grad_norm_": ("reference/api/", "training/", "faq/"),
        "_accumulated_grad": ("gradient-accumulation/",),
        "zero_grad": ("gradient-accumulation/", "reference/api/"),
    },
    "zh": {
        "no_sync": ("gradient-accumulation/",),
        "clip_grad_norm_": ("reference/api/", "training/", "faq/"),
        "_accumulated_grad": ("gradient-accumulation/",),
        "微批次": ("gradient-accumulation/",),
        "梯度累积": ("gradient-accumulation/",),
        "检查点": ("checkpointing/",),
        "CollectiveTally": ("reference/api/",),  # generated from English docstrings
    },
}


@pytest.fixture(scope="module")
def results(site: Path) -> dict[tuple[str, str], list[dict]]:
    """Every query of EXPECTED, searched once per language."""
    assert NODE, "CI=true but Node.js is not installed"
    found: dict[tuple[str, str], list[dict]] = {}
    for lang, queries in EXPECTED.items():
        root = "zh" if lang == "zh" else "."
        proc = subprocess.run(
            [NODE, str(RUNNER), str(site), root, *queries],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        for line in proc.stdout.splitlines():
            reply = json.loads(line)
            found[(lang, reply["query"])] = reply["pages"]
    return found


CASES = [(lang, query) for lang, queries in EXPECTED.items() for query in queries]


@pytest.mark.parametrize(("lang", "query"), CASES, ids=[f"{lang}-{q}" for lang, q in CASES])
def test_the_right_page_comes_first(
    results: dict[tuple[str, str], list[dict]], lang: str, query: str
) -> None:
    pages = results[(lang, query)]
    assert pages, f"{lang}: {query!r} finds nothing"
    first = pages[0]["page"]
    ranking = [(p["best"], round(p["score"], 1)) for p in pages[:5]]
    assert first in EXPECTED[lang][query], f"{lang}: {query!r} ranks {ranking}"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_an_identifier_is_one_search_term(site: Path, lang: str) -> None:
    """The index keeps ``no_sync`` and ``clip_grad_norm_`` whole: split at ``_``, their
    parts (``no`` is a stop word) matched every page that says ``sync`` or ``grad``."""
    root = site / "zh" if lang == "zh" else site
    index = json.loads((root / "search" / "search_index.json").read_text(encoding="utf-8"))
    separator = re.compile(index["config"]["separator"])
    for identifier, expected in (
        ("dmuon.no_sync(model)", ["dmuon", "no_sync", "model"]),
        ("dmuon.clip_grad_norm_(model, 1.0)", ["dmuon", "clip_grad_norm", "model", "1.0"]),
        ("p._reduced_grad", ["p", "reduced_grad"]),
    ):
        assert [w for w in separator.split(identifier) if w] == expected
