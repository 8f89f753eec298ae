"""The torch versions the docs name are the ones the package accepts and the results ran on.

Oracles: the committed results (``benchmarks/results/*.json`` record ``torch.__version__``
of the machine they ran on; the CUDA tests ran in the same session as the GPU runs), the
package's own requirement (``packages/dmuon-core/pyproject.toml``) and the pin the
Makefile installs (``constraints.txt``).
"""

from __future__ import annotations

import json
import re
from html import unescape as html_unescape
from pathlib import Path

import pytest
from docs_md import REPO, built_page, html_tables
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

RESULTS = REPO / "benchmarks" / "results"


def _requirement() -> Requirement:
    pyproject = (REPO / "packages/dmuon-core/pyproject.toml").read_text()
    found = re.search(r'^\s*"(torch[<>=!~][^"]*)",', pyproject, re.M)
    assert found, "packages/dmuon-core/pyproject.toml has no torch dependency"
    return Requirement(found.group(1))


def _result_versions() -> dict[str, set[str]]:
    """``gpu`` / ``cpu`` -> the torch releases (major.minor.micro) results were taken on."""
    found: dict[str, set[str]] = {"gpu": set(), "cpu": set()}
    for path in RESULTS.glob("*.json"):
        data = json.loads(path.read_text())
        records = data if isinstance(data, list) else [data]
        for record in records:
            machine = record.get("machine", {}) if isinstance(record, dict) else {}
            if "torch" in machine:
                release = Version(machine["torch"].split("+")[0]).base_version
                found["gpu" if "gpu" in machine else "cpu"].add(release)
    return found


def test_the_package_accepts_every_release_results_ran_on() -> None:
    requirement = _requirement()
    versions = _result_versions()
    assert versions["gpu"] and versions["cpu"]
    for release in versions["gpu"] | versions["cpu"]:
        assert requirement.specifier.contains(release), (release, str(requirement))
    # ... and no older minor release than the oldest tested one.
    oldest = min(Version(v) for v in versions["gpu"] | versions["cpu"])
    assert not requirement.specifier.contains(f"{oldest.major}.{oldest.minor - 1}.0")


def test_a_fresh_clone_installs_the_release_the_suite_runs_on() -> None:
    """``make setup`` installs torch==X from constraints.txt; X is accepted, and the CPU
    results ran on it."""
    pin = re.search(r"^torch==(\S+)$", (REPO / "constraints.txt").read_text(), re.M)
    assert pin, "constraints.txt pins torch"
    makefile = (REPO / "Makefile").read_text()
    assert f"torch=={pin.group(1)}" in makefile
    assert _requirement().specifier.contains(pin.group(1))
    assert _result_versions()["cpu"] == {pin.group(1)}


def _stated_requirements(text: str) -> list[SpecifierSet]:
    """Every ``torch>=A,<B`` the text gives."""
    plain = html_unescape(re.sub(r"<wbr>", "", text))
    found = re.findall(r"torch((?:[<>=!]=?[\d.]+,?)+)", plain)
    return [SpecifierSet(spec.rstrip(",")) for spec in found]


@pytest.mark.parametrize("page", ["installation.md", "compatibility.md"])
@pytest.mark.parametrize("lang", ["en", "zh"])
def test_pages_state_the_requirement_of_the_package(site: Path, page: str, lang: str) -> None:
    stated = _stated_requirements(built_page(site, page, lang).read_text(encoding="utf-8"))
    assert stated and all(spec == _requirement().specifier for spec in stated), stated


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_compatibility_page_names_the_tested_releases(site: Path, lang: str) -> None:
    """The table of what ran on which release names every release a result ran on, the
    CUDA tests on the GPU release and the whole suite on the CPU one."""
    tested = next(
        t for t in html_tables(built_page(site, "compatibility.md", lang)) if t[0][0] == "torch"
    )
    rows = {re.match(r"[\d.]+", row[0]).group(0): row for row in tested[1:]}
    found = _result_versions()
    for release in found["gpu"]:
        assert "CUDA" in rows[release][0] and "test_cuda.py" in rows[release][1]
    for release in found["cpu"]:
        assert "make test" in rows[release][1]
