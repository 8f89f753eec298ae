"""Tokenizing a corpus once, streamed, into a private cache of token ids.

`plan_corpus` lists the files of ``--data`` (`dmuon.train.data.sources`), splits them into
train and validation and names the cache; `CorpusPlan.build` tokenizes them; `CorpusPlan.open`
memory-maps the result as a `Corpus`. `load_corpus` does all three.

Tokenization streams: a text file is read in pieces of about 1 MiB cut at line ends, a
JSON-lines file line by line, a parquet file a batch of rows at a time, and the ids are
appended to the cache file as they come, so a corpus larger than memory works. Documents
(a text file, a record) are joined with the tokenizer's separator (EOS; ``\\n`` for raw
bytes), within each split. Token files (``.bin``) are not copied: they are memory-mapped
where they are.

The cache lives in ``cache_dir`` (default ``$DMUON_CACHE_DIR``, else
``$XDG_CACHE_HOME/dmuon`` or ``~/.cache/dmuon``), a folder of mode 0700 whose files are
mode 0600: ``corpus-KEY.bin`` (the ids, train then validation) and ``corpus-KEY.json``
(dtype and counts; written last, so its presence means the cache is complete). ``KEY``
hashes the cache format, the resolved root, every file's relative path, size and
modification time, the split fraction, the tokenizer (its full serialization and EOS id)
and the text field, so editing a file or changing the tokenizer rebuilds it. Writes go to
a temporary file renamed into place (``os.replace``), so concurrent builders are safe.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import dmuon_recipe_contract as contract
import numpy as np

from dmuon.train.data.documents import read_documents
from dmuon.train.data.sampler import TokenStream
from dmuon.train.data.sources import (
    SourceFile,
    list_source_files,
    read_sidecar,
    split_files,
    stdlib_root,
)
from dmuon.train.data.tokenizer import ByteTokenizer, TextTokenizer

__all__ = [
    "CACHE_FORMAT",
    "Corpus",
    "CorpusPlan",
    "default_cache_dir",
    "load_corpus",
    "plan_corpus",
]

CACHE_FORMAT = 2
"""Bumped whenever the cache layout or tokenization changes."""

_BATCH_BYTES = contract.TOKENIZE_BATCH_BYTES  # text per encode_batch call
_BATCH_ITEMS = 4096


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus, memory-mapped.

    Attributes:
        train: the training tokens.
        val: the validation tokens.
        source: the file or folder the text came from.
        train_files: number of files in the training split.
        val_files: number of files in the validation split (0 for a split by tokens).
        cache_path: the cache file backing this corpus (None for token files read in
            place).
        from_cache: whether this call read the cache instead of tokenizing.
        vocab_size: the vocabulary size of the tokenizer that made the ids.
    """

    train: TokenStream
    val: TokenStream
    source: str
    train_files: int
    val_files: int
    cache_path: Path | None
    from_cache: bool
    vocab_size: int = 256


def default_cache_dir() -> Path:
    """``$DMUON_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/dmuon`` or ``~/.cache/dmuon``."""
    explicit = os.environ.get("DMUON_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dmuon"


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(PermissionError):  # a folder someone else owns stays as it is
        if path.stat().st_mode & 0o077:
            path.chmod(0o700)
    return path


def _private_file(path: Path) -> IO[bytes]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.fchmod(fd, 0o600)  # whatever the umask
    return os.fdopen(fd, "wb")


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    with _private_file(tmp) as out:
        out.write(data)
    os.replace(tmp, path)


# ----- the plan and the cache ------------------------------------------------------------
@dataclass(frozen=True)
class CorpusPlan:
    """What `load_corpus` will read and where it caches it (made without reading data).

    Attributes:
        source: the resolved ``--data`` (or the standard library folder).
        root: the folder relative paths are taken from.
        train: files of the training split (all files for a split by tokens).
        val: files of the validation split (empty for a split by tokens).
        by_tokens: whether the split is by tokens (a corpus of one file).
        tokenizer: the tokenizer (unused for token files).
        text_field: the records' text field.
        val_fraction: the held-out share.
        cache_bin: the cache's token file (None for token files read in place).
    """

    source: str
    root: Path
    train: tuple[SourceFile, ...]
    val: tuple[SourceFile, ...]
    by_tokens: bool
    tokenizer: TextTokenizer
    text_field: str
    val_fraction: float
    cache_bin: Path | None

    @property
    def cache_meta(self) -> Path | None:
        """The cache's metadata file, written last."""
        return None if self.cache_bin is None else self.cache_bin.with_suffix(".json")

    @property
    def error_file(self) -> Path | None:
        """Where a failed build leaves its message for the ranks waiting on it."""
        return None if self.cache_bin is None else self.cache_bin.with_suffix(".error")

    @property
    def is_cached(self) -> bool:
        """Whether nothing needs tokenizing (a complete cache, or token files)."""
        return self.cache_meta is None or self.cache_meta.is_file()

    @property
    def input_bytes(self) -> int:
        """Size of the files to tokenize."""
        return sum(f.path.stat().st_size for f in (*self.train, *self.val))

    def build(self, progress: bool | None = None) -> None:
        """Tokenize the files into the cache (no-op when cached or for token files).

        Raises:
            ValueError: a record without the text field, a file that is not what its
                suffix says, or a split without any token; nothing is left in the cache.
        """
        if self.is_cached:
            return
        assert self.cache_bin is not None and self.cache_meta is not None
        cache = _private_dir(self.cache_bin.parent)
        error = self.error_file
        assert error is not None
        tmp = cache / f".{self.cache_bin.name}.{socket.gethostname()}.{os.getpid()}.tmp"
        try:
            counts = self._tokenize(tmp, progress)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, (ValueError, OSError)):
                with contextlib.suppress(OSError):
                    _write_private(error, str(exc).encode("utf-8"))
            raise
        os.replace(tmp, self.cache_bin)
        meta = {
            "format": CACHE_FORMAT,
            "dtype": np.dtype(self.tokenizer.dtype).name,
            "vocab_size": self.tokenizer.vocab_size,
            "tokenizer": self.tokenizer.name,
            "source": self.source,
            **counts,
        }
        _write_private(self.cache_meta, json.dumps(meta).encode("utf-8"))
        error.unlink(missing_ok=True)

    def _tokenize(self, tmp: Path, progress: bool | None) -> dict[str, int]:
        from tqdm.auto import tqdm

        total = self.input_bytes
        use_bar = sys.stderr.isatty() if progress is None else progress
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenize", disable=not use_bar)
        started = time.perf_counter()
        try:
            with _private_file(tmp) as out:
                n_train = self._write_split(out, self.train, bar)
                n_val = self._write_split(out, self.val, bar) if self.val else 0
        finally:
            bar.close()
        seconds = time.perf_counter() - started
        if use_bar is False and total > 0:
            print(
                f"tokenized {total / 1e6:.1f} MB into {n_train + n_val:,} tokens in "
                f"{seconds:.1f} s ({total / 1e6 / max(seconds, 1e-9):.1f} MB/s)",
                flush=True,
            )
        if self.by_tokens:
            n_val = max(1, round(n_train * self.val_fraction)) if n_train > 1 else 0
            n_train -= n_val
        if n_train == 0 or n_val == 0:
            raise ValueError(
                f"--data {self.source!r} has too little text to split into train and "
                "validation; pass more text"
            )
        return {
            "train_tokens": n_train,
            "val_tokens": n_val,
            "train_files": 1 if self.by_tokens else len(self.train),
            "val_files": 0 if self.by_tokens else len(self.val),
        }

    def _write_split(self, out: IO[bytes], files: tuple[SourceFile, ...], bar: Any) -> int:
        tokenizer = self.tokenizer
        raw = isinstance(tokenizer, ByteTokenizer)
        separator = np.asarray([tokenizer.separator], dtype=tokenizer.dtype)
        written = 0
        pending: list[tuple[str | bytes, bool]] = []
        pending_bytes = 0

        def flush() -> None:
            nonlocal written, pending_bytes
            if raw:
                encoded = [np.frombuffer(bytes(t), dtype=np.uint8) for t, _ in pending]
            else:
                encoded = tokenizer.encode_batch([str(t) for t, _ in pending])
            for (_, new_document), ids in zip(pending, encoded, strict=True):
                if new_document and written > 0:
                    out.write(separator.tobytes())
                    written += 1
                out.write(ids.tobytes())
                written += int(ids.size)
            pending.clear()
            pending_bytes = 0

        for file in files:
            shown = str(file.path)
            for text, new_document, size in read_documents(file, shown, self.text_field, raw):
                pending.append((text, new_document))
                pending_bytes += len(text)
                bar.update(size)
                if pending_bytes >= _BATCH_BYTES or len(pending) >= _BATCH_ITEMS:
                    flush()
        if pending:
            flush()
        return written

    def open(self) -> Corpus:
        """Memory-map the cache (or the token files) as a `Corpus`."""
        if self.cache_bin is None:
            return self._open_token_files()
        assert self.cache_meta is not None
        meta = json.loads(self.cache_meta.read_text(encoding="utf-8"))
        n_train, n_val = int(meta["train_tokens"]), int(meta["val_tokens"])
        tokens = np.memmap(self.cache_bin, dtype=meta["dtype"], mode="r", shape=(n_train + n_val,))
        return Corpus(
            train=TokenStream([tokens[:n_train]]),
            val=TokenStream([tokens[n_train:]]),
            source=self.source,
            train_files=int(meta["train_files"]),
            val_files=int(meta["val_files"]),
            cache_path=self.cache_bin,
            from_cache=True,
            vocab_size=int(meta["vocab_size"]),
        )

    def _open_token_files(self) -> Corpus:
        def mapped(file: SourceFile) -> tuple[np.ndarray, int]:
            info = read_sidecar(file.path, file.relative)
            array = np.memmap(file.path, dtype=np.dtype(info.dtype).newbyteorder("<"), mode="r")
            return array, info.vocab_size

        train = [mapped(f) for f in self.train]
        val = [mapped(f) for f in self.val]
        vocab = max(v for _, v in (*train, *val))
        if self.by_tokens:
            ((array, _),) = train
            n_val = max(1, round(array.size * self.val_fraction))
            train_stream = TokenStream([array[: array.size - n_val]])
            val_stream = TokenStream([array[array.size - n_val :]])
        else:
            train_stream = TokenStream([a for a, _ in train])
            val_stream = TokenStream([a for a, _ in val])
        return Corpus(
            train=train_stream,
            val=val_stream,
            source=self.source,
            train_files=1 if self.by_tokens else len(train),
            val_files=0 if self.by_tokens else len(val),
            cache_path=None,
            from_cache=False,
            vocab_size=vocab,
        )

    def check_records(self, limit: int = 256) -> None:
        """Read the first record of (up to ``limit``) record and parquet files.

        Raises:
            ValueError: a file that is not what its suffix says, or whose first record
                lacks the text field (the same error tokenizing would raise later).
        """
        records = [f for f in (*self.train, *self.val) if f.kind in ("records", "parquet")]
        for file in records[:limit]:
            next(iter(read_documents(file, str(file.path), self.text_field, True)), None)

    def wait(self, poll_s: float = 0.2) -> None:
        """Wait until another process has built the cache (or raise its error).

        Raises:
            ValueError: the build failed; the message is the builder's.
        """
        error = self.error_file
        while not self.is_cached:
            if error is not None and error.is_file():
                raise ValueError(error.read_text(encoding="utf-8"))
            time.sleep(poll_s)

    def clear_error(self) -> None:
        """Remove the message of an earlier failed build (before a new one starts)."""
        if self.error_file is not None:
            self.error_file.unlink(missing_ok=True)


def _cache_key(
    root: Path, files: list[SourceFile], val_fraction: float, tokenizer: TextTokenizer, field: str
) -> str:
    digest = hashlib.sha256()
    digest.update(f"format={CACHE_FORMAT};val={val_fraction!r};root={root}\n".encode())
    digest.update(f"tokenizer={tokenizer.fingerprint}\n".encode())
    if any(f.kind != "text" for f in files):
        digest.update(f"field={field}\n".encode())
    for f in files:
        stat = f.path.stat()
        digest.update(f"{f.relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def plan_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike[str] | None = None,
    tokenizer: TextTokenizer | None = None,
    text_field: str = contract.DEFAULT_TEXT_FIELD,
    listing: tuple[Path, list[SourceFile]] | None = None,
) -> CorpusPlan:
    """List and split the files of ``path`` and name the cache, reading no data.

    ``listing`` is what `list_source_files` returned for ``path``, when the caller has
    it (listing the standard library walks a few thousand files).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no usable file, a link out of the data folder, a token file without
            its sidecar, or token files mixed with text (see `list_source_files`).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokenizer = tokenizer or ByteTokenizer()
    root, files = list_source_files(path) if listing is None else listing
    source = str(stdlib_root() if path is None else Path(path).expanduser().resolve())
    by_tokens = len(files) == 1
    if by_tokens:
        train, val = tuple(files), ()
    else:
        by_rel = {f.relative: f for f in files}
        train_rel, val_rel = split_files(by_rel, val_fraction)
        train = tuple(by_rel[r] for r in train_rel)
        val = tuple(by_rel[r] for r in val_rel)
    cache_bin = None
    if files[0].kind != "tokens":
        cache_root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        key = _cache_key(root, files, val_fraction, tokenizer, text_field)
        cache_bin = cache_root / f"corpus-{key}.bin"
    return CorpusPlan(
        source, root, train, val, by_tokens, tokenizer, text_field, val_fraction, cache_bin
    )


def load_corpus(
    path: str | os.PathLike[str] | None = None,
    *,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike[str] | None = None,
    tokenizer: TextTokenizer | None = None,
    text_field: str = contract.DEFAULT_TEXT_FIELD,
    progress: bool | None = None,
) -> Corpus:
    """Load (tokenizing and caching once) a corpus split into train and validation.

    Args:
        path: a file, a folder, or ``None`` for the standard library.
        val_fraction: share of files (or of tokens, for a single file) held out.
        cache_dir: where the tokenized cache lives; see `default_cache_dir`.
        tokenizer: raw bytes when None.
        text_field: the records' text field (``.jsonl``, ``.json``, ``.parquet``).
        progress: a tqdm bar while tokenizing (None: on a terminal; False: one line).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: no usable text, a record without the text field, or a split too
            small to hold any token.
    """
    plan = plan_corpus(
        path,
        val_fraction=val_fraction,
        cache_dir=cache_dir,
        tokenizer=tokenizer,
        text_field=text_field,
    )
    built = not plan.is_cached
    plan.build(progress)
    corpus = plan.open()
    if built:
        corpus = Corpus(**{**corpus.__dict__, "from_cache": False})
    return corpus
