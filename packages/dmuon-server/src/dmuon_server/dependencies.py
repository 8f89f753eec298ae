"""What routes receive through ``Depends``: settings, store, hub, supervisor, the job."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path, Request

from dmuon_server.config import Settings
from dmuon_server.errors import ApiError
from dmuon_server.metrics import Hub, MetricsTailer
from dmuon_server.store import Store
from dmuon_server.supervisor import Supervisor

JobId = Annotated[
    str, Path(min_length=1, max_length=64, description="Job id as returned on creation.")
]


def get_settings(request: Request) -> Settings:
    """The app's settings."""
    return request.app.state.settings


def get_store(request: Request) -> Store:
    """The app's database."""
    return request.app.state.store


def get_hub(request: Request) -> Hub:
    """The app's stream hub."""
    return request.app.state.hub


def get_supervisor(request: Request) -> Supervisor:
    """The app's supervisor."""
    return request.app.state.supervisor


def get_tailer(request: Request) -> MetricsTailer:
    """The app's metrics tailer."""
    return request.app.state.tailer


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
HubDep = Annotated[Hub, Depends(get_hub)]
SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
TailerDep = Annotated[MetricsTailer, Depends(get_tailer)]


def get_job_or_404(job_id: JobId, store: StoreDep) -> dict[str, Any]:
    """The stored row of the job in the path; 404 when there is none."""
    row = store.get_job(job_id)
    if row is None:
        raise ApiError(
            404,
            "Job not found",
            f"no job with id {job_id!r}; list jobs with GET /v1/jobs",
            kind="job-not-found",
        )
    return row


JobRow = Annotated[dict[str, Any], Depends(get_job_or_404)]
