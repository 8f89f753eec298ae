"""Metrics ingestion (tailing a job's metrics file into SQLite) and fan-out to streams.

The recipe appends one JSON object per optimizer step to its metrics file. The tailer
reads from the byte offset stored in the database, consumes complete lines only (a
partly written last line waits for its newline, or for the job to end), and stores the
points together with the new offset in one transaction: a point is stored exactly once,
also across a server restart. Streams do not receive points from the tailer: the database
is the single source, and the :class:`Hub` only wakes the streams of a job up, so a slow
client can never make the server drop or buffer points.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from dmuon_server.schemas import encode_nonfinite
from dmuon_server.storage.safefiles import open_in
from dmuon_server.storage.store import EventRecord, Store
from dmuon_server.streams import recipe_events

log = logging.getLogger("dmuon_server.streams.metrics")

#: Name of the offset row for a job's metrics file.
METRICS_STREAM = "metrics"
#: Largest chunk read from a metrics file in one go.
_CHUNK = 4 << 20
#: Longest line of a metrics file that is stored: the contract's points take a few hundred
#: bytes, so a longer one is rejected (counted, never stored).
MAX_LINE_BYTES = 64 << 10
#: The offset of a stream that is read no more: its file shrank, so what follows its old
#: offset is no longer the lines after those already stored.
CLOSED_OFFSET = 1 << 62
#: Bytes before a stream's offset kept to notice a file rewritten in place to at least
#: its old length (which its size alone does not show).
TAIL_BYTES = 64
#: Rejected lines a job may write before it is stopped (its log stays bounded either way).
MAX_REJECTED_LINES = 10_000
#: Seconds between two log records of one job's rejected lines; the lines in between are
#: counted ("and N more"), never echoed one by one.
REJECTED_LOG_INTERVAL_S = 60.0


def metrics_stream(attempt: int) -> str:
    """Name of the stored read offset of attempt ``attempt``'s metrics file."""
    return METRICS_STREAM if attempt <= 1 else f"{METRICS_STREAM}-{attempt}"


@dataclass(frozen=True)
class RejectedLine:
    """A line of a metrics file that was not stored: why, and its first 200 characters."""

    why: str
    line: str


@dataclass
class ParsedChunk:
    """What :func:`parse_lines` found in a chunk of a metrics file."""

    points: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    consumed: int = 0
    rejected: list[RejectedLine] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    #: Bytes of the lines that became points, events or the summary.
    kept_bytes: int = 0


#: Numeric keys of the metrics contract; a value of another type is moved aside.
NUMERIC_KEYS = ("loss", "lr", "tokens_per_s", "grad_norm", "time", "val_loss")
_ENCODED = ("NaN", "Infinity", "-Infinity")
_MAX_STEP = 2**62
#: Deepest nesting of lists and objects a stored line may have (the contract's lines are
#: flat; the API's serializer has a recursion limit of its own).
MAX_DEPTH = 32
#: Integers beyond 64 bits are no metric value, and neither SQLite nor JavaScript keeps
#: them exactly.
_MAX_INT = 2**63


def unstorable(obj: Any) -> str | None:
    """Why a parsed line cannot be stored and served as JSON, or None if it can.

    Refused: nesting deeper than :data:`MAX_DEPTH`, integers outside 64 bits, and strings
    that are not valid Unicode text (a lone surrogate, which JSON's ``\\ud800`` escape
    can produce and no response can encode).
    """
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict | list):
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for k, v in items:
                if isinstance(k, str):
                    stack.append((k, depth))
                stack.append((v, depth + 1))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return "a string that is not valid Unicode (a lone surrogate escape)"
        elif isinstance(value, int) and not -_MAX_INT <= value < _MAX_INT:
            return "an integer outside 64 bits"
    return None


def _sanitize(data: dict[str, Any]) -> None:
    """Keep the contract's numeric keys numeric: a value of another type (say a string)
    is stored as ``invalid_<key>`` and the key set to null, so nothing is lost and every
    stored point matches the API schema."""
    for key in NUMERIC_KEYS:
        value = data.get(key)
        ok = (
            value is None
            or value in _ENCODED
            or (isinstance(value, int | float) and not isinstance(value, bool))
        )
        if not ok:
            data[f"invalid_{key}"] = value
            data[key] = None


def parse_lines(buf: bytes, *, final: bool) -> ParsedChunk:
    """Parse the complete lines of ``buf`` (all of it when ``final``).

    A line is a metric point when it is a JSON object with an integer ``step`` and no
    ``event`` key; an object with ``event`` is a note of the recipe (kept in ``events``,
    never a point); any other object is the recipe's summary. Python's JSON reader accepts
    the ``NaN`` and ``Infinity`` tokens a PyTorch recipe may write; such values are stored
    encoded (see :func:`dmuon_server.schemas.encode_nonfinite`). Lines that are not JSON
    objects, or that :func:`unstorable` refuses, are rejected: reported and counted, never
    stored, and read past like any other line.
    """
    out = ParsedChunk()
    end = len(buf) if final else buf.rfind(b"\n") + 1
    out.consumed = end
    for raw in buf[:end].split(b"\n"):
        line = raw.strip()
        if not line:
            continue
        excerpt = line[:200].decode("utf-8", "replace")
        if len(line) > MAX_LINE_BYTES:
            out.rejected.append(RejectedLine(f"longer than {MAX_LINE_BYTES >> 10} KiB", excerpt))
            continue
        out.kept_bytes += len(line)
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            why = "not JSON"
        except RecursionError:
            why = f"nested deeper than {MAX_DEPTH} levels"
        else:
            why = "not a JSON object" if not isinstance(obj, dict) else unstorable(obj)
        if why is not None:
            out.rejected.append(RejectedLine(why, excerpt))
            out.kept_bytes -= len(line)
            continue
        if "event" in obj:
            # Not a point: the recipe's notes such as {"event": "stopped", "step": k, ...}
            # (it saved a checkpoint and stopped on a signal).
            out.events.append(encode_nonfinite(obj))
            continue
        data = encode_nonfinite(obj)
        step = obj.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < _MAX_STEP:
            _sanitize(data)
            out.points.append((step, data))
            if isinstance(obj.get("summary"), dict):
                out.summary = {**(out.summary or {}), **data["summary"]}
        else:
            inner = data.get("summary") if isinstance(data.get("summary"), dict) else data
            out.summary = {**(out.summary or {}), **inner}
    return out


class Hub:
    """Wakes up the publisher of a job's event streams when something about it changed.

    Thread-safe: the supervisor thread calls :meth:`notify`; each publisher
    (`dmuon_server.streams.feeds.JobFeed`) owns an :class:`asyncio.Event` on its own loop.
    """

    def __init__(self) -> None:
        """Create an empty hub."""
        self._lock = threading.Lock()
        self._subs: dict[str, set[_Subscription]] = {}
        self.closing = False

    def subscribe(self, job_id: str) -> _Subscription:
        """Register the calling coroutine's loop for changes of ``job_id``."""
        sub = _Subscription(job_id, asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._subs.setdefault(job_id, set()).add(sub)
        return sub

    def unsubscribe(self, sub: _Subscription) -> None:
        """Forget a subscription."""
        with self._lock:
            subs = self._subs.get(sub.job_id)
            if subs is not None and sub in subs:
                subs.discard(sub)
                if not subs:
                    del self._subs[sub.job_id]

    def notify(self, job_id: str) -> None:
        """Wake every stream of ``job_id``."""
        with self._lock:
            subs = list(self._subs.get(job_id, ()))
        for sub in subs:
            with contextlib.suppress(RuntimeError):  # a closed loop: the stream is gone
                sub.loop.call_soon_threadsafe(sub.event.set)

    def shutdown(self) -> None:
        """Tell every stream that the server is stopping (they end with an ``end`` event)."""
        with self._lock:
            self.closing = True
            subs = [sub for job_subs in self._subs.values() for sub in job_subs]
        for sub in subs:
            with contextlib.suppress(RuntimeError):
                sub.loop.call_soon_threadsafe(sub.event.set)

    def reopen(self) -> None:
        """Accept streams again (an app whose lifespan starts anew, as in tests)."""
        self.closing = False


@dataclass(eq=False)
class _Subscription:
    job_id: str
    loop: asyncio.AbstractEventLoop
    event: asyncio.Event


#: How the server shows a text of a job to clients: ``public(job_id, text)`` (its server
#: paths replaced, see :class:`dmuon_server.storage.paths.PublicPaths`).
PublicText = Callable[[str, str], str]


#: How many bytes of metric points and events a job may have stored: ``cap_of(job_id)``
#: (``None``: no limit), and the words that name where that limit comes from.
MetricsCap = Callable[[str], tuple[int, str] | None]


@dataclass
class _RejectedLog:
    """When a job's rejected lines may be logged next, and how many wait to be counted."""

    next_at: float = 0.0
    unlogged: int = 0
    total: int = 0


class MetricsTailer:
    """Moves new lines of jobs' metrics files into the store, within each job's limits.

    What a job's metrics cost the server is bounded: a line over `MAX_LINE_BYTES` is
    rejected; the points and events a job has stored may take at most ``cap_of(job_id)``
    bytes, and it may write at most `MAX_REJECTED_LINES` rejected lines; a metrics file that
    shrinks closes its attempt's stream (it is never read again from the start). Past any
    of these, the job's lines are no longer read and `over_limit` names the cause (the
    launchers stop the job with it). Rejected lines are logged at most once per
    `REJECTED_LOG_INTERVAL_S` per job, the others counted.
    """

    def __init__(
        self,
        store: Store,
        hub: Hub,
        public: PublicText | None = None,
        cap_of: MetricsCap | None = None,
    ) -> None:
        """Tail into ``store`` and wake streams through ``hub``; the recipe's event
        messages are stored as ``public`` shows them; ``cap_of`` gives each job's limit."""
        self.store = store
        self.hub = hub
        self.public: PublicText = public or (lambda job_id, text: text)
        self.cap_of: MetricsCap = cap_of or (lambda job_id: None)
        self.points_total = 0
        self.rejected_total = 0
        #: Per job over a limit: the cause, for the job's failure reason.
        self.over_limit: dict[str, str] = {}
        self._stored_bytes: dict[str, int] = {}
        self._rejected: dict[str, _RejectedLog] = {}
        #: Per job and stream: the last `TAIL_BYTES` read before the stored offset.
        self._tails: dict[str, dict[str, bytes]] = {}

    def forget(self, job_id: str) -> None:
        """Drop what is kept about a job (its attempt ended and was recorded)."""
        self.over_limit.pop(job_id, None)
        self._stored_bytes.pop(job_id, None)
        self._tails.pop(job_id, None)
        log_state = self._rejected.pop(job_id, None)
        if log_state is not None and log_state.unlogged:
            log.warning("job %s: and %d more rejected metrics lines", job_id, log_state.unlogged)

    def _log_rejected(self, job_id: str, rejected: list[RejectedLine]) -> None:
        state = self._rejected.setdefault(job_id, _RejectedLog())
        now = time.monotonic()
        for bad in rejected:
            state.total += 1
            if now < state.next_at:
                state.unlogged += 1
                continue
            more = f" (and {state.unlogged} more since the last)" if state.unlogged else ""
            log.warning("job %s: rejected metrics line (%s)%s: %r", job_id, bad.why, more, bad.line)
            state.unlogged = 0
            state.next_at = now + REJECTED_LOG_INTERVAL_S
        if state.total > MAX_REJECTED_LINES and job_id not in self.over_limit:
            self._stop(
                job_id,
                f"stopped: it wrote {state.total:,} lines to its metrics file that are no "
                f"metric points (at most {MAX_REJECTED_LINES:,}); write one JSON object per "
                "line, as dmuon.train.log_metrics does",
            )

    def _within_cap(self, job_id: str, adding: int) -> bool:
        """Whether ``adding`` more stored bytes keep ``job_id`` within its cap."""
        cap = self.cap_of(job_id)
        if cap is None:
            return True
        if job_id not in self._stored_bytes:
            self._stored_bytes[job_id] = self.store.stored_metrics_bytes(job_id)
        total = self._stored_bytes[job_id] + adding
        limit, source = cap
        if total <= limit:
            self._stored_bytes[job_id] = total
            return True
        self._stop(
            job_id,
            f"stopped: its metric points and events would take {total:,} bytes of the "
            f"server's database, over the {limit:,} bytes a job may store ({source}); log "
            "fewer or smaller values per step",
        )
        return False

    def _stop(self, job_id: str, cause: str) -> None:
        self.over_limit[job_id] = cause
        log.warning("job %s: %s", job_id, cause)

    def poll(
        self,
        job_id: str,
        path: Path,
        *,
        final: bool = False,
        stream: str = METRICS_STREAM,
        attempt: int = 1,
    ) -> int:
        """Ingest what was appended to ``path`` since the offset stored for ``stream``.

        Each attempt of a job has a metrics file and a ``stream`` name of its own
        (:func:`metrics_stream`); its event lines are stored as the events of ``attempt``.
        With ``final`` (the attempt has ended) a last line without a newline is taken too.
        Returns the number of points stored.
        """
        offset = read_from = self.store.get_offset(job_id, stream)
        if offset >= CLOSED_OFFSET or job_id in self.over_limit:
            return 0
        stored = noted = 0
        try:
            # A job may put a link (to a file of the server) or a FIFO in its file's place.
            f = os.fdopen(open_in(path.parent, path.name), "rb")
        except FileNotFoundError:
            return 0
        except OSError as e:
            log.warning("job %s: cannot read its metrics file: %s", job_id, e.strerror or e)
            return 0
        tails = self._tails.setdefault(job_id, {})
        with f:
            size = os.fstat(f.fileno()).st_size
            how = None
            if size < offset:
                how = f"shrank from {offset:,} to {size:,} bytes"
            elif stream in tails and _read_tail(f, offset) != tails[stream]:
                how = f"was rewritten before byte {offset:,}"
            if how is not None:
                # Re-read from the start, a file that restarts would be stored again and
                # again: the attempt's stream closes, and the job ends on this contract.
                self.store.ingest(job_id, stream, CLOSED_OFFSET, [])
                self._stop(
                    job_id,
                    f"stopped: its metrics file {how} (attempt {attempt}); the service "
                    "reads it as append-only: append one JSON object per step, never "
                    "truncate or rewrite it",
                )
                return 0
            while True:
                f.seek(offset)
                buf = f.read(_CHUNK)
                if not buf:
                    break
                last_chunk = len(buf) < _CHUNK
                chunk = parse_lines(buf, final=final and last_chunk)
                if chunk.consumed == 0:
                    if last_chunk:
                        break
                    # One line longer than a chunk: no recipe writes that; skip it.
                    nl = buf.find(b"\n")
                    chunk.consumed = nl + 1 if nl >= 0 else len(buf)
                    excerpt = buf[:200].decode("utf-8", "replace")
                    chunk.rejected.append(RejectedLine("longer than 4 MiB", excerpt))
                self._log_rejected(job_id, chunk.rejected)
                self.rejected_total += len(chunk.rejected)
                if job_id in self.over_limit or not self._within_cap(job_id, chunk.kept_bytes):
                    break
                offset += chunk.consumed
                events = [self._event(job_id, obj, attempt) for obj in chunk.events]
                stored += self._ingest(job_id, stream, offset, chunk, events)
                noted += len(events)
                if last_chunk:
                    break
            if offset != read_from or stream not in tails:  # else the bytes just compared
                tails[stream] = _read_tail(f, offset)
        if stored or noted:
            self.points_total += stored
            self.hub.notify(job_id)
        return stored

    def _event(self, job_id: str, obj: dict[str, Any], attempt: int) -> EventRecord:
        ev = recipe_events.describe(obj, attempt)
        if ev.level == "warning":
            log.warning("job %s: the recipe reports %s: %s", job_id, ev.kind, ev.message)
        return dataclasses.replace(ev, message=self.public(job_id, ev.message))

    def _ingest(
        self,
        job_id: str,
        stream: str,
        offset: int,
        chunk: ParsedChunk,
        events: list[EventRecord],
    ) -> int:
        """Store a parsed chunk; if the store refuses it, store its points one at a time,
        rejecting (and counting) those it refuses, so one bad point costs only itself."""
        rejected = len(chunk.rejected)
        try:
            return self.store.ingest(
                job_id, stream, offset, chunk.points, chunk.summary, rejected, events
            )
        except (ValueError, TypeError, OverflowError) as e:
            log.warning("job %s: the store refused a chunk of points (%s); one by one", job_id, e)
        stored = 0
        old = self.store.get_offset(job_id, stream)
        for point in chunk.points:
            try:
                stored += self.store.ingest(job_id, stream, old, [point])
            except (ValueError, TypeError, OverflowError) as e:
                log.warning("job %s: rejected the point of step %d: %s", job_id, point[0], e)
                rejected += 1
                self.rejected_total += 1
        self.store.ingest(job_id, stream, offset, [], chunk.summary, rejected, events)
        return stored


def _read_tail(f: BinaryIO, offset: int) -> bytes:
    """The last `TAIL_BYTES` of ``f`` before ``offset`` (fewer near its start)."""
    start = max(0, offset - TAIL_BYTES)
    f.seek(start)
    return f.read(offset - start)
