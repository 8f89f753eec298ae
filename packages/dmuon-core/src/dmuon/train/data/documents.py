"""Reading the documents of ``--data``: text files in pieces, JSON records, parquet rows.

`read_documents` yields each piece of text of one source file with whether it starts a
new document: a text file is one document, read in pieces of about 1 MiB cut at line ends
(so no character is cut); each record of a ``.jsonl`` / ``.json`` file and each row of a
parquet file is one, its ``--text-field``. A record without the field, a line that is not
JSON or a column that holds no strings is an error naming the file, the place and the fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dmuon.train.data.sources import SourceFile

__all__ = ["read_documents"]

_PIECE_BYTES = 1 << 20  # text read per piece


def _text_pieces(path: Path, as_bytes: bool) -> Iterator[tuple[str | bytes, int]]:
    """A text file in pieces of about 1 MiB cut at line ends, with their sizes in bytes."""
    with path.open("rb") as handle:
        while True:
            piece = handle.read(_PIECE_BYTES)
            if not piece:
                return
            if not as_bytes and not piece.endswith(b"\n"):
                piece += handle.readline()  # whole lines, so no character is cut
            yield (piece if as_bytes else piece.decode("utf-8", errors="replace")), len(piece)


def _field_error(shown: str, where: str, record: Any, field: str) -> ValueError:
    if isinstance(record, dict):
        fields = ", ".join(sorted(map(str, record))[:10]) or "none"
        return ValueError(
            f"--data: {where} of {shown} has no string field {field!r} (its fields: {fields}); "
            "pass --text-field with the field that holds the text"
        )
    return ValueError(
        f"--data: {where} of {shown} is a JSON {type(record).__name__}, not an object with a "
        f"{field!r} field; write one JSON object per line"
    )


def _text_of(record: Any, field: str, shown: str, where: str) -> str:
    value = record.get(field) if isinstance(record, dict) else None
    if not isinstance(value, str):
        raise _field_error(shown, where, record, field)
    return value


def _records(path: Path, shown: str, field: str) -> Iterator[tuple[str, int]]:
    """The text field of every record of a ``.jsonl`` / ``.json`` file."""
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip()
    if path.suffix.lower() == ".json" and head.startswith(b"["):
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise ValueError(f"--data: {shown} is not valid JSON ({exc})") from None
        for i, record in enumerate(records):
            yield _text_of(record, field, shown, f"record {i}"), 0
        return
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ValueError(
                    f"--data: line {number} of {shown} is not JSON ({exc}); a .jsonl file "
                    "holds one JSON object per line"
                ) from None
            yield _text_of(record, field, shown, f"line {number}"), len(line)


def _parquet_rows(path: Path, shown: str, field: str) -> Iterator[tuple[str, int]]:
    """The text column of every row of a parquet file, one record batch at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"--data: reading {shown} needs pyarrow: pip install pyarrow (or dmuon's hf "
            "extra: from a checkout, pip install -e 'packages/dmuon-core[hf]')"
        ) from None
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"--data: {shown} is not a parquet file ({exc})") from None
    schema = parquet.schema_arrow
    if field not in schema.names:
        raise ValueError(
            f"--data: {shown} has no column {field!r} (its columns: "
            f"{', '.join(schema.names[:10])}); pass --text-field with the column that holds "
            "the text"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(
            f"--data: column {field!r} of {shown} holds {kind}, not strings; pass "
            "--text-field with a text column"
        )
    rows = max(1, parquet.metadata.num_rows)
    per_row = path.stat().st_size / rows
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[field]):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is None:
                raise ValueError(
                    f"--data: row {row} of {shown} has no {field!r} (null); drop such rows "
                    "or fill them"
                )
            yield value, int(per_row)


def read_documents(
    file: SourceFile, shown: str, field: str, raw_bytes: bool
) -> Iterator[tuple[str | bytes, bool, int]]:
    """``(text, starts a new document, bytes read)`` for every piece of ``file``."""
    if file.kind == "text":
        first = True
        for piece, size in _text_pieces(file.path, raw_bytes):
            yield piece, first, size
            first = False
        return
    reader = _records if file.kind == "records" else _parquet_rows
    for text, size in reader(file.path, shown, field):
        yield (text.encode("utf-8") if raw_bytes else text), True, size
