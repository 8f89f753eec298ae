"""Stored rows as the API shows them, where the routes and the event streams both need
them: times, recipe events, a queued job's place."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from pydantic import TypeAdapter

from dmuon_server.schemas.responses import JobEvent
from dmuon_server.storage.records import StoredEvent


@dataclass(frozen=True)
class Place:
    """Where a waiting job stands: 1 for the next to start, and why it waits."""

    position: int
    reason: str


def ts(value: float | None) -> datetime | None:
    """A stored unix time as an aware UTC datetime."""
    return None if value is None else datetime.fromtimestamp(value, tz=timezone.utc)


def iso_utc(value: float) -> str:
    """A stored unix time as the API writes times everywhere: ISO 8601, UTC, ``Z``."""
    return TypeAdapter(datetime).dump_python(ts(value), mode="json")


def event_view(event: StoredEvent) -> JobEvent:
    """A stored recipe event (one of :meth:`Store.events`) as the API shows it."""
    return JobEvent(
        kind=event.kind,
        level=event.level,
        message=event.message,
        step=event.step,
        attempt=event.attempt,
        at=ts(event.at),  # type: ignore[arg-type]
    )
