"""One publisher per job for the event streams: what changed is read once and handed to
every open stream of the job.

- A job's :class:`JobFeed` wakes when the job changes (the hub's notification of a metric
  point, a recipe event or a transition), reads the new rows in one worker-thread call and
  appends them to a bounded log that every subscriber reads from memory.
- One ticker per event loop (:class:`EventStreams`) wakes, at most every second: the feeds
  when the jobs table changed (a queued job's place may have moved), every stream after a
  reload of the users (so a revoked token ends its streams), and the streams that owe a
  heartbeat.
- An idle stream costs its socket and nothing else: no timer, no query.

A stream joins its job's feed, then reads its own backlog from the database (the points
after its resume step, the job's events) and from then on reads the feed's log, skipping
what the backlog already held: items carry their step or row id, which only grow. One that
falls further behind than the log holds reads the database again from where it stands, so
a slow client loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Literal

import anyio

from dmuon_server.schemas import TERMINAL_STATES
from dmuon_server.schemas.views import Place, event_view, iso_utc
from dmuon_server.storage.records import JobRecord, PointRecord, StoredEvent, TransitionRecord
from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store
from dmuon_server.streams.metrics import Hub

log = logging.getLogger("dmuon_server.streams")

#: Items a feed keeps for subscribers that are behind (a slower one reads the database):
#: about 0.5 MB for points of 1 KB, per job with open streams.
LOG_SIZE = 512
#: Seconds a publisher waits before reading again after the database failed.
RETRY_S = 1.0
#: Points read from the database at once.
POINTS_PAGE = 500
#: Longest pause of the ticker (heartbeats due sooner make it tick sooner).
TICK_S = 1.0
#: ``reason`` of the ``end`` event sent to open streams when the server stops.
SHUTDOWN_REASON = "server_shutdown"

Places = Callable[[], Mapping[str, Place]]
Kind = Literal["metric", "state", "place", "event", "end"]


def format_event(*, data: str, event: str | None = None, event_id: int | None = None) -> str:
    """One SSE event; ``data`` must be a single line (compact JSON is)."""
    out = ""
    if event_id is not None:
        out += f"id: {event_id}\n"
    if event is not None:
        out += f"event: {event}\n"
    return out + f"data: {data}\n\n"


def state_text(t: TransitionRecord, row: JobRecord | None, place: Place | None) -> str:
    """The ``state`` event of transition ``t`` of the job ``row`` (queued: at ``place``)."""
    payload: dict[str, Any] = {"state": t.state, "reason": t.reason, "at": iso_utc(t.at)}
    if row is not None and t.state in TERMINAL_STATES:
        payload["exit_code"] = row.exit_code
    if t.state == JobState.QUEUED:
        payload["queue_position"] = place.position if place else None
        payload["queue_reason"] = place.reason if place else t.reason
    return format_event(event="state", data=json.dumps(payload))


def metric_text(point: PointRecord) -> str:
    """The ``metric`` event of a stored point (its ``id`` is the step)."""
    return format_event(event="metric", event_id=point.step, data=point.data)


def recipe_event_text(event: StoredEvent) -> str:
    """The ``warning`` or ``info`` event of a stored recipe event."""
    return format_event(event=event.level, data=event_view(event).model_dump_json())


@dataclass(frozen=True)
class Item:
    """One entry of a feed's log: ``key`` is the step (metric), the transition id (state,
    place) or the event id (event); ``end`` is the end payload, less ``last_step``."""

    kind: Kind
    key: int
    text: str = ""
    end: dict[str, Any] | None = None


@dataclass
class Cursor:
    """How far a reader of the database got: the last point, transition and event."""

    step: int = -1
    transition: int = 0
    event: int = 0
    last_t: TransitionRecord | None = None


def read_points(store: Store, job_id: str, cursor: Cursor) -> list[Item]:
    """Up to `POINTS_PAGE` points after ``cursor`` (advanced past them)."""
    items = []
    for point in store.metrics_after(job_id, cursor.step, POINTS_PAGE):
        items.append(Item("metric", point.step, metric_text(point)))
        cursor.step = point.step
    return items


def read_news(
    store: Store, job_id: str, cursor: Cursor, places: Places, last_place: Place | None
) -> tuple[list[Item], JobRecord | None, Place | None]:
    """What happened to a job after ``cursor`` (advanced past it), in stream order: points,
    transitions (or the last one again when only the queue place moved from
    ``last_place``), events; and the job's row and place.

    A terminal job's points are read again after its row: its last points may have landed
    between the first read and the read of its final state."""
    items: list[Item] = []

    def points() -> None:
        while True:
            page = read_points(store, job_id, cursor)
            items.extend(page)
            if len(page) < POINTS_PAGE:
                return

    points()
    row = store.get_job(job_id)
    place = places().get(job_id) if row is not None and row.state == JobState.QUEUED else None
    transitions = store.transitions_after(job_id, cursor.transition)
    for t in transitions:
        cursor.transition, cursor.last_t = t.id, t
        items.append(Item("state", t.id, state_text(t, row, place)))
    if not transitions and place != last_place and cursor.last_t is not None:
        items.append(Item("place", cursor.transition, state_text(cursor.last_t, row, place)))
    if row is not None and row.state in TERMINAL_STATES:
        points()
    for e in store.events(job_id, cursor.event):
        cursor.event = e.id
        items.append(Item("event", e.id, recipe_event_text(e)))
    return items, row, place


@dataclass(eq=False)
class Subscriber:
    """One open stream of a job: woken by its feed (news), the ticker (a heartbeat is due,
    the users were reloaded) or the server's shutdown."""

    feed: JobFeed
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: The last log entry this stream has handled.
    seq: int = 0
    last_write: float = field(default_factory=time.monotonic)


class JobFeed:
    """The publisher of one job's events, on one event loop."""

    def __init__(self, job_id: str, store: Store, hub: Hub, places: Places) -> None:
        self.job_id = job_id
        self.loop = asyncio.get_running_loop()
        self.store = store
        self.hub = hub
        self.places = places
        self.subscribers: set[Subscriber] = set()
        self.log: deque[tuple[int, Item]] = deque(maxlen=LOG_SIZE)
        #: Sequence number of the newest entry of the log (0: none yet).
        self.seq = 0
        self.ready = asyncio.Event()
        self.finished = False
        self._cursor = Cursor()
        #: The queue place the last ``state`` event published (a queued job's).
        self.place: Place | None = None
        self._hub_sub = hub.subscribe(job_id)
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def wake(self) -> None:
        """Make the publisher read the database again."""
        self._hub_sub.event.set()

    async def start(self) -> None:
        """Start where the database stands now; the publisher then reads only news."""
        self._cursor = await anyio.to_thread.run_sync(self._current)
        self._task = asyncio.create_task(self._publish(), name=f"feed {self.job_id}")
        self.ready.set()

    def _current(self) -> Cursor:
        history = self.store.history(self.job_id)
        events = self.store.events(self.job_id)
        last_step = self.store.metric_summary(self.job_id).last_step
        cursor = Cursor(
            step=-1 if last_step is None else last_step,
            transition=history[-1].id if history else 0,
            event=events[-1].id if events else 0,
            last_t=history[-1] if history else None,
        )
        row = self.store.get_job(self.job_id)
        if row is not None and row.state == JobState.QUEUED:
            self.place = self.places().get(self.job_id)
        return cursor

    def items_after(self, seq: int) -> list[Item] | None:
        """The log's entries after ``seq``; None when the log no longer holds them all."""
        if seq >= self.seq:
            return []
        first = self.log[0][0] if self.log else self.seq + 1
        if seq + 1 < first:
            return None
        return [item for _, item in islice(self.log, seq + 1 - first, None)]

    def close(self) -> None:
        """Stop publishing (the last subscriber left, or the loop's streams closed)."""
        self.finished = True
        self.hub.unsubscribe(self._hub_sub)
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def _publish(self) -> None:
        self._hub_sub.event.set()  # a first read: the job may have ended meanwhile
        while not self.finished:
            await self._hub_sub.event.wait()
            self._hub_sub.event.clear()
            try:
                items = await anyio.to_thread.run_sync(self._read)
            except Exception as e:  # the database failed: the streams wait, then read again
                if not self._failing:
                    log.warning(
                        "event streams of job %s: reading the store failed: %s", self.job_id, e
                    )
                self._failing = True
                await asyncio.sleep(RETRY_S)
                self._hub_sub.event.set()
                continue
            self._failing = False
            if items:
                for item in items:
                    self.seq += 1
                    self.log.append((self.seq, item))
                for sub in self.subscribers:
                    sub.wake.set()
            if items and items[-1].kind == "end":
                self.close()

    def _read(self) -> list[Item]:
        cursor = dataclasses.replace(self._cursor)  # kept only when the whole read succeeds
        items, row, place = read_news(self.store, self.job_id, cursor, self.places, self.place)
        self._cursor, self.place = cursor, place
        if row is None:
            items.append(Item("end", 0, end={"state": None, "deleted": True}))
        elif row.state in TERMINAL_STATES:
            end = {"state": row.state, "exit_code": row.exit_code, "reason": row.reason}
            items.append(Item("end", 0, end=end))
        elif self.hub.closing:
            end = {"state": row.state, "exit_code": None, "reason": SHUTDOWN_REASON}
            items.append(Item("end", 0, end=end))
        return items


class EventStreams:
    """The feeds of every job with open streams, and the ticker that serves them."""

    def __init__(
        self,
        store: Store,
        hub: Hub,
        places: Places = dict,
        users_generation: Callable[[], int] = lambda: 0,
        heartbeat_s: float = 15.0,
    ) -> None:
        self.store = store
        self.hub = hub
        self.places = places
        self.users_generation = users_generation
        self.heartbeat_s = heartbeat_s
        self._feeds: dict[tuple[asyncio.AbstractEventLoop, str], JobFeed] = {}
        self._tickers: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
        #: Open streams (the ``dmuon_active_streams`` gauge).
        self.open = 0

    async def join(self, job_id: str) -> Subscriber:
        """Subscribe to ``job_id``'s feed, starting it if it is the first stream."""
        loop = asyncio.get_running_loop()
        feed = self._feeds.get((loop, job_id))
        if feed is None or feed.finished:
            feed = JobFeed(job_id, self.store, self.hub, self.places)
            self._feeds[(loop, job_id)] = feed
            try:
                await feed.start()
            except BaseException:
                self._drop(feed)
                feed.ready.set()  # streams waiting for this start try again
                raise
            if loop not in self._tickers:
                self._tickers[loop] = asyncio.create_task(self._tick(loop), name="stream ticker")
        else:
            await feed.ready.wait()
            if feed.finished and not feed.log:  # its start failed: start one again
                return await self.join(job_id)
        sub = Subscriber(feed, seq=feed.seq)
        feed.subscribers.add(sub)
        self.open += 1
        return sub

    def leave(self, sub: Subscriber) -> None:
        """Unsubscribe; the feed stops with its last subscriber."""
        feed = sub.feed
        if sub in feed.subscribers:
            feed.subscribers.discard(sub)
            self.open -= 1
        if not feed.subscribers:
            self._drop(feed)

    def _drop(self, feed: JobFeed) -> None:
        feed.close()
        if self._feeds.get((feed.loop, feed.job_id)) is feed:
            del self._feeds[(feed.loop, feed.job_id)]

    async def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        version, generation = self.store.version, self.users_generation()
        pause = min(TICK_S, self.heartbeat_s / 4)
        try:
            while any(key[0] is loop for key in self._feeds):
                await asyncio.sleep(pause)
                feeds = [f for (lp, _), f in list(self._feeds.items()) if lp is loop]
                if self.store.version != version:
                    version = self.store.version
                    for feed in feeds:
                        feed.wake()
                reload = self.users_generation() != generation
                generation = self.users_generation()
                now = time.monotonic()
                for feed in feeds:
                    for sub in feed.subscribers:
                        if reload or now - sub.last_write >= self.heartbeat_s:
                            sub.wake.set()
        finally:
            with contextlib.suppress(KeyError):
                del self._tickers[loop]
