"""A checkpoint folder's manifest: which files it holds, their sizes and checksums.

A DCP checkpoint is one folder of files written by every rank (``__R_0.distcp``) and a
``.metadata`` file. A save cut short (a full disk, a killed job, a bad copy) can leave a
file missing, shorter than written or changed, and torch's loader then fails deep inside
its unpickler without naming the file. `write_manifest` runs once every file is written:
it flushes each file and the folder to disk (``fsync``), records each file's size and
SHA-256, and writes ``dmuon-manifest.json`` last, atomically. `verify_checkpoint` checks a
folder against its manifest without loading anything: a folder without a manifest is
incomplete, and a missing, truncated or altered file is named.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import dmuon_recipe_contract as contract

__all__ = [
    "MANIFEST",
    "CheckpointDamagedError",
    "check",
    "fsync_dir",
    "fsync_tree",
    "replace_folder",
    "verify_checkpoint",
    "write_manifest",
]

MANIFEST = contract.MANIFEST_FILE
"""The manifest's file name inside a checkpoint folder."""

FORMAT = 1


class CheckpointDamagedError(ValueError):
    """A checkpoint folder fails its manifest: the message names the folder and the files."""


# Reading and verifying belong to the recipe's contract: the job service checks the same
# way without importing dmuon.
_digest = contract.file_sha256
_read = contract.read_manifest


def verify_checkpoint(folder: str | os.PathLike[str], checksums: bool = True) -> list[str]:
    """The problems of a checkpoint folder against its manifest; ``[]`` when it is whole.

    ``checksums=False`` checks presence and sizes only (no file is read).
    """
    return contract.checkpoint_problems(folder, checksums)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def replace_folder(tmp: Path, final: Path, old: Path) -> None:
    """Rename the finished folder ``tmp`` to ``final``; a ``final`` already there is moved
    to ``old`` first and removed afterwards, so ``final`` never holds a mix of both."""
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike[str]) -> None:
    """Flush every file under ``folder``, and the folders themselves, to disk."""
    root = Path(folder)
    for path in _files(root):
        with path.open("rb") as f:
            os.fsync(f.fileno())
    for directory in sorted({p.parent for p in _files(root)} | {root}):
        fsync_dir(directory)


def write_manifest(folder: str | os.PathLike[str]) -> Path:
    """Flush ``folder`` to disk and write its manifest last (call once, after every rank's
    files are written); returns the manifest's path.

    Raises:
        OSError: a file could not be read or the manifest not written (a full disk, say);
            the folder then has no manifest and counts as incomplete.
    """
    root = Path(folder)
    fsync_tree(root)
    entries = {
        path.relative_to(root).as_posix(): {"bytes": path.stat().st_size, "sha256": _digest(path)}
        for path in _files(root)
    }
    manifest = root / MANIFEST
    partial = root / f".{MANIFEST}.tmp"
    with partial.open("w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "files": entries}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    partial.replace(manifest)
    fsync_dir(root)
    return manifest


def check(folder: str | os.PathLike[str]) -> None:
    """Raise `CheckpointDamagedError` naming the folder and its problems, if it has any."""
    problems = verify_checkpoint(folder)
    if problems:
        raise CheckpointDamagedError(
            f"the checkpoint {folder} is damaged: " + "; ".join(problems) + ". Resume from an "
            "earlier checkpoint, or save again."
        )
