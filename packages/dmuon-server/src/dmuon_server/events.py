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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import anyio

from dmuon_server.metrics import Hub
from dmuon_server.queue_policy import Place
from dmuon_server.records import JobRecord
from dmuon_server.schemas import TERMINAL_STATES
from dmuon_server.store import Store
from dmuon_server.views import event_view, iso_utc

#: Headers of an event stream, including the ones that stop proxies from buffering it.
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
    "Connection": "keep-alive",
}
_PAGE = 500
#: ``reason`` of the ``end`` event sent to open streams when the server stops.
SHUTDOWN_REASON = "server_shutdown"
#: Longest wait between two looks at the database when no notification comes.
_MAX_IDLE_WAIT_S = 1.0

#: Why a stream ended when its token stopped being valid.
REVOKED_REASON = (
    "the token of this stream is no longer valid (the users were reloaded): reconnect with "
    "a current token"
)


def format_event(*, data: str, event: str | None = None, event_id: int | None = None) -> str:
    """One SSE event; ``data`` must be a single line (compact JSON is)."""
    out = ""
    if event_id is not None:
        out += f"id: {event_id}\n"
    if event is not None:
        out += f"event: {event}\n"
    return out + f"data: {data}\n\n"


def _state_data(t: dict[str, Any], row: JobRecord | None, place: Place | None = None) -> str:
    payload: dict[str, Any] = {
        "state": t["state"],
        "reason": t["reason"],
        "at": iso_utc(t["at"]),
    }
    if row is not None and t["state"] in TERMINAL_STATES:
        payload["exit_code"] = row.exit_code
    if t["state"] == "queued":
        payload["queue_position"] = place.position if place else None
        payload["queue_reason"] = place.reason if place else t["reason"]
    return json.dumps(payload)


Places = Callable[[], Mapping[str, Place]]


def _event_data(row: dict[str, Any]) -> str:
    return event_view(row).model_dump_json()


async def job_events(
    store: Store,
    hub: Hub,
    job_id: str,
    after_step: int,
    heartbeat_s: float,
    places: Places = dict,
    still_allowed: Callable[[], bool] = lambda: True,
) -> AsyncIterator[str]:
    """Yield the event stream of ``job_id``, starting after ``after_step``; ``places``
    gives the queue's places (the supervisor's :meth:`queue_places`).

    ``still_allowed`` is asked on every wake-up (at least once a second): when it says no
    (the token was removed or rotated by a reload of the users, or the user may no longer
    see the job), the stream ends with an ``end`` event that says so."""
    sub = hub.subscribe(job_id)
    try:
        yield "retry: 3000\n\n"
        last_write = time.monotonic()
        last_step = after_step
        history = await anyio.to_thread.run_sync(store.history, job_id)
        row = await anyio.to_thread.run_sync(store.get_job, job_id)
        last_tid = 0
        last_t: dict[str, Any] | None = None
        place: Place | None = None
        if history:
            last_tid = history[-1]["id"]
            last_t = history[-1]
            if row is not None and row.state == "queued":
                place = (await anyio.to_thread.run_sync(places)).get(job_id)
            yield format_event(event="state", data=_state_data(history[-1], row, place))
        last_eid = 0
        while True:
            sub.event.clear()
            if not still_allowed():
                yield format_event(event="end", data=json.dumps({"reason": REVOKED_REASON}))
                return
            while True:
                rows = await anyio.to_thread.run_sync(store.metrics_after, job_id, last_step, _PAGE)
                for r in rows:
                    yield format_event(event="metric", event_id=r["step"], data=r["data"])
                    last_step = r["step"]
                    last_write = time.monotonic()
                if len(rows) < _PAGE:
                    break
            row = await anyio.to_thread.run_sync(store.get_job, job_id)
            transitions = await anyio.to_thread.run_sync(store.transitions_after, job_id, last_tid)
            now_place = None
            if row is not None and row.state == "queued":
                now_place = (await anyio.to_thread.run_sync(places)).get(job_id)
            for t in transitions:
                last_tid, last_t = t["id"], t
                yield format_event(event="state", data=_state_data(t, row, now_place))
                last_write = time.monotonic()
            if not transitions and last_t is not None and now_place != place:
                yield format_event(event="state", data=_state_data(last_t, row, now_place))
                last_write = time.monotonic()
            place = now_place
            for e in await anyio.to_thread.run_sync(store.events, job_id, last_eid):
                last_eid = e["id"]
                yield format_event(event=e["level"], data=_event_data(e))
                last_write = time.monotonic()
            if row is None:
                yield format_event(event="end", data=json.dumps({"state": None, "deleted": True}))
                return
            if hub.closing and row.state not in TERMINAL_STATES:
                end = {
                    "state": row.state,
                    "exit_code": None,
                    "reason": SHUTDOWN_REASON,
                    "last_step": last_step if last_step >= 0 else None,
                }
                yield format_event(event="end", data=json.dumps(end))
                return
            if row.state in TERMINAL_STATES:
                # The supervisor stores a job's last points before its final state, but a
                # point may have landed between the two reads above: read once more.
                rows = await anyio.to_thread.run_sync(
                    store.metrics_after, job_id, last_step, 1 << 30
                )
                for r in rows:
                    yield format_event(event="metric", event_id=r["step"], data=r["data"])
                    last_step = r["step"]
                for e in await anyio.to_thread.run_sync(store.events, job_id, last_eid):
                    last_eid = e["id"]
                    yield format_event(event=e["level"], data=_event_data(e))
                end = {
                    "state": row.state,
                    "exit_code": row.exit_code,
                    "reason": row.reason,
                    "last_step": last_step if last_step >= 0 else None,
                }
                yield format_event(event="end", data=json.dumps(end))
                return
            wait = min(_MAX_IDLE_WAIT_S, max(0.0, heartbeat_s - (time.monotonic() - last_write)))
            # asyncio.TimeoutError: Python 3.10 raises that one, not the builtin.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(sub.event.wait(), timeout=wait)
            if time.monotonic() - last_write >= heartbeat_s:
                yield ": heartbeat\n\n"
                last_write = time.monotonic()
    finally:
        hub.unsubscribe(sub)
