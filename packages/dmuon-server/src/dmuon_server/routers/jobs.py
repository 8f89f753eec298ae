"""Jobs: submit (and dry-run), list, inspect, cancel, delete, read the log."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import shutil
import uuid
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response

from dmuon_server.dependencies import JobRow, SettingsDep, StoreDep, SupervisorDep
from dmuon_server.errors import ApiError, error_responses, field_error
from dmuon_server.jobfiles import LOG_FILE, tail_lines
from dmuon_server.launch import build_command, plan_view, review
from dmuon_server.paths import PublicPaths
from dmuon_server.schemas import (
    TERMINAL_STATES,
    Job,
    JobCreate,
    JobList,
    JobState,
    LaunchPlan,
    LogLines,
)
from dmuon_server.store import IdempotencyConflict
from dmuon_server.views import job_view

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
        **error_responses(401, 409, 413, 422),
    },
)
def create_job(
    body: JobCreate,
    response: Response,
    settings: SettingsDep,
    store: StoreDep,
    supervisor: SupervisorDep,
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
    """Submit a training job; it is queued and started in FIFO order.

    Refused with 422 when it cannot run: the checks and estimates of `:validate`.
    """
    accepted = review(settings, body)
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    job_id = uuid.uuid4().hex
    command = build_command(settings, body, settings.job_dir(job_id), accepted.data_path)
    try:
        row, created = store.create_job(
            job_id=job_id,
            name=body.name,
            nproc=body.nproc_per_node,
            spec=canonical,
            spec_hash=hashlib.sha256(canonical.encode()).hexdigest(),
            idempotency_key=idempotency_key,
            argv=command.argv,
        )
    except IdempotencyConflict as e:
        raise ApiError(
            409,
            "Idempotency-Key already used",
            f"the Idempotency-Key was used for job {e.job_id} with a different spec; "
            "use a new key for a new job, or resend the original spec",
            kind="idempotency-conflict",
            extra={"job_id": e.job_id},
        ) from None
    if created:
        supervisor.wake()
    else:
        response.status_code = 200
    response.headers["Location"] = f"/v1/jobs/{row['id']}"
    return job_view(store, row)


@router.post(":validate", response_model=LaunchPlan, responses=error_responses(401, 413, 422))
def validate_job(body: JobCreate, settings: SettingsDep, store: StoreDep) -> LaunchPlan:
    """Dry run: the command, world size, global batch, estimates and warnings.

    Starts nothing. Answers 422, with the estimates as `admission`, for a job the
    server would refuse.
    """
    accepted = review(settings, body)
    ahead = len(store.jobs_in_states(["queued", "starting", "running"]))
    return plan_view(settings, body, accepted, ahead)


@router.get("", response_model=JobList, responses=error_responses(401, 422))
def list_jobs(
    store: StoreDep,
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
) -> JobList:
    """Jobs, newest first, with cursor pagination."""
    before = _decode_cursor(cursor) if cursor is not None else None
    rows = store.list_jobs(states=state, before_seq=before, limit=limit + 1)
    page = rows[:limit]
    nxt = _encode_cursor(page[-1]["seq"]) if len(rows) > limit else None
    return JobList(items=[job_view(store, r) for r in page], next=nxt)


@router.get("/{job_id}", response_model=Job, responses=error_responses(401, 404, 422))
def get_job(job: JobRow, store: StoreDep) -> Job:
    """A job: state, history with reasons, exit code, failure, live summary."""
    return job_view(store, job)


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=Job,
    responses=error_responses(401, 404, 409, 422),
)
def cancel_job(job: JobRow, store: StoreDep, supervisor: SupervisorDep) -> Job:
    """Cancel: SIGTERM to every process of the job, SIGKILL after the grace period.

    Idempotent; a queued job is cancelled at once. 409 for a job that already
    succeeded or failed.
    """
    row = supervisor.cancel(job["id"]) or job
    if row["state"] in ("succeeded", "failed"):
        raise ApiError(
            409,
            "Job already finished",
            f"job {job['id']} already {row['state']}; there is nothing to cancel",
            kind="job-finished",
        )
    return job_view(store, row)


@router.delete(
    "/{job_id}",
    status_code=204,
    response_class=Response,
    responses=error_responses(401, 404, 409, 422),
)
def delete_job(job: JobRow, settings: SettingsDep, store: StoreDep) -> Response:
    """Forget a finished job: its record, metrics and working folder."""
    job_id = job["id"]
    if job["state"] not in TERMINAL_STATES or not store.delete_job(job_id):
        raise ApiError(
            409,
            "Job not finished",
            f"job {job_id} is {job['state']}; cancel it first and delete it once it is cancelled",
            kind="job-not-finished",
        )
    shutil.rmtree(settings.job_dir(job_id), ignore_errors=True)
    return Response(status_code=204)


@router.get("/{job_id}/logs", response_model=LogLines, responses=error_responses(401, 404, 422))
def get_logs(
    job: JobRow,
    settings: SettingsDep,
    tail: Annotated[int, Query(ge=1, le=10_000)] = 100,
) -> LogLines:
    """The last `tail` lines of the job's log (torchrun and every rank, teed).

    Server paths in the lines are shown as `<job-dir>`, `<data-dir>` and `<data-root>`.
    """
    job_dir = settings.job_dir(job["id"])
    lines, truncated = tail_lines(job_dir / LOG_FILE, tail)
    public = PublicPaths(settings, job_dir)
    return LogLines(lines=[public.text(line) for line in lines], truncated=truncated)
