"""Jobs: submit (and dry-run), list, inspect, cancel, delete, read the log."""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from typing import Annotated

from fastapi import APIRouter, Header, Query, Response

from dmuon_server.config import Settings
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
from dmuon_server.launching.command import build_command, init_path, plan_view
from dmuon_server.launching.identity import JobIdentities
from dmuon_server.launching.volumes import remove_job_folder
from dmuon_server.recipe.fingerprint import spec_fingerprint
from dmuon_server.recipe.review import Review, review
from dmuon_server.scheduling.supervisor import JobFinishing
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
    spec_of,
)
from dmuon_server.storage.jobfiles import (
    CHECKPOINT_DIR,
    LOG_FILE,
    latest_checkpoint,
    link_tree,
    list_checkpoints,
    tail_lines,
)
from dmuon_server.storage.paths import PublicPaths
from dmuon_server.storage.store import IdempotencyConflict, Store, StoreFull
from dmuon_server.users import Limits, User

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


def _accepted(
    settings: Settings, store: Store, identities: JobIdentities, user: User, body: JobCreate
) -> Review:
    """The review of ``body`` for ``user``; a 422 naming every field to change (with the
    estimates as ``admission`` when there are some) when the server cannot run it (a script
    job among them, when it would run as the server's own Unix account)."""

    def visible(job_id: str) -> bool:
        job = store.get_job(job_id)
        return job is not None and may_see(user, job)

    accepted = review(settings, body, visible)
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


def _check_limits(
    limits: Limits, priority: int, store: Store, who: str | None, key: str | None = None
) -> None:
    """Refuse to queue a job of ``who`` beyond their limits (the users file): a priority
    above ``max_priority`` (403), or a job beyond ``queued_jobs`` waiting (429). Every path
    that queues a job asks (a submission, a resume). A retry of a submission that created
    its job (same ``Idempotency-Key``) is not counted again."""
    if limits.max_priority is not None and priority > limits.max_priority:
        raise ApiError(
            403,
            "Priority above your limit",
            f"priority {priority} is above the highest you may give, "
            f"{limits.max_priority} (your limits in the users file); use a lower one",
            kind="over-limit",
        )
    if limits.queued_jobs is None:
        return
    if key is not None and store.job_by_key(who, key) is not None:
        return  # a retry: the store answers it
    waiting = store.queued_count(who)
    if waiting >= limits.queued_jobs:
        raise ApiError(
            429,
            "Queue limit reached",
            f"you have {waiting} jobs queued, your limit (queued_jobs in the users file); "
            "submit or resume again when one has started, or cancel one",
            kind="over-limit",
        )


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
    who = user_name(user)
    _check_limits(identities.users.limits_of(who), body.priority, store, who, idempotency_key)
    body = accepted.spec  # with the recipe's defaults: the job record shows the values used
    assert body is not None
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    job_id = uuid.uuid4().hex
    job_dir = settings.job_dir(job_id)
    init = accepted.init_checkpoint
    command = build_command(settings, job_dir, accepted)
    if init is not None:
        # The job gets its own (hard-linked) copy before it exists in the store, so the
        # source job may prune or delete its checkpoint while this one waits in the queue.
        try:
            owner = identities.account_for(user_name(user) or "")
            link_tree(init.path, init_path(job_dir, init), owner)
        except OSError as e:
            remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
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
            user=user_name(user),
            priority=body.priority,
        )
    except IdempotencyConflict as e:
        remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
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
        remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
        response.status_code = 200
    response.headers["Location"] = f"/v1/jobs/{row.id}"
    return job_view(store, row, supervisor.queue_places())


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
    return JobList(items=[job_view(store, r, places) for r in page], next=nxt)


@router.get("/{job_id}", response_model=Job, responses=error_responses(401, 404, 422))
def get_job(job: JobDep, store: StoreDep, supervisor: SupervisorDep) -> Job:
    """A job: state, history with reasons, exit code, failure, live summary, and its place
    in the queue while it waits."""
    return job_view(store, job, supervisor.queue_places())


@router.post(
    "/{job_id}/cancel",
    status_code=202,
    response_model=Job,
    responses=error_responses(401, 404, 409, 422),
)
def cancel_job(job: JobDep, store: StoreDep, supervisor: SupervisorDep) -> Job:
    """Cancel: SIGTERM to every process of the job, SIGKILL after the grace period.

    Idempotent; a queued job is cancelled at once. 409 for a job that already
    succeeded or failed, or that has trained all its steps and is finishing.
    """
    try:
        row = supervisor.cancel(job.id) or job
    except JobFinishing as e:
        raise ApiError(
            409,
            "Job finishing",
            f"job {e.job_id} has trained all its {e.steps} steps and is saving its last "
            "checkpoint; it ends succeeded in a moment, and a cancel now would only lose "
            "that work",
            kind="job-finishing",
        ) from None
    if row.state in (JobState.SUCCEEDED, JobState.FAILED):
        raise ApiError(
            409,
            "Job already finished",
            f"job {job.id} already {row.state}; there is nothing to cancel",
            kind="job-finished",
        )
    return job_view(store, row)


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
    job_id = job.id
    try:
        deleted = job.state in TERMINAL_STATES and store.delete_job(job_id)
    except StoreFull:
        remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
        deleted = store.delete_job(job_id)
    if not deleted:
        raise ApiError(
            409,
            "Job not finished",
            f"job {job_id} is {job.state}; cancel it first and delete it once it is cancelled",
            kind="job-not-finished",
        )
    remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
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
    job_id = job.id
    if job.state not in TERMINAL_STATES:
        raise ApiError(
            409,
            "Job not finished",
            f"job {job_id} is {job.state}; only a cancelled, failed or succeeded job can "
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
    spec = spec_of(job)
    steps = body.steps if body is not None and body.steps is not None else spec.steps
    if steps is not None and steps <= latest.step:
        raise ApiError(
            409,
            "Nothing left to train",
            f"job {job_id}'s latest checkpoint is at step {latest.step} and the job trains "
            f"{steps} steps; pass a larger steps (more than {latest.step}) to train further",
            kind="nothing-to-resume",
        )
    _check_limits(identities.users.limits_of(job.user), job.priority, store, job.user)
    new_spec = spec.with_steps(steps) if steps is not None else spec
    canonical = json.dumps(new_spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    to = f"to step {steps}" if steps is not None else "on"
    reason = f"resume requested: from step {latest.step} {to}"
    row = store.reopen(job_id, reason, spec=canonical)
    if row is None:  # it was resumed (or deleted) by a concurrent request
        raise ApiError(
            409,
            "Job not finished",
            f"job {job_id} was resumed by another request; GET /v1/jobs/{job_id}",
            kind="job-not-finished",
        )
    supervisor.wake()
    return job_view(store, row, supervisor.queue_places())
