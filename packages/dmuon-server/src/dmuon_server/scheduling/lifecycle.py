"""The one way a job changes state: record the transition, then wake its streams."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store
from dmuon_server.streams.metrics import Hub


def move_job(
    store: Store,
    hub: Hub,
    job_id: str,
    state: JobState,
    reason: str,
    *,
    from_states: Iterable[JobState] | None = None,
    **fields: Any,
) -> bool:
    """Move a job to ``state`` (see :meth:`Store.transition`) and notify its event streams.

    Returns whether the job changed state.
    """
    changed = store.transition(job_id, state, reason, from_states=from_states, **fields)
    if changed:
        hub.notify(job_id)
    return changed
