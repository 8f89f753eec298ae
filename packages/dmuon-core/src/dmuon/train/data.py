"""Offline byte-level text corpus and the deterministic global-batch sampler.

Corpus
------
By default the corpus is the source of the Python standard library of the running
interpreter: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site-packages
and dist-packages excluded). ``--data PATH`` takes any text file or folder instead; in a
folder every regular file is read recursively, except hidden files/folders (names starting
with ``.``) and binary files (a NUL byte in the first 8 KiB).

Text is tokenized as raw bytes (vocabulary 256); files are joined with one ``\\n``.

Train/validation split, by file and deterministic: each file gets the key
``blake2b(relative path)``; the ``ceil(val_fraction * n_files)`` files with the smallest
keys form the validation set (at least one file, and at least one file stays in train).
The split therefore depends only on the set of relative paths, not on listing order or
on the machine. A corpus of a single file is split by bytes instead: the last
``val_fraction`` of it is validation.

The tokenized corpus is cached once under ``cache_dir`` (default ``$DMUON_CACHE_DIR`` or
``~/.cache/dmuon``) in a file whose name hashes the resolved paths, sizes and
modification times of the source files plus the split fraction, so editing a file or
changing the split rebuilds it. Writes are atomic (temporary file + ``os.replace``), so
several ranks may build the same cache at once.

Sampling rule (the equivalence contract)
----------------------------------------
The batch of optimizer step ``s`` (1-based) is defined on the **global** batch, never per
rank: ``G = world_size * accum_steps * micro_batch_size`` windows of ``seq_len + 1``
tokens whose start offsets are ``torch.randint`` draws from a generator seeded by
``(seed, s)`` alone. Rank ``r`` takes the ``r``-th contiguous block of
``accum_steps * micro_batch_size`` windows and cuts it, in order, into ``accum_steps``
micro-batches of ``micro_batch_size``.

Hence any two runs with the same seed and the same ``G`` see exactly the same sequences
at every step, whatever the split between processes, accumulation and micro-batch size
is: ``torchrun --nproc_per_node 2`` with micro-batch ``m`` matches one process with
micro-batch ``2m`` (or accumulation ``2k``), and accumulation 4 x micro-batch 2 matches
accumulation 1 x micro-batch 8. Because every micro-batch holds the same number of
tokens, the mean over micro-batches (loss divided by ``accum_steps``) and the average
over ranks equal the mean over the global batch.

Validation uses ``n`` fixed windows evenly spaced over the validation stream (independent
of the seed), rounded up to a multiple of the world size and split into contiguous
per-rank blocks; the loss is the token-weighted mean over all of them.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

__all__ = [
    "CACHE_FORMAT",
    "Corpus",
    "GlobalBatchSampler",
    "default_cache_dir",
    "list_source_files",
    "load_corpus",
    "split_files",
    "stdlib_root",
    "validation_windows",
]

CACHE_FORMAT = 1
"""Bumped whenever the cache layout or tokenization changes."""

_BINARY_SNIFF_BYTES = 8192


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus.

    Attributes:
        train: 1-D ``torch.uint8`` tensor of training tokens (bytes).
        val: 1-D ``torch.uint8`` tensor of validation tokens.
        source: the file or folder the text came from.
        train_files: number of files in the training split.
        val_files: number of files in the validation split (0 for a byte split).
        cache_path: the cache file backing this corpus.
        from_cache: whether this call read the cache instead of the source files.
    """

    train: Tensor
    val: Tensor
    source: str
    train_files: int
    val_files: int
    cache_path: Path
    from_cache: bool

    @property
    def vocab_size(self) -> int:
        """Always 256: tokens are bytes."""
        return 256


def stdlib_root() -> Path:
    """The standard-library source folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def default_cache_dir() -> Path:
    """``$DMUON_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/dmuon`` or ``~/.cache/dmuon``."""
    explicit = os.environ.get("DMUON_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dmuon"


def _is_hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _looks_binary(path: Path) -> bool:
    with path.open("rb") as handle:
        return b"\0" in handle.read(_BINARY_SNIFF_BYTES)


def list_source_files(path: str | os.PathLike[str] | None = None) -> tuple[Path, list[Path]]:
    """Resolve the corpus source and list its files, sorted by relative path.

    Args:
        path: a text file, a folder, or ``None`` for the standard library.

    Returns:
        ``(root, files)`` where ``root`` is the folder the relative paths are taken
        from (the parent for a single file).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is an empty file or a folder without any text file.
    """
    if path is None:
        root = stdlib_root()
        files = [
            f
            for f in root.rglob("*.py")
            if f.is_file()
            and not {"site-packages", "dist-packages"} & set(f.relative_to(root).parts)
        ]
        if not files:
            raise ValueError(
                f"found no *.py files under the standard library folder {root}; "
                "pass --data PATH with a text file or folder instead"
            )
        return root, sorted(files, key=lambda f: f.relative_to(root).as_posix())

    source = Path(path).expanduser()
    if not source.exists():
        raise FileNotFoundError(
            f"--data {str(path)!r} does not exist; pass an existing text file or a folder "
            "of text files (or omit --data to use the Python standard library)"
        )
    source = source.resolve()
    if source.is_file():
        if source.stat().st_size == 0:
            raise ValueError(f"--data {str(path)!r} is an empty file; pass a file with text")
        return source.parent, [source]
    if not source.is_dir():
        raise ValueError(f"--data {str(path)!r} is neither a regular file nor a folder")
    files = []
    for f in source.rglob("*"):
        rel = f.relative_to(source)
        if not f.is_file() or _is_hidden(rel) or f.stat().st_size == 0:
            continue
        if _looks_binary(f):
            continue
        files.append(f)
    if not files:
        raise ValueError(
            f"--data {str(path)!r} is a folder without any non-empty text file "
            "(hidden and binary files are skipped); put text files in it or pass a file"
        )
    return source, sorted(files, key=lambda f: f.relative_to(source).as_posix())


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


def _cache_key(root: Path, files: list[Path], val_fraction: float) -> str:
    digest = hashlib.sha256()
    digest.update(f"format={CACHE_FORMAT};val={val_fraction!r};root={root}\n".encode())
    for f in files:
        stat = f.stat()
        rel = f.relative_to(root).as_posix()
        digest.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _read_joined(files: list[Path]) -> Tensor:
    data = b"\n".join(f.read_bytes() for f in files)
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Corpus:
    """Load (and cache) a byte-tokenized corpus split into train and validation.

    Args:
        path: a text file, a folder of text files, or ``None`` for the standard library.
        val_fraction: share of files (or of bytes, for a single file) held out.
        cache_dir: where the tokenized cache lives; see `default_cache_dir`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no usable text, or a split too small to hold any token.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    root, files = list_source_files(path)
    source = str(stdlib_root() if path is None else Path(path).expanduser().resolve())
    cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_path = cache_root / f"corpus-{_cache_key(root, files, val_fraction)}.pt"

    if cache_path.is_file():
        try:
            blob = torch.load(cache_path, weights_only=True, mmap=True)
            return Corpus(
                train=blob["train"],
                val=blob["val"],
                source=source,
                train_files=int(blob["train_files"]),
                val_files=int(blob["val_files"]),
                cache_path=cache_path,
                from_cache=True,
            )
        except Exception:  # a corrupt or foreign cache file is rebuilt below
            pass

    if len(files) == 1:
        data = _read_joined(files)
        n_val = max(1, round(len(data) * val_fraction))
        train, val = data[: len(data) - n_val].clone(), data[len(data) - n_val :].clone()
        train_files, val_files = 1, 0
    else:
        by_rel = {f.relative_to(root).as_posix(): f for f in files}
        train_rel, val_rel = split_files(by_rel, val_fraction)
        train = _read_joined([by_rel[r] for r in train_rel])
        val = _read_joined([by_rel[r] for r in val_rel])
        train_files, val_files = len(train_rel), len(val_rel)
    if train.numel() == 0 or val.numel() == 0:
        raise ValueError(
            f"--data {source!r} has too little text to split into train and validation; "
            "pass more text"
        )

    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_path.with_name(f"{cache_path.name}.{os.getpid()}.tmp")
    torch.save(
        {"train": train, "val": val, "train_files": train_files, "val_files": val_files}, tmp
    )
    os.replace(tmp, cache_path)
    return Corpus(
        train=train,
        val=val,
        source=source,
        train_files=train_files,
        val_files=val_files,
        cache_path=cache_path,
        from_cache=False,
    )


def _step_seed(seed: int, step: int) -> int:
    digest = hashlib.blake2b(f"dmuon.train:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _check_length(tokens: Tensor, seq_len: int, what: str) -> None:
    if tokens.numel() < seq_len + 1:
        raise ValueError(
            f"the {what} split has {tokens.numel()} tokens, fewer than --seq-len + 1 = "
            f"{seq_len + 1}; use a shorter --seq-len or more text"
        )


class GlobalBatchSampler:
    """Deterministic batches of token windows, defined on the global batch.

    See the module docstring for the rule. ``global_batch(step)`` returns all
    ``world_size * accum_steps * micro_batch_size`` windows of a step; ``rank_batch``
    returns this rank's slice shaped ``(accum_steps, micro_batch_size, seq_len + 1)``.
    """

    def __init__(
        self,
        tokens: Tensor,
        *,
        seq_len: int,
        micro_batch_size: int,
        accum_steps: int,
        world_size: int = 1,
        seed: int = 0,
    ) -> None:
        """Prepare sampling of ``seq_len + 1``-token windows from a 1-D token tensor."""
        _check_length(tokens, seq_len, "training")
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch_size = micro_batch_size
        self.accum_steps = accum_steps
        self.world_size = world_size
        self.seed = seed
        self._windows = tokens.unfold(0, seq_len + 1, 1)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.world_size * self.accum_steps * self.micro_batch_size

    def global_starts(self, step: int) -> Tensor:
        """Start offsets of the ``global_batch_size`` windows of ``step``."""
        gen = torch.Generator().manual_seed(_step_seed(self.seed, step))
        return torch.randint(0, self._windows.shape[0], (self.global_batch_size,), generator=gen)

    def global_batch(self, step: int) -> Tensor:
        """All windows of ``step`` as ``int64`` of shape (global_batch_size, seq_len + 1)."""
        return self._windows[self.global_starts(step)].long()

    def rank_batch(self, step: int, rank: int = 0) -> Tensor:
        """Rank ``rank``'s windows of ``step``: (accum_steps, micro_batch_size, seq_len + 1)."""
        per_rank = self.accum_steps * self.micro_batch_size
        starts = self.global_starts(step)[rank * per_rank : (rank + 1) * per_rank]
        return (
            self._windows[starts]
            .long()
            .view(self.accum_steps, self.micro_batch_size, self.seq_len + 1)
        )


def validation_windows(
    tokens: Tensor, *, seq_len: int, num_sequences: int, world_size: int = 1, rank: int = 0
) -> Tensor:
    """This rank's block of the fixed, evenly spaced validation windows.

    ``num_sequences`` is rounded up to a multiple of ``world_size``; windows are
    ``seq_len + 1`` tokens, spread evenly from the start to the end of ``tokens``
    (they overlap when the validation split is short). Returns ``int64`` of shape
    (num_sequences_rounded / world_size, seq_len + 1).
    """
    _check_length(tokens, seq_len, "validation")
    total = math.ceil(num_sequences / world_size) * world_size
    last = tokens.numel() - (seq_len + 1)
    starts = torch.linspace(0, last, total, dtype=torch.float64).round().long()
    per_rank = total // world_size
    windows = tokens.unfold(0, seq_len + 1, 1)
    return windows[starts[rank * per_rank : (rank + 1) * per_rank]].long()
