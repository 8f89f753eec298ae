"""Jobs: submit (and dry-run), list, inspect, cancel, delete, read the log."""

from __future__ import annotations

import base64
import binascii
import json
import shutil
import uuid
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response

from dmuon_server.dependencies import JobRow, SettingsDep, StoreDep, SupervisorDep
from dmuon_server.errors import ApiError, error_responses, field_error
from dmuon_server.fingerprint import spec_fingerprint
from dmuon_server.jobfiles import (
    CHECKPOINT_DIR,
    LOG_FILE,
    latest_checkpoint,
    link_tree,
    list_checkpoints,
    tail_lines,
)
from dmuon_server.launch import (
    build_command,
    init_path,
    plan_view,
    review,
    with_recipe_defaults,
)
from dmuon_server.paths import PublicPaths
from dmuon_server.schemas import (
    TERMINAL_STATES,
    Checkpoint,
    CheckpointList,
    Job,
    JobCreate,
    JobList,
    JobState,
    LaunchPlan,
    LogLines,
    ResumeRequest,
)
from dmuon_server.store import IdempotencyConflict
from dmuon_server.views import job_view, ts

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
    body = with_recipe_defaults(body)  # the job record shows the values used
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    job_id = uuid.uuid4().hex
    job_dir = settings.job_dir(job_id)
    init = accepted.init_checkpoint
    command = build_command(
        settings,
        body,
        job_dir,
        accepted.data_path,
        init,
        model_path=accepted.model_path,
        tokenizer_path=accepted.tokenizer_path,
    )
    if init is not None:
        # The job gets its own (hard-linked) copy before it exists in the store, so the
        # source job may prune or delete its checkpoint while this one waits in the queue.
        try:
            link_tree(init.path, init_path(job_dir, init))
        except OSError as e:
            shutil.rmtree(job_dir, ignore_errors=True)
            raise ApiError(
                409,
                "Checkpoint unavailable",
                f"the checkpoint of step {init.step} of job {body.init_from.job} could not "
                f"be read ({e.strerror or type(e).__name__}); it was probably pruned just "
                "now: submit again (with a step listed by GET /v1/jobs/"
                f"{body.init_from.job}/checkpoints)",
                kind="checkpoint-unavailable",
            ) from None
    try:
        row, created = store.create_job(
            job_id=job_id,
            name=body.name,
            nproc=body.nproc_per_node,
            spec=canonical,
            spec_hash=spec_fingerprint(body),
            idempotency_key=idempotency_key,
            argv=command.argv,
        )
    except IdempotencyConflict as e:
        shutil.rmtree(job_dir, ignore_errors=True)
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
        shutil.rmtree(job_dir, ignore_errors=True)
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


@router.get(
    "/{job_id}/checkpoints",
    response_model=CheckpointList,
    responses=error_responses(401, 404, 422),
)
def get_checkpoints(job: JobRow, settings: SettingsDep) -> CheckpointList:
    """The job's complete checkpoints, oldest first: step, size and time.

    Only finished saves count; one being written is not listed until it is complete.
    """
    job_dir = settings.job_dir(job["id"])
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
    responses=error_responses(401, 404, 409, 413, 422),
)
def resume_job(
    job: JobRow,
    settings: SettingsDep,
    store: StoreDep,
    supervisor: SupervisorDep,
    body: ResumeRequest | None = None,
) -> Job:
    """Continue a cancelled, failed or succeeded job from its latest checkpoint.

    The job is queued again as a new attempt (same id, same metrics series); `steps`
    raises its total number of steps. 409 while the job is queued or active, or when it
    has no checkpoint or nothing left to train.
    """
    job_id = job["id"]
    if job["state"] not in TERMINAL_STATES:
        raise ApiError(
            409,
            "Job not finished",
            f"job {job_id} is {job['state']}; only a cancelled, failed or succeeded job can "
            "be resumed (cancel it first: it saves a checkpoint as it stops)",
            kind="job-not-finished",
        )
    latest = latest_checkpoint(settings.job_dir(job_id) / CHECKPOINT_DIR)
    if latest is None:
        raise ApiError(
            409,
            "No checkpoint",
            f"job {job_id} saved no checkpoint, so there is nothing to resume from; "
            "submit it again as a new job",
            kind="no-checkpoint",
        )
    spec = JobCreate.model_validate_json(job["spec"])
    steps = body.steps if body is not None and body.steps is not None else spec.train.steps
    if steps <= latest.step:
        raise ApiError(
            409,
            "Nothing left to train",
            f"job {job_id}'s latest checkpoint is at step {latest.step} and the job trains "
            f"{steps} steps; pass a larger steps (more than {latest.step}) to train further",
            kind="nothing-to-resume",
        )
    new_spec = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": steps})})
    canonical = json.dumps(new_spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    reason = f"resume requested: from step {latest.step} to step {steps}"
    row = store.reopen(job_id, reason, spec=canonical)
    if row is None:  # it was resumed (or deleted) by a concurrent request
        raise ApiError(
            409,
            "Job not finished",
            f"job {job_id} was resumed by another request; GET /v1/jobs/{job_id}",
            kind="job-not-finished",
        )
    supervisor.wake()
    return job_view(store, row)
