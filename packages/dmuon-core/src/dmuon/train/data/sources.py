"""What ``--data`` names: the files the recipe reads, checked before anything is read.

``--data`` takes a file or a folder. A folder is read recursively, in the order of the
files' paths relative to it; hidden files and folders (names starting with ``.``) and
empty files are skipped. Each file is read by its suffix (`dmuon_recipe_contract.data_kind`):

* ``.jsonl`` / ``.json``: records; each one's ``--text-field`` is a document (a ``.json``
  file is JSON lines too, or one JSON array of objects);
* ``.parquet``: records, read with pyarrow one row group batch at a time;
* ``.bin``: tokens already made (uint16 or uint32, little-endian) with a ``FILE.bin.json``
  sidecar ``{"dtype": ..., "vocab_size": ...}``; memory-mapped, never read whole. A folder
  of token files holds nothing else (their sidecars aside);
* anything else: a text document (a file with a NUL byte in its first 8 KiB is binary and
  skipped).

Every file read must resolve inside the folder: a symbolic link that points outside it
is refused, naming the link, so a data folder cannot pull in files from elsewhere. Under
the job service a link may also lead into one of the service's data roots (the folders in
``DMUON_DATA_ROOTS``, `dmuon_recipe_contract.DATA_ROOTS_ENV`), which the service checked.
Without ``--data`` the corpus is the source of the running interpreter's standard library
(every non-empty ``*.py`` file; site-packages and dist-packages excluded).

The train/validation split is by file and deterministic: each file gets the key
``blake2b(relative path)`` and the ``ceil(val_fraction * n)`` files with the smallest keys
are validation (at least one, and at least one stays in train). A corpus of one file is
split by tokens instead: the last ``val_fraction`` of them are validation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import dmuon_recipe_contract as contract

__all__ = [
    "SourceFile",
    "TokenFileInfo",
    "list_source_files",
    "read_sidecar",
    "split_files",
    "stdlib_root",
]

_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class SourceFile:
    """One file of the corpus: where it is, its path relative to the root, how it is read."""

    path: Path
    relative: str
    kind: contract.DataKind


@dataclass(frozen=True)
class TokenFileInfo:
    """A ``.bin`` token file's sidecar: element type, vocabulary size, token count."""

    dtype: str
    vocab_size: int
    tokens: int


def stdlib_root() -> Path:
    """The standard-library source folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _looks_binary(path: Path) -> bool:
    with path.open("rb") as handle:
        return b"\0" in handle.read(_BINARY_SNIFF_BYTES)


def read_sidecar(path: Path, shown: str | None = None) -> TokenFileInfo:
    """Read and check the sidecar of token file ``path``.

    Raises:
        ValueError: no sidecar, a malformed one, or a file size that is not a whole
            number of tokens; the message names the file.
    """
    shown = shown or str(path)
    sidecar = contract.sidecar_path(path)
    dtypes = ", ".join(contract.TOKEN_DTYPES)
    example = '{"dtype": "uint16", "vocab_size": 50257}'
    if not sidecar.is_file():
        raise ValueError(contract.sidecar_message(shown))
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--data: sidecar {sidecar} is not JSON ({exc})") from None
    dtype = meta.get("dtype") if isinstance(meta, dict) else None
    vocab = meta.get("vocab_size") if isinstance(meta, dict) else None
    if dtype not in contract.TOKEN_DTYPES or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(
            f'--data: sidecar {sidecar} must be a JSON object with "dtype" ({dtypes}) and '
            f'a positive integer "vocab_size", e.g. {example}; it holds {meta!r}'
        )
    size = path.stat().st_size
    width = contract.TOKEN_DTYPES[dtype]
    if size % width:
        raise ValueError(
            f"--data: token file {shown} has {size} bytes, not a whole number of {dtype} "
            f"tokens ({width} bytes each); the file is cut short or its sidecar's dtype is wrong"
        )
    return TokenFileInfo(dtype, vocab, size // width)


def _allowed_roots() -> tuple[Path, ...]:
    """The data roots of the job service a link may lead into (`contract.DATA_ROOTS_ENV`)."""
    listed = os.environ.get(contract.DATA_ROOTS_ENV, "")
    return tuple(Path(os.path.realpath(p)) for p in listed.split(os.pathsep) if p)


def _outside(root: Path, entry: Path, roots: tuple[Path, ...] = ()) -> str | None:
    """The target of a link ``entry`` when it resolves outside ``root`` and ``roots``,
    else None."""
    if not entry.is_symlink():
        return None
    target = entry.resolve()
    inside = any(target.is_relative_to(r) for r in (root, *roots))
    return None if inside else str(target)


def _walk(path: str, source: Path) -> list[Path]:
    found: list[Path] = []
    roots = _allowed_roots()
    for dirpath, dirnames, filenames in os.walk(source, followlinks=False):
        here = Path(dirpath)
        kept = []
        for name in sorted(dirnames):
            if name.startswith("."):
                continue
            entry = here / name
            target = _outside(source, entry, roots)
            if target is not None:
                relative = entry.relative_to(source).as_posix()
                raise ValueError(contract.link_message(path, relative, target, str(source)))
            if not entry.is_symlink():  # a link within the folder: read through its target
                kept.append(name)
        dirnames[:] = kept
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            entry = here / name
            target = _outside(source, entry, roots)
            if target is not None:
                relative = entry.relative_to(source).as_posix()
                raise ValueError(contract.link_message(path, relative, target, str(source)))
            if entry.is_file() and entry.stat().st_size > 0:
                found.append(entry)
    return found


#: Folders of the standard library that hold installed packages, not its source.
_INSTALLED_PACKAGES = frozenset({"site-packages", "dist-packages"})


def _stdlib_files(root: Path) -> list[Path]:
    """Every non-empty ``*.py`` file under ``root``, the installed-package folders left
    unwalked (they hold most of the tree's files); directory links are not followed, as
    `pathlib.Path.rglob` does not follow them."""
    found = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _INSTALLED_PACKAGES]
        for name in names:
            if name.endswith(".py"):
                file = Path(here, name)
                if file.is_file() and file.stat().st_size > 0:
                    found.append(file)
    return found


def list_source_files(path: str | os.PathLike[str] | None = None) -> tuple[Path, list[SourceFile]]:
    """Resolve the corpus source and list its files, sorted by relative path.

    Args:
        path: a file, a folder, or ``None`` for the standard library.

    Returns:
        ``(root, files)`` where ``root`` is the folder the relative paths are taken from
        (the parent for a single file).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: an empty file, a folder without a usable file, a link out of the
            folder, a token file without its sidecar, or token files mixed with text.
    """
    if path is None:
        root = stdlib_root()
        files = [SourceFile(f, f.relative_to(root).as_posix(), "text") for f in _stdlib_files(root)]
        if not files:
            raise ValueError(
                f"found no *.py files under the standard library folder {root}; "
                "pass --data PATH with a text file or folder instead"
            )
        return root, sorted(files, key=lambda f: f.relative)

    source = Path(path).expanduser()
    if not source.exists():
        raise FileNotFoundError(
            f"--data {str(path)!r} does not exist; pass an existing file or folder (text, "
            ".jsonl, .json, .parquet, or .bin token files), or omit --data to use the Python "
            "standard library"
        )
    source = source.resolve()
    if source.is_file():
        if source.stat().st_size == 0:
            raise ValueError(f"--data {str(path)!r} is an empty file; pass a file with text")
        kind = contract.data_kind(source)
        if kind == "tokens":
            read_sidecar(source, str(path))
        return source.parent, [SourceFile(source, source.name, kind)]
    if not source.is_dir():
        raise ValueError(f"--data {str(path)!r} is neither a regular file nor a folder")

    entries = _walk(str(path), source)
    token_files = {f for f in entries if contract.data_kind(f) == "tokens"}
    sidecars = {contract.sidecar_path(f) for f in token_files}
    files: list[SourceFile] = []
    for f in entries:
        if f in sidecars:
            continue
        kind = contract.data_kind(f)
        if kind == "text" and _looks_binary(f):
            continue
        files.append(SourceFile(f, f.relative_to(source).as_posix(), kind))
    if not files:
        raise ValueError(
            f"--data {str(path)!r} is a folder without any non-empty file to read (hidden "
            "and binary files are skipped); put text, .jsonl, .parquet or .bin files in it"
        )
    kinds = {f.kind for f in files}
    if "tokens" in kinds and len(kinds) > 1:
        text = next(f.relative for f in files if f.kind != "tokens")
        raise ValueError(
            f"--data {str(path)!r} mixes .bin token files with files to tokenize (such as "
            f"{text}); keep token files in a folder of their own"
        )
    for f in files:
        if f.kind == "tokens":
            read_sidecar(f.path, f.relative)
    return source, sorted(files, key=lambda f: f.relative)


def _file_key(relative: str) -> bytes:
    return hashlib.blake2b(relative.encode("utf-8"), digest_size=16).digest()


def split_files(relative_paths: Iterable[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """Split relative paths into ``(train, val)`` deterministically by hashed name.

    The ``ceil(val_fraction * n)`` paths with the smallest ``blake2b`` keys are
    validation, clamped to ``[1, n - 1]``; both lists keep sorted order. Needs at least
    two paths.

    Raises:
        ValueError: fewer than two paths, or ``val_fraction`` outside ``(0, 1)``.
    """
    paths = sorted(relative_paths)
    if len(paths) < 2:
        raise ValueError("a split by file needs at least two files")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = min(max(1, math.ceil(val_fraction * len(paths))), len(paths) - 1)
    val = set(sorted(paths, key=_file_key)[:n_val])
    return [p for p in paths if p not in val], [p for p in paths if p in val]
