"""Server-Sent Events of a job: its metric points, state changes and end.

Wire format (``text/event-stream``)::

    retry: 3000

    event: state
    data: {"state": "running", "reason": "...", "at": "2025-01-01T00:00:00Z"}

    id: 7
    event: metric
    data: {"step": 7, "loss": 2.31, "lr": 0.02, "tokens_per_s": 5120.0, ...}

    : heartbeat

    event: end
    data: {"state": "succeeded", "exit_code": 0, "reason": "...", "last_step": 10}

* ``id`` is the step of a metric point; only metric events carry one, so a reconnecting
  client's ``Last-Event-ID`` is the last step it saw, and the stream resumes after it.
* The stream first sends every stored point after the resume step (all of them for a new
  client), then new points as they are stored; points come from the database, so a slow
  client never loses any.
* ``warning`` and ``info`` carry what the recipe reported besides points (a damaged
  checkpoint it skipped, a checkpoint it could not write, a stop on a signal), as in the
  job's ``events``: ``{"kind": "checkpoint_skipped", "level": "warning", "message": "...",
  "step": 2, "attempt": 1, "at": "..."}``. A connection first sends every stored one
  (after the current state), then each new one; they carry no ``id``.
* ``state`` is sent once for the current state and then for each transition; a queued
  job's also carries ``queue_position`` and ``queue_reason``, and is sent again whenever
  they change (a job ahead started, the GPUs it waits for came free). ``end``
  follows the last point of a finished job, and the server closes the stream. A
  reconnect to a finished job with nothing left to send is answered ``204 No Content``,
  which tells an ``EventSource`` to stop reconnecting.
* When the server stops, every open stream ends with
  ``event: end`` / ``{"state": <current>, "reason": "server_shutdown", ...}``: the job goes
  on, and a client reconnects (with ``Last-Event-ID``) once the server is back.
* Times are ISO 8601 in UTC with a ``Z``, as in the REST responses.
* Non-finite numbers are the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.
* A comment line (``: heartbeat``) goes out when nothing else was sent for
  ``heartbeat_s`` seconds, to keep proxies from closing an idle connection.

The streams of a job share one publisher (`dmuon_server.streams.feeds`): an idle stream does no
work of its own, and a change is read from the database once for all of them.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

import anyio

from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store
from dmuon_server.streams.feeds import (
    POINTS_PAGE,
    SHUTDOWN_REASON,
    Cursor,
    EventStreams,
    Item,
    Subscriber,
    format_event,
    read_points,
    recipe_event_text,
    state_text,
)

__all__ = ["SHUTDOWN_REASON", "SSE_HEADERS", "format_event", "job_events"]

#: Headers of an event stream, including the ones that stop proxies from buffering it.
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "Connection": "keep-alive",
}

#: Why a stream ended when its token stopped being valid.
REVOKED_REASON = (
    "the token of this stream is no longer valid (the users were reloaded): reconnect with "
    "a current token"
)


class _Stream:
    """What one connection has sent: its cursor over the job's rows and the feed's log."""

    def __init__(self, store: Store, sub: Subscriber, after_step: int) -> None:
        self.store = store
        self.sub = sub
        self.job_id = sub.feed.job_id
        self.cursor = Cursor(step=after_step)

    def sent(self) -> None:
        self.sub.last_write = time.monotonic()

    async def backlog(self, first: bool) -> AsyncIterator[str]:
        """From the database, in stream order: the current state (the first time), the
        points after the cursor, the transitions after it (later times), the events after
        it. The feed's log is read from the entry current before these reads on, so nothing
        falls between the two."""
        feed = self.sub.feed
        # A feed that published its end holds it last: read that one entry after these.
        self.sub.seq = feed.seq - 1 if feed.finished else feed.seq
        store, job_id, cursor = self.store, self.job_id, self.cursor
        row = await anyio.to_thread.run_sync(store.get_job, job_id)
        place = feed.place if row is not None and row.state == JobState.QUEUED else None
        history = await anyio.to_thread.run_sync(store.history, job_id)
        if first and history:
            yield state_text(history[-1], row, place)
            cursor.transition, cursor.last_t = history[-1].id, history[-1]
        while True:
            page = await anyio.to_thread.run_sync(read_points, store, job_id, cursor)
            for item in page:
                yield item.text
            if len(page) < POINTS_PAGE:
                break
        for t in history:
            if t.id > cursor.transition:
                cursor.transition, cursor.last_t = t.id, t
                yield state_text(t, row, place)
        for e in await anyio.to_thread.run_sync(store.events, job_id, cursor.event):
            cursor.event = e.id
            yield recipe_event_text(e)
        if row is None:
            yield format_event(event="end", data=json.dumps({"state": None, "deleted": True}))

    def unseen(self, item: Item) -> bool:
        """Whether ``item`` of the log is news to this stream (and advance past it)."""
        cursor = self.cursor
        if item.kind == "metric":
            if item.key <= cursor.step:
                return False
            cursor.step = item.key
        elif item.kind == "state":
            if item.key <= cursor.transition:
                return False
            cursor.transition = item.key
        elif item.kind == "event":
            if item.key <= cursor.event:
                return False
            cursor.event = item.key
        return True

    def end_text(self, item: Item) -> str:
        end = dict(item.end or {})
        if end.get("state") is not None:
            end["last_step"] = self.cursor.step if self.cursor.step >= 0 else None
        return format_event(event="end", data=json.dumps(end))


async def job_events(
    streams: EventStreams,
    store: Store,
    job_id: str,
    after_step: int,
    still_allowed: Callable[[], bool] = lambda: True,
) -> AsyncIterator[str]:
    """Yield the event stream of ``job_id``, starting after ``after_step``, with a heartbeat
    when nothing was sent for ``streams.heartbeat_s`` seconds.

    ``still_allowed`` is asked on every wake-up (the streams are woken after a reload of
    the users): when it says no (the token was removed or rotated, or the user may no
    longer see the job), the stream ends with an ``end`` event that says so."""
    yield "retry: 3000\n\n"
    sub = await streams.join(job_id)
    stream = _Stream(store, sub, after_step)
    try:
        first = True
        while True:
            ended = False
            async for text in stream.backlog(first):
                ended = text.startswith("event: end")
                yield text
                stream.sent()
            if ended:
                return
            first = False
            while True:
                items = sub.feed.items_after(sub.seq)
                if items is None:  # fell behind the log: read the database again
                    break
                sub.seq = sub.feed.seq
                for item in items:
                    if item.kind == "end":
                        yield stream.end_text(item)
                        return
                    if stream.unseen(item):
                        yield item.text
                        stream.sent()
                if not still_allowed():
                    yield format_event(event="end", data=json.dumps({"reason": REVOKED_REASON}))
                    return
                if time.monotonic() - sub.last_write >= streams.heartbeat_s:
                    yield ": heartbeat\n\n"
                    stream.sent()
                sub.wake.clear()
                if sub.feed.items_after(sub.seq) == []:
                    await sub.wake.wait()
    finally:
        streams.leave(sub)
