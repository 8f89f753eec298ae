"""Turning stored rows into API models (jobs, summaries, metric points)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from dmuon_server.launching.identity import IdentityError, JobIdentities, server_account_name
from dmuon_server.schemas import (
    TERMINAL_STATES,
    Attempt,
    FailureInfo,
    Job,
    JobSummary,
    MetricPoint,
    Transition,
    spec_of,
)
from dmuon_server.schemas.views import Place, event_view, ts
from dmuon_server.storage.records import JobRecord
from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _enc(value: Any) -> Any:
    """A stored metric value as the API shows it (number, encoded non-finite, or None)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) or value in ("NaN", "Infinity", "-Infinity"):
        return value
    return None


def summarize(store: Store, job: JobRecord) -> JobSummary:
    """Progress of a job: last step and loss, tokens/s, elapsed time and ETA.

    The ETA uses the recipe's ``time`` (seconds since training started) between the first
    and last stored points when it increases, else the times the points arrived.
    """
    stats = store.metric_summary(job.id)
    steps = spec_of(job).steps
    last_step = stats.last_step
    now = time.time()
    elapsed = None
    if job.started_at is not None:
        elapsed = max(0.0, (job.finished_at or now) - job.started_at)
    eta = None
    if job.state == JobState.SUCCEEDED:
        eta = 0.0
    elif job.state not in TERMINAL_STATES and last_step is not None and steps is not None:
        d_step = last_step - (stats.first_step if stats.first_step is not None else last_step)
        sec_per_step = None
        t0, t1 = _num(stats.first_time), _num(stats.last_time)
        if d_step > 0 and t0 is not None and t1 is not None and t1 > t0:
            sec_per_step = (t1 - t0) / d_step
        elif d_step > 0:
            dt = (stats.last_received_at or 0.0) - (stats.first_received_at or 0.0)
            sec_per_step = dt / d_step if dt > 0 else None
        elif elapsed and last_step > 0:
            sec_per_step = elapsed / last_step
        if sec_per_step is not None:
            eta = max(0.0, (steps - last_step) * sec_per_step)
    return JobSummary(
        steps=steps,
        points=stats.points,
        rejected_lines=stats.rejected_lines,
        last_step=last_step,
        last_loss=_enc(stats.last_loss),
        last_val_loss=_enc(stats.last_val_loss),
        first_val_loss=_enc(stats.first_val_loss),
        tokens_per_s=_enc(stats.last_tokens_per_s),
        progress=min(1.0, max(0.0, (last_step or 0) / steps)) if steps else 0.0,
        elapsed_s=elapsed,
        eta_s=eta,
    )


def job_view(
    store: Store,
    job: JobRecord,
    places: Mapping[str, Place] | None = None,
    identities: JobIdentities | None = None,
) -> Job:
    """The API model of a stored job, with its history, live summary and, when it waits in
    the queue, its place there (``places``, from the supervisor); ``identities`` say which
    Unix account it runs as."""
    spec = spec_of(job)
    history = [
        Transition(state=h.state, reason=h.reason, at=ts(h.at))  # type: ignore[arg-type]
        for h in store.history(job.id)
    ]
    attempts = [
        Attempt(
            number=a.number,
            cause=a.cause,  # type: ignore[arg-type]
            resumed_from_step=a.resumed_from_step,
            started_at=ts(a.started_at),  # type: ignore[arg-type]
            finished_at=ts(a.finished_at),
            exit_code=a.exit_code,
            reason=a.reason,
            slurm_job_id=a.slurm_job_id,
        )
        for a in store.attempts(job.id)
    ]
    events = [event_view(e) for e in store.events(job.id)]
    failure = FailureInfo(**json.loads(job.failure)) if job.failure else None
    recipe_summary = json.loads(job.recipe_summary) if job.recipe_summary else None
    place = (places or {}).get(job.id) if job.state == JobState.QUEUED else None
    queue_reason = place.reason if place else (job.reason if job.state == JobState.QUEUED else None)
    return Job(
        id=job.id,
        name=job.name,
        state=job.state,  # type: ignore[arg-type]
        nproc_per_node=job.nproc,
        nnodes=spec.nnodes,
        partition=spec.partition,
        time_limit=spec.time_limit,
        account=spec.account,
        slurm_job_id=job.slurm_job_id,
        train=spec.train,
        script=spec.script,
        user=job.user,
        runs_as=_runs_as(identities, job.user),
        priority=spec.priority,
        gpus_per_node=spec.gpus_per_node,
        gpus=job.gpu_list,
        queue_position=place.position if place else None,
        queue_reason=queue_reason,
        max_restarts=spec.max_restarts,
        init_from=spec.init_from,
        created_at=ts(job.created_at),  # type: ignore[arg-type]
        started_at=ts(job.started_at),
        finished_at=ts(job.finished_at),
        exit_code=job.exit_code,
        reason=job.reason,
        cancel_requested=job.cancel_requested_at is not None,
        history=history,
        events=events,
        attempts=attempts,
        failure=failure,
        summary=summarize(store, job),
        recipe_summary=recipe_summary,
    )


def metric_point(data_json: str) -> MetricPoint:
    """A stored metric row's JSON as a :class:`MetricPoint`."""
    return MetricPoint.model_validate(json.loads(data_json))


def _runs_as(identities: JobIdentities | None, user: str | None) -> str | None:
    """The Unix account a job of ``user`` runs as: the user's ``unix_user``, the server's
    ``--job-user``, or the server's own account; None when it cannot be told (the
    account vanished from the host, which its launch reports)."""
    if identities is None:
        return None
    try:
        account = identities.account_for(user or "")
    except IdentityError:
        return None
    return account.name if account is not None else server_account_name()
