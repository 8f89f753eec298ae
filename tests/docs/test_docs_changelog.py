"""The changelog follows Keep a Changelog and names the version the packages report."""

from __future__ import annotations

import importlib
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from docs_md import DOCS, ZH

VERSION_HEADING = re.compile(r"^## \[(?P<name>[^\]]+)\](?: - (?P<date>\d{4}-\d{2}-\d{2}))?")
KINDS = {
    "en": {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"},
    "zh": {"新增", "变更", "弃用", "移除", "修复", "安全"},
}


def _sections(text: str) -> list[str]:
    return [m.group("name") for line in text.splitlines() if (m := VERSION_HEADING.match(line))]


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_changelog_versions(lang: str) -> None:
    text = ((ZH if lang == "zh" else DOCS) / "changelog.md").read_text(encoding="utf-8")
    names = _sections(text)
    packaged = {version("dmuon"), version("dmuon-server")}
    assert len(packaged) == 1, f"the two packages report different versions: {packaged}"
    assert names[0] == "Unreleased", names
    assert names[1] == packaged.pop(), f"newest release section {names[1]!r}"
    kinds = set(re.findall(r"^### (\S+)", text, flags=re.MULTILINE))
    assert kinds and kinds <= KINDS[lang], kinds - KINDS[lang]


def test_unreleased_names_modules_that_exist() -> None:
    text = (DOCS / "changelog.md").read_text(encoding="utf-8")
    unreleased = text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
    for module in ("dmuon.optim._orthogonalize", "dmuon._ownership.introspection"):
        assert f"`{module}`" in unreleased
        importlib.import_module(module)
    assert "`benchmarks/naive_muon.py`" in unreleased
    assert (Path(__file__).resolve().parents[2] / "benchmarks" / "naive_muon.py").is_file()
    import dmuon

    for gone in ("NaiveMuon", "naive_muon"):
        assert f"`dmuon.{gone}`" in unreleased
        assert not hasattr(dmuon, gone), f"dmuon.{gone} still exists"
