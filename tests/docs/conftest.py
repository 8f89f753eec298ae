"""Shared fixtures of the documentation tests: one strict build of the whole site."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from docs_md import REPO


@dataclass(frozen=True)
class Build:
    """A finished ``mkdocs build --strict`` of the site."""

    site: Path
    returncode: int
    log: str


def docs_env() -> dict[str, str]:
    """Environment for subprocesses of the docs tests: CPU only, quiet, venv first on PATH."""
    env = dict(os.environ)
    env["NO_MKDOCS_2_WARNING"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    # The training recipe caches its tokenized corpus here instead of in ~/.cache/dmuon.
    env.setdefault("DMUON_CACHE_DIR", str(Path(tempfile.gettempdir()) / "dmuon-docs-cache"))
    return env


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    site = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env=docs_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return Build(site=site, returncode=proc.returncode, log=proc.stdout + proc.stderr)


@pytest.fixture(scope="session")
def site(build: Build) -> Path:
    """The built site; tests that need it fail (not error) if the strict build failed."""
    if build.returncode != 0:
        pytest.fail("mkdocs build --strict failed:\n" + build.log[-6000:])
    return build.site
