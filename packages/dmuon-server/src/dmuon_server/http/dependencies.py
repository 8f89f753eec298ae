"""What routes receive through ``Depends``: settings, store, hub, supervisor, the user, the
job (one the user may see)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Request

from dmuon_server.config import Settings
from dmuon_server.http.errors import ApiError
from dmuon_server.launching.identity import JobIdentities
from dmuon_server.scheduling.supervisor import Supervisor
from dmuon_server.storage.records import JobRecord
from dmuon_server.storage.store import Store
from dmuon_server.streams.feeds import EventStreams
from dmuon_server.streams.metrics import Hub, MetricsTailer
from dmuon_server.users import ANONYMOUS, User, Users

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


def get_streams(request: Request) -> EventStreams:
    """The publishers of the jobs' event streams."""
    return request.app.state.streams


def get_supervisor(request: Request) -> Supervisor:
    """The app's supervisor."""
    return request.app.state.supervisor


def get_tailer(request: Request) -> MetricsTailer:
    """The app's metrics tailer."""
    return request.app.state.tailer


def get_users(request: Request) -> Users:
    """The app's users."""
    return request.app.state.users


def get_identities(request: Request) -> JobIdentities:
    """Which Unix account each job runs as."""
    return request.app.state.identities


def get_user(request: Request) -> User:
    """Who the request comes from (the token middleware says; without tokens, anyone)."""
    return getattr(request.state, "user", ANONYMOUS)


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
HubDep = Annotated[Hub, Depends(get_hub)]
StreamsDep = Annotated[EventStreams, Depends(get_streams)]
SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
TailerDep = Annotated[MetricsTailer, Depends(get_tailer)]
UsersDep = Annotated[Users, Depends(get_users)]
UserDep = Annotated[User, Depends(get_user)]
IdentitiesDep = Annotated[JobIdentities, Depends(get_identities)]


def may_see(user: User, job: JobRecord) -> bool:
    """Whether ``user`` may see ``job``: their own, or any for an admin."""
    return user.admin or job.user == user.name


def user_name(user: User) -> str | None:
    """The name a job of ``user`` records (None without users)."""
    return user.name or None


def not_found(job_id: str) -> ApiError:
    """The 404 of a job that does not exist, or that the user may not see."""
    return ApiError(
        404,
        "Job not found",
        f"no job with id {job_id!r}; list jobs with GET /v1/jobs",
        kind="job-not-found",
    )


def get_job_or_404(job_id: JobId, store: StoreDep, user: UserDep) -> JobRecord:
    """The job in the path; 404 when there is none, or it is another user's."""
    job = store.get_job(job_id)
    if job is None or not may_see(user, job):
        raise not_found(job_id)
    return job


def require_admin(user: UserDep) -> User:
    """The user, when an admin; 403 otherwise."""
    if not user.admin:
        raise ApiError(
            403,
            "Admins only",
            f"user {user.name!r} is not an admin; ask one, or use an admin's token",
            kind="admins-only",
        )
    return user


JobDep = Annotated[JobRecord, Depends(get_job_or_404)]
AdminDep = Annotated[User, Depends(require_admin)]
