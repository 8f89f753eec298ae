"""What a job's data holds, surveyed the way the recipe reads it, without reading it all.

A file, or every non-hidden, non-empty file of a folder (binary text files skipped, token
files' sidecars not counted); a symbolic link out of the data roots, a token file without
its sidecar, or a folder too large to check is refused with the recipe's message. The
validation split is the recipe's: the last ``VAL_FRACTION`` of a single file's tokens, or
that share of a folder's files.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import dmuon_recipe_contract as contract

#: Validation share of the recipe (``--val-fraction`` default; the server does not set it).
VAL_FRACTION = contract.flag("val_fraction").default
#: Folder entries the data check looks at before it stops counting file sizes.
MAX_FILES_SCANNED = 20_000
#: Folder entries the symbolic-link check looks at; a larger folder is refused.
MAX_ENTRIES_CHECKED = 1_000_000
#: Links outside the data roots a refusal names.
MAX_ESCAPES_REPORTED = 3
_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class DataFiles:
    """What `scan_data` found: sizes by kind, token counts of token files, problems."""

    text_sizes: list[int]
    token_counts: list[int]
    token_vocab: int
    complete: bool
    problem: str | None = None
    token_bytes: int = 0

    @property
    def format(self) -> str:
        """``text``, ``tokens`` or ``mixed`` (records and parquet count as text here)."""
        if self.token_counts and self.text_sizes:
            return "mixed"
        return "tokens" if self.token_counts else "text"


def _is_binary(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return b"\0" in f.read(_BINARY_SNIFF_BYTES)
    except OSError:
        return True


def _token_file(path: Path, shown: str) -> tuple[int, int] | str:
    """``(tokens, vocab_size)`` of a token file, or the recipe's message about it."""
    sidecar = contract.sidecar_path(path)
    if not sidecar.is_file():
        return contract.sidecar_message(shown)
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
        width = contract.TOKEN_DTYPES[meta["dtype"]]
        vocab = int(meta["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return (
            f'--data: sidecar {sidecar.name} of {shown} must be a JSON object with "dtype" '
            f'({", ".join(contract.TOKEN_DTYPES)}) and a positive integer "vocab_size"'
        )
    return path.stat().st_size // width, vocab


def _inside(path: str, roots: tuple[Path, ...]) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == r or real.is_relative_to(r) for r in roots)


@dataclass
class _Walk:
    """The files of a folder the recipe would read, and the links that leave the roots."""

    files: list[Path] = field(default_factory=list)
    complete: bool = True
    escapes: list[str] = field(default_factory=list)
    unchecked: bool = False


def _walk(path: Path, roots: tuple[Path, ...]) -> _Walk:
    """Every entry under the folder ``path``, hidden ones too (``lstat`` only, so the count
    of files does not limit the link check); a link is followed only to see where it ends:
    what the recipe would reach through a link must lie inside a data root, as ``path``
    itself must. Hidden entries and linked folders are not entered (the recipe skips them).
    """
    out = _Walk()
    stack = [path]
    seen = 0
    while stack:
        folder = stack.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > MAX_ENTRIES_CHECKED:
                out.unchecked = True
                return out
            try:
                if entry.is_symlink() and not _inside(entry.path, roots):
                    if len(out.escapes) < MAX_ESCAPES_REPORTED:
                        out.escapes.append(Path(entry.path).relative_to(path).as_posix())
                    continue
                if entry.name.startswith("."):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_symlink() and entry.is_dir():
                    continue
                elif seen > MAX_FILES_SCANNED:
                    out.complete = False
                else:
                    out.files.append(Path(entry.path))
            except OSError:
                continue
    out.files.sort()
    return out


def _refused(problem: str) -> DataFiles:
    return DataFiles([], [], 0, True, problem)


def scan_data(path: Path, shown: str, roots: tuple[Path, ...] = ()) -> DataFiles:
    """The files the recipe would read from ``path`` (``shown`` as the client named it),
    inside the data ``roots``; a link anywhere in a folder must resolve inside one of them.
    """
    if path.is_file():
        if contract.data_kind(path) == "tokens":
            found = _token_file(path, shown)
            if isinstance(found, str):
                return _refused(found)
            return DataFiles([], [found[0]], found[1], True, None, path.stat().st_size)
        return DataFiles([path.stat().st_size], [], 0, True)
    walk = _walk(path, roots)
    if walk.escapes:
        listed = ", ".join(repr(e) for e in walk.escapes)
        return _refused(
            f"{shown} holds symbolic links that lead outside the data roots ({listed}); the "
            "recipe would read what they point to. Remove the links, or copy their files "
            "into a data root"
        )
    if walk.unchecked:
        return _refused(
            f"{shown} has more than {MAX_ENTRIES_CHECKED:,} entries, more than the server "
            "checks for links leading outside the data roots; point train.data at a smaller "
            "folder"
        )
    sizes: list[int] = []
    tokens: list[int] = []
    vocab = token_bytes = 0
    entries = walk.files
    sidecars = {contract.sidecar_path(f) for f in entries if contract.data_kind(f) == "tokens"}
    for f in entries:
        try:
            if f in sidecars or not f.is_file() or f.stat().st_size == 0:
                continue
            kind = contract.data_kind(f)
            if kind == "tokens":
                found = _token_file(f, f.relative_to(path).as_posix())
                if isinstance(found, str):
                    return _refused(found)
                tokens.append(found[0])
                vocab = max(vocab, found[1])
                token_bytes += f.stat().st_size
            elif kind != "text" or not _is_binary(f):
                sizes.append(f.stat().st_size)
        except OSError:
            continue
    return DataFiles(sizes, tokens, vocab, walk.complete, None, token_bytes)


@functools.lru_cache(maxsize=1)
def builtin_corpus() -> tuple[int, int]:
    """Files and bytes of the recipe's default corpus: the standard library's ``*.py``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        for name in filenames:
            if name.endswith(".py"):
                try:
                    total += (Path(dirpath) / name).stat().st_size
                    files += 1
                except OSError:
                    continue
    return files, total


def split_tokens(sizes: list[int]) -> tuple[int, int]:
    """Train and validation tokens the recipe makes of files of these sizes.

    Exact for one file; for a folder the validation files are a hashed choice, so the
    figures assume files of average size.
    """
    total = sum(sizes)
    if len(sizes) <= 1:
        val = max(1, round(total * VAL_FRACTION)) if total else 0
        return total - val, val
    n_val = min(len(sizes) - 1, max(1, math.ceil(VAL_FRACTION * len(sizes))))
    joined = total + len(sizes) - 2  # one newline between files, within each split
    val = round(joined * n_val / len(sizes))
    return joined - val, val
