"""Jobs: submit (and dry-run), list, inspect, cancel, delete, read the log."""

from __future__ import annotations

import base64
import binascii
import os
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response

from dmuon_server.config import Settings, format_gib
from dmuon_server.http.dependencies import (
    IdentitiesDep,
    JobDep,
    SettingsDep,
    StoreDep,
    SupervisorDep,
    UserDep,
    may_see,
    user_name,
)
from dmuon_server.http.errors import ApiError, error_responses, field_error, invalid_request
from dmuon_server.http.views import job_view, ts
from dmuon_server.launching.command import plan_view
from dmuon_server.launching.identity import JobIdentities
from dmuon_server.launching.volumes import UserVolumes, quota_bytes
from dmuon_server.recipe.checkpoint_space import quota_refusal
from dmuon_server.recipe.review import Review, review
from dmuon_server.scheduling import requests
from dmuon_server.schemas import (
    Checkpoint,
    CheckpointList,
    FieldError,
    Job,
    JobCreate,
    JobList,
    JobState,
    LaunchPlan,
    LogLines,
    ResumeRequest,
)
from dmuon_server.storage.jobfiles import (
    CHECKPOINT_DIR,
    LOG_FILE,
    list_checkpoints,
    tail_lines,
)
from dmuon_server.storage.paths import PublicPaths
from dmuon_server.storage.store import Store
from dmuon_server.users import User

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _encode_cursor(seq: int) -> str:
    return base64.urlsafe_b64encode(f"seq:{seq}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        prefix, _, value = raw.partition(":")
        if prefix != "seq":
            raise ValueError(raw)
        seq = int(value)
        if not 0 <= seq < 2**62:
            raise ValueError(raw)
        return seq
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise ApiError(
            422,
            "Invalid request (query.cursor)",
            "query.cursor: not a cursor this server issued; pass the 'next' value of a "
            "previous page, or omit it for the first page",
            kind="invalid-request",
            errors=[field_error(("query", "cursor"), "not a valid cursor", "value_error")],
        ) from None


def _checkpoint_space_refusal(
    settings: Settings, user: User, disk_gib: float | None, accepted: Review
) -> FieldError | None:
    """Refuse a local job whose checkpoints cannot fit what is free of its user's disk
    quota: the mounted volume's free space, or the whole quota before the volume exists."""
    train = accepted.spec.train if accepted.spec is not None else None
    if disk_gib is None or train is None or accepted.admission is None:
        return None
    if settings.launcher != "local":
        return None  # Slurm's shared file system has quotas of its own
    name = user_name(user) or ""
    point = UserVolumes(settings.data_dir, settings.jobs_dir).mount_point(name)
    if os.path.ismount(point):
        st = os.statvfs(point)
        free = st.f_bavail * st.f_frsize
    else:
        free = quota_bytes(disk_gib)
    quota = f"user {name}'s disk quota ({format_gib(quota_bytes(disk_gib))}, disk_gib)"
    return quota_refusal(train, accepted.admission.model_params, free, quota)


def _accepted(
    settings: Settings, store: Store, identities: JobIdentities, user: User, body: JobCreate
) -> Review:
    """The review of ``body`` for ``user``; a 422 naming every field to change (with the
    estimates as ``admission`` when there are some) when the server cannot run it (a script
    job among them, when it would run as the server's own Unix account)."""

    def visible(job_id: str) -> bool:
        job = store.get_job(job_id)
        return job is not None and may_see(user, job)

    limits = identities.users.limits_of(user_name(user))
    accepted = review(settings, body, visible, limits.job_memory(settings.max_job_memory))
    account = body.account
    if account is not None and not identities.users.may_charge(user_name(user), account):
        accepted.errors.append(
            field_error(
                ("body", "account"),
                f"account {account!r} is not one you may charge: the users file lists your "
                "Slurm accounts (slurm_accounts); leave account out for the server's default",
                "value_error",
            )
        )
    space = _checkpoint_space_refusal(settings, user, limits.disk_gib, accepted)
    if space is not None:
        accepted.errors.append(space)
    refusal = identities.refusal(user_name(user) or "", script=body.script is not None)
    if refusal is not None:
        where = ("body", "script") if body.script is not None else ("body",)
        accepted.errors.append(field_error(where, refusal, "value_error"))
    if not accepted.accepted:
        problem = invalid_request(accepted.errors)
        if accepted.admission is not None:
            problem.extra = {"admission": accepted.admission.model_dump(mode="json")}
        raise problem
    return accepted


@router.post(
    "",
    status_code=201,
    response_model=Job,
    responses={
        200: {"description": "Same Idempotency-Key and spec: the existing job", "model": Job},
        201: {
            "description": "Job created and queued",
            "headers": {
                "Location": {"description": "URL of the job", "schema": {"type": "string"}}
            },
        },
        **error_responses(401, 403, 409, 413, 422, 429),
    },
)
def create_job(
    body: JobCreate,
    response: Response,
    settings: SettingsDep,
    store: StoreDep,
    supervisor: SupervisorDep,
    identities: IdentitiesDep,
    user: UserDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            min_length=1,
            max_length=255,
            pattern=r"^[\x21-\x7e]+$",
            description="Retry-safe submission: the same key and spec return the same job.",
        ),
    ] = None,
) -> Job:
    """Submit a training job (the recipe's, or your own script); it is queued, higher
    `priority` first and first come, first served within a priority.

    Refused with 422 when it cannot run: the checks and estimates of `:validate`. The
    `Idempotency-Key` is the submitting user's own.
    """
    accepted = _accepted(settings, store, identities, user, body)
    row, created = requests.submit(
        settings, store, identities, user_name(user), accepted, idempotency_key
    )
    if created:
        supervisor.wake()
    else:
        response.status_code = 200
    response.headers["Location"] = f"/v1/jobs/{row.id}"
    return job_view(store, row, supervisor.queue_places(), identities)


@router.post(":validate", response_model=LaunchPlan, responses=error_responses(401, 413, 422))
def validate_job(
    body: JobCreate,
    settings: SettingsDep,
    store: StoreDep,
    identities: IdentitiesDep,
    user: UserDep,
) -> LaunchPlan:
    """Dry run: the command, world size, global batch, estimates and warnings.

    Starts nothing. Answers 422, with the estimates as `admission`, for a job the
    server would refuse.
    """
    accepted = _accepted(settings, store, identities, user, body)
    ahead = len(store.jobs_in_states([JobState.QUEUED, JobState.STARTING, JobState.RUNNING]))
    return plan_view(settings, accepted, ahead)


@router.get("", response_model=JobList, responses=error_responses(401, 422))
def list_jobs(
    store: StoreDep,
    supervisor: SupervisorDep,
    identities: IdentitiesDep,
    user: UserDep,
    state: Annotated[
        list[JobState] | None, Query(description="Only jobs in these states (repeatable).")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=64,
            pattern=r"^[A-Za-z0-9_-]+$",
            description="`next` of the previous page.",
        ),
    ] = None,
    owner: Annotated[
        str | None,
        Query(
            alias="user",
            min_length=1,
            max_length=64,
            description="Only this user's jobs (an admin's filter; others see only their own).",
        ),
    ] = None,
) -> JobList:
    """Jobs, newest first, with cursor pagination: yours, or everyone's for an admin."""
    before = _decode_cursor(cursor) if cursor is not None else None
    scope = owner if user.admin else user_name(user)
    if not user.admin and owner is not None and owner != user.name:
        return JobList(items=[], next=None)  # another user's jobs do not exist for you
    rows = store.list_jobs(states=state, before_seq=before, limit=limit + 1, user=scope)
    page = rows[:limit]
    nxt = _encode_cursor(page[-1].seq) if len(rows) > limit else None
    places = supervisor.queue_places()
    return JobList(items=[job_view(store, r, places, identities) for r in page], next=nxt)


@router.get("/{job_id}", response_model=Job, responses=error_responses(401, 404, 422))
def get_job(
    job: JobDep, store: StoreDep, supervisor: SupervisorDep, identities: IdentitiesDep
) -> Job:
    """A job: state, history with reasons, exit code, failure, live summary, and its place
    in the queue while it waits."""
    return job_view(store, job, supervisor.queue_places(), identities)


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=Job,
    responses=error_responses(401, 404, 409, 422),
)
def cancel_job(
    job: JobDep, store: StoreDep, supervisor: SupervisorDep, identities: IdentitiesDep
) -> Job:
    """Cancel: SIGTERM to every process of the job, SIGKILL after the grace period.

    Idempotent; a queued job is cancelled at once. 409 for a job that already
    succeeded or failed, or that has trained all its steps and is finishing.
    """
    row = requests.cancel(supervisor, job)
    return job_view(store, row, None, identities)


@router.delete(
    "/{job_id}",
    status_code=204,
    response_class=Response,
    responses=error_responses(401, 404, 409, 422),
)
def delete_job(job: JobDep, settings: SettingsDep, store: StoreDep) -> Response:
    """Forget a finished job: its record, metrics and working folder.

    On a full disk (the database cannot even write its deletion) the folder of the
    finished job goes first, which frees the space the deletion needs.
    """
    requests.delete(settings, store, job)
    return Response(status_code=204)


@router.get("/{job_id}/logs", response_model=LogLines, responses=error_responses(401, 404, 422))
def get_logs(
    job: JobDep,
    settings: SettingsDep,
    tail: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> LogLines:
    """The last `tail` lines of the job's log (torchrun and every rank, teed).

    Server paths in the lines are shown as `<job-dir>`, `<data-dir>` and `<data-root>`.
    """
    job_dir = settings.job_dir(job.id)
    lines, truncated = tail_lines(job_dir / LOG_FILE, tail, root=job_dir)
    public = PublicPaths(settings, job_dir)
    return LogLines(lines=[public.text(line) for line in lines], truncated=truncated)


@router.get(
    "/{job_id}/checkpoints",
    response_model=CheckpointList,
    responses=error_responses(401, 404, 422),
)
def get_checkpoints(job: JobDep, settings: SettingsDep) -> CheckpointList:
    """The job's complete checkpoints, oldest first: step, size and time.

    Only finished saves count; one being written is not listed until it is complete.
    """
    job_dir = settings.job_dir(job.id)
    return CheckpointList(
        items=[
            Checkpoint(
                step=c.step,
                bytes=c.bytes,
                time=ts(c.mtime),  # type: ignore[arg-type]
                path=c.path.relative_to(job_dir).as_posix(),
            )
            for c in list_checkpoints(job_dir / CHECKPOINT_DIR)
        ]
    )


@router.post(
    "/{job_id}/resume",
    status_code=202,
    response_model=Job,
    responses=error_responses(401, 403, 404, 409, 413, 422, 429),
)
def resume_job(
    job: JobDep,
    settings: SettingsDep,
    store: StoreDep,
    supervisor: SupervisorDep,
    identities: IdentitiesDep,
    body: ResumeRequest | None = None,
) -> Job:
    """Continue a cancelled, failed or succeeded job from its latest checkpoint.

    The job is queued again as a new attempt (same id, same metrics series); `steps`
    raises its total number of steps. 409 while the job is queued or active, or when it
    has no checkpoint or nothing left to train; 429 when its user already has
    `queued_jobs` waiting and 403 when its priority is above their `max_priority`, as for
    a submission.
    """
    steps = body.steps if body is not None else None
    row = requests.resume(settings, store, identities, job, steps)
    supervisor.wake()
    return job_view(store, row, supervisor.queue_places(), identities)
