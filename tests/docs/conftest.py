"""Shared fixtures of the documentation tests: one strict build of the whole site."""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=1)
def _root_shims() -> str | None:
    """As root, a folder whose ``dmuon-server`` adds ``--allow-same-user-jobs``, else None.

    The pages' examples are written for a workstation, where the server runs jobs as the
    person who started it. A root server refuses to start until told which account runs
    its jobs (job-service.md#isolation); here, the examples' own account, as elsewhere.
    """
    if os.geteuid() != 0:
        return None
    shims = Path(tempfile.mkdtemp(prefix="dmuon-docs-shims-"))
    real = Path(sys.executable).parent / "dmuon-server"
    shim = shims / "dmuon-server"
    shim.write_text(f'#!/bin/sh\nexec "{real}" --allow-same-user-jobs "$@"\n')
    shim.chmod(0o755)
    return str(shims)


def docs_env() -> dict[str, str]:
    """Environment for subprocesses of the docs tests: CPU only, quiet, venv first on PATH
    (as root, behind :func:`_root_shims`)."""
    env = dict(os.environ)
    env["NO_MKDOCS_2_WARNING"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    shims = _root_shims()
    if shims is not None:
        env["PATH"] = shims + os.pathsep + env["PATH"]
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
