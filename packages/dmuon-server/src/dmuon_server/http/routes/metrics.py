"""A job's metric points: stored pages and the live event stream (SSE)."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from dmuon_server.http.dependencies import (
    JobDep,
    StoreDep,
    StreamsDep,
    UserDep,
    UsersDep,
)
from dmuon_server.http.errors import error_responses
from dmuon_server.http.views import metric_point
from dmuon_server.schemas import TERMINAL_STATES, MetricPage
from dmuon_server.streams.events import SSE_HEADERS, job_events

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["metrics"])


@router.get(
    "/metrics",
    response_model=MetricPage,
    response_model_exclude_unset=True,
    responses=error_responses(401, 404, 422),
)
def get_metrics(
    job: JobDep,
    store: StoreDep,
    after_step: Annotated[
        int, Query(ge=-1, le=2**62, description="Only points with a larger step.")
    ] = -1,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
) -> MetricPage:
    """Stored metric points in step order; follow `next` until it is null."""
    rows = store.metrics_after(job.id, after_step, limit + 1)
    page = rows[:limit]
    nxt = page[-1].step if len(rows) > limit else None
    return MetricPage(items=[metric_point(r.data) for r in page], next=nxt)


@router.get(
    "/events",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "Server-Sent Events: `metric` (id = step), `state`, `end`.",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        204: {"description": "Reconnect to a finished job with nothing left to send."},
        **error_responses(401, 404, 422),
    },
)
async def get_events(
    request: Request,
    job: JobDep,
    users: UsersDep,
    user: UserDep,
    store: StoreDep,
    streams: StreamsDep,
    after_step: Annotated[
        int, Query(ge=-1, le=2**62, description="Start after this step (-1: everything).")
    ] = -1,
    last_event_id: Annotated[
        str | None,
        Header(
            alias="Last-Event-ID",
            pattern=r"^-?[0-9]{1,18}$",
            description="Resume after this step (takes precedence over after_step).",
        ),
    ] = None,
) -> Response:
    """Live metrics of a job as Server-Sent Events."""
    job_id = job.id
    start = max(-1, int(last_event_id)) if last_event_id is not None else after_step
    if last_event_id is not None and job.state in TERMINAL_STATES:
        rest = await anyio.to_thread.run_sync(store.metrics_after, job_id, start, 1)
        if not rest:
            return Response(status_code=204)
    return StreamingResponse(
        job_events(
            streams,
            store,
            job_id,
            start,
            users.watch(getattr(request.state, "token", None), user),
        ),
        media_type="text/event-stream; charset=utf-8",
        headers=SSE_HEADERS,
    )
