"""What the service does when a user submits, resumes, cancels or deletes a job, apart
from HTTP: the checks, the limits of the users file, the job's folder and record.

Each function either does the whole thing or raises `Refusal`, saying why and what to do;
the HTTP layer answers a refusal as problem details (``status`` is the answer's status).
Every path that queues a job (a submission, a resume) counts against the user's
``queued_jobs`` and ``max_priority`` (:func:`check_limits`).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from dmuon_server.config import Settings
from dmuon_server.launching.command import build_command, init_path
from dmuon_server.launching.identity import JobIdentities
from dmuon_server.launching.volumes import remove_job_folder
from dmuon_server.recipe.fingerprint import spec_fingerprint
from dmuon_server.recipe.review import Review
from dmuon_server.scheduling.supervisor import JobFinishing, Supervisor
from dmuon_server.schemas import TERMINAL_STATES, JobState, spec_of
from dmuon_server.storage.jobfiles import CHECKPOINT_DIR, latest_checkpoint, link_tree
from dmuon_server.storage.records import JobRecord
from dmuon_server.storage.store import IdempotencyConflict, Store, StoreFull
from dmuon_server.users import Limits


class Refusal(Exception):
    """A request the service refuses: ``status`` (403, 409, 429), a ``title``, a ``detail``
    saying what to do, and a ``kind`` (the problem type)."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        kind: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Describe the refusal; ``extra`` adds members to the answer."""
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.kind = kind
        self.extra = extra or {}


def _canonical(spec: Any) -> str:
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def check_limits(
    limits: Limits, priority: int, store: Store, who: str | None, key: str | None = None
) -> None:
    """Refuse to queue a job of ``who`` beyond their limits (the users file): a priority
    above ``max_priority`` (403), or a job beyond ``queued_jobs`` waiting (429). A retry of
    a submission that created its job (same ``Idempotency-Key``) is not counted again."""
    if limits.max_priority is not None and priority > limits.max_priority:
        raise Refusal(
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
        raise Refusal(
            429,
            "Queue limit reached",
            f"you have {waiting} jobs queued, your limit (queued_jobs in the users file); "
            "submit or resume again when one has started, or cancel one",
            kind="over-limit",
        )


def submit(
    settings: Settings,
    store: Store,
    identities: JobIdentities,
    who: str | None,
    accepted: Review,
    idempotency_key: str | None,
) -> tuple[JobRecord, bool]:
    """Queue the job ``accepted`` (a reviewed spec) for ``who``: ``(its record, whether it
    was created)``; a retry with the same ``Idempotency-Key`` and spec returns the first.

    Raises `Refusal`: over the user's limits, a checkpoint to start from that is gone
    (409), or an ``Idempotency-Key`` used for another spec (409).
    """
    spec = accepted.spec  # with the recipe's defaults: the job record shows the values used
    assert spec is not None
    check_limits(identities.users.limits_of(who), spec.priority, store, who, idempotency_key)
    job_id = uuid.uuid4().hex
    job_dir = settings.job_dir(job_id)
    init = accepted.init_checkpoint
    command = build_command(settings, job_dir, accepted)
    if init is not None:
        # The job gets its own (hard-linked) copy before it exists in the store, so the
        # source job may prune or delete its checkpoint while this one waits in the queue.
        try:
            link_tree(init.path, init_path(job_dir, init), identities.account_for(who or ""))
        except OSError as e:
            remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
            source = spec.init_from.job if spec.init_from is not None else "?"
            raise Refusal(
                409,
                "Checkpoint unavailable",
                f"the checkpoint of step {init.step} of job {source} could not be read "
                f"({e.strerror or type(e).__name__}); it was probably pruned just now: "
                f"submit again (with a step listed by GET /v1/jobs/{source}/checkpoints)",
                kind="checkpoint-unavailable",
            ) from None
    try:
        row, created = store.create_job(
            job_id=job_id,
            name=spec.name,
            nproc=spec.nproc_per_node,
            spec=_canonical(spec),
            spec_hash=spec_fingerprint(spec),
            idempotency_key=idempotency_key,
            argv=command.argv,
            user=who,
            priority=spec.priority,
        )
    except IdempotencyConflict as e:
        remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
        raise Refusal(
            409,
            "Idempotency-Key already used",
            f"the Idempotency-Key was used for job {e.job_id} with a different spec; "
            "use a new key for a new job, or resend the original spec",
            kind="idempotency-conflict",
            extra={"job_id": e.job_id},
        ) from None
    if not created:
        remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
    return row, created


def resume(
    settings: Settings,
    store: Store,
    identities: JobIdentities,
    job: JobRecord,
    steps: int | None,
) -> JobRecord:
    """Queue a finished ``job`` again from its latest checkpoint (to ``steps`` if given);
    its queued record. Raises `Refusal`: the job is not finished, has no checkpoint or
    nothing left to train (409), or its user is over their limits."""
    job_id = job.id
    if job.state not in TERMINAL_STATES:
        raise Refusal(
            409,
            "Job not finished",
            f"job {job_id} is {job.state}; only a cancelled, failed or succeeded job can "
            "be resumed (cancel it first: it saves a checkpoint as it stops)",
            kind="job-not-finished",
        )
    recipe = spec_of(job).train is not None
    latest = latest_checkpoint(settings.job_dir(job_id) / CHECKPOINT_DIR, recipe=recipe)
    if latest is None:
        raise Refusal(
            409,
            "No checkpoint",
            f"job {job_id} saved no checkpoint, so there is nothing to resume from; "
            "submit it again as a new job",
            kind="no-checkpoint",
        )
    spec = spec_of(job)
    steps = steps if steps is not None else spec.steps
    if steps is not None and steps <= latest.step:
        raise Refusal(
            409,
            "Nothing left to train",
            f"job {job_id}'s latest checkpoint is at step {latest.step} and the job trains "
            f"{steps} steps; pass a larger steps (more than {latest.step}) to train further",
            kind="nothing-to-resume",
        )
    check_limits(identities.users.limits_of(job.user), job.priority, store, job.user)
    new_spec = spec.with_steps(steps) if steps is not None else spec
    to = f"to step {steps}" if steps is not None else "on"
    row = store.reopen(
        job_id, f"resume requested: from step {latest.step} {to}", spec=_canonical(new_spec)
    )
    if row is None:  # it was resumed (or deleted) by a concurrent request
        raise Refusal(
            409,
            "Job not finished",
            f"job {job_id} was resumed by another request; GET /v1/jobs/{job_id}",
            kind="job-not-finished",
        )
    return row


def cancel(supervisor: Supervisor, job: JobRecord) -> JobRecord:
    """Cancel ``job`` (see `Supervisor.cancel`); its record. Raises `Refusal` (409) for a
    job that already succeeded or failed, or that trained all its steps and is saving."""
    try:
        row = supervisor.cancel(job.id) or job
    except JobFinishing as e:
        raise Refusal(
            409,
            "Job finishing",
            f"job {e.job_id} has trained all its {e.steps} steps and is saving its last "
            "checkpoint; it ends succeeded in a moment, and a cancel now would only lose "
            "that work",
            kind="job-finishing",
        ) from None
    if row.state in (JobState.SUCCEEDED, JobState.FAILED):
        raise Refusal(
            409,
            "Job already finished",
            f"job {job.id} already {row.state}; there is nothing to cancel",
            kind="job-finished",
        )
    return row


def delete(settings: Settings, store: Store, job: JobRecord) -> None:
    """Forget a finished ``job``: its record, metrics and folder (on its user's volume
    too). On a full disk, where the database cannot even write the deletion, the folder
    goes first, which frees the space. Raises `Refusal` (409) for a job not finished."""
    job_id = job.id
    try:
        deleted = job.state in TERMINAL_STATES and store.delete_job(job_id)
    except StoreFull:
        remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
        deleted = store.delete_job(job_id)
    if not deleted:
        raise Refusal(
            409,
            "Job not finished",
            f"job {job_id} is {job.state}; cancel it first and delete it once it is cancelled",
            kind="job-not-finished",
        )
    remove_job_folder(settings.data_dir, settings.jobs_dir, job_id)
