"""The API's responses: jobs, their history, attempts, events and summaries, metric pages,
the launch plan and its estimates, artifacts, logs, users, health and problems."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)

from dmuon_server.schemas.common import (
    EncodedFloat,
)
from dmuon_server.schemas.job_spec import (
    InitFrom,
    ScriptSpec,
)
from dmuon_server.schemas.train_spec import (
    TrainSpec,
)
from dmuon_server.storage.states import JobState


class Attempt(BaseModel):
    """One launch of a job's processes."""

    number: int = Field(description="1 for the first launch, then 2, 3, ...")
    cause: Literal["submitted", "restart", "resume"] = Field(
        description="`submitted`: the first launch; `restart`: relaunched after a rank "
        "died (`max_restarts`); `resume`: `POST /v1/jobs/{id}/resume`."
    )
    resumed_from_step: int | None = Field(
        default=None, description="Step of the checkpoint it resumed from (null: from scratch)."
    )
    started_at: datetime
    finished_at: datetime | None = None
    exit_code: int | None = Field(
        default=None, description="Exit code (of the failing rank; negative: a signal)."
    )
    reason: str | None = Field(default=None, description="How the attempt ended.")
    slurm_job_id: str | None = Field(
        default=None, description="Slurm's job id of the attempt (Slurm launcher only)."
    )


class Checkpoint(BaseModel):
    """A complete checkpoint in the job's `checkpoints/` folder."""

    step: int
    bytes: int = Field(description="Total size of its files.")
    time: datetime = Field(description="When it was completed.")
    path: str = Field(description="Folder relative to the job's folder.")


class CheckpointList(BaseModel):
    """A job's complete checkpoints, oldest first."""

    items: list[Checkpoint]


class Transition(BaseModel):
    """One state change of a job."""

    state: JobState
    reason: str
    at: datetime


class JobEvent(BaseModel):
    """Something the job's recipe reported besides its metric points (an event line of its
    metrics file): a damaged checkpoint it skipped, a checkpoint it could not write, a stop
    on a signal."""

    kind: str = Field(
        description="The recipe's event: `checkpoint_skipped` (`--resume auto` passed over "
        "a damaged checkpoint), `checkpoint_failed` (a checkpoint could not be written and "
        "`--on-checkpoint-error warn` kept training), `stopped` (a signal stopped it)."
    )
    level: Literal["warning", "info"] = Field(
        description="`warning` for `checkpoint_skipped` and `checkpoint_failed`."
    )
    message: str = Field(description="What happened, naming the checkpoint and the cause.")
    step: int | None = Field(default=None, description="The step it concerns, if any.")
    attempt: int = Field(description="The attempt whose recipe reported it.")
    at: datetime = Field(description="When the server read it.")


class FailureInfo(BaseModel):
    """Why a job failed: the first failing rank and the end of its log."""

    rank: int | None = Field(description="Global rank that failed first (null if unknown).")
    exit_code: int | None = Field(description="Its exit code; negative for a signal.")
    signal: str | None = Field(default=None, description="Signal name when killed by one.")
    error_type: str | None = Field(
        default=None,
        description="Exception type the failing rank recorded (torchrun's error file), "
        "e.g. `ValueError`; `UsageError` for invalid recipe flags.",
    )
    message: str | None = Field(default=None, description="Error message, when one is known.")
    log_file: str | None = Field(
        default=None, description="Log file the lines come from, relative to the job's folder."
    )
    log_tail: list[str] = Field(default_factory=list, description="Last lines of that log.")
    limit: str | None = Field(
        default=None,
        description="The kernel limit that stopped the job (its memory or its number of "
        "processes, from the job's cgroup), when one did.",
    )


class JobSummary(BaseModel):
    """Live progress of a job, from its stored metrics."""

    steps: int | None = Field(
        description="Optimizer steps the job was asked to run (null: a script that did not say)."
    )
    points: int = Field(description="Metric points stored.")
    rejected_lines: int = Field(
        default=0,
        description="Lines of the metrics file that were not stored (not JSON, not an "
        "object, nested too deep, a number or string no response can hold); the server's "
        "log names each.",
    )
    last_step: int | None = None
    last_loss: EncodedFloat | None = None
    last_val_loss: EncodedFloat | None = None
    first_val_loss: EncodedFloat | None = None
    tokens_per_s: EncodedFloat | None = None
    progress: float = Field(description="last_step / steps, between 0 and 1.")
    elapsed_s: float | None = Field(default=None, description="Seconds since the job started.")
    eta_s: float | None = Field(default=None, description="Estimated seconds left.")


class Job(BaseModel):
    """A job as the API shows it."""

    id: str
    name: str | None
    state: JobState
    nproc_per_node: int
    nnodes: int = 1
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    slurm_job_id: str | None = Field(
        default=None, description="Slurm's job id of the latest attempt (Slurm launcher only)."
    )
    train: TrainSpec | None = None
    script: ScriptSpec | None = None
    user: str | None = Field(
        default=None,
        description="Who submitted it: a name from the users file, `admin` for `--token` "
        "(null on a server without tokens).",
    )
    runs_as: str | None = Field(
        default=None,
        description="The Unix account its processes run as: the user's `unix_user`, the "
        "server's `--job-user`, or the account the server runs as.",
    )
    priority: int = 0
    gpus_per_node: int | None = None
    gpus: list[int] = Field(
        default_factory=list,
        description="The GPUs it holds while it runs (`CUDA_VISIBLE_DEVICES` of its "
        "processes); empty without.",
    )
    queue_position: int | None = Field(
        default=None, description="1 for the next job to start; null unless queued."
    )
    queue_reason: str | None = Field(
        default=None,
        description="Why a queued job waits, e.g. `waiting for 4 GPUs: 2 free, 1 job ahead`.",
    )
    max_restarts: int = 0
    init_from: InitFrom | None = None
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    exit_code: int | None = Field(
        default=None, description="Exit code; for a failed rank, that rank's (negative: signal)."
    )
    reason: str | None = Field(default=None, description="Reason of the latest transition.")
    cancel_requested: bool = False
    history: list[Transition] = Field(default_factory=list)
    events: list[JobEvent] = Field(
        default_factory=list,
        description="What the recipe reported besides metric points, oldest first; the "
        "event stream sends each as a `warning` or `info` event.",
    )
    attempts: list[Attempt] = Field(
        default_factory=list, description="Each launch of the job's processes, oldest first."
    )
    failure: FailureInfo | None = None
    summary: JobSummary
    recipe_summary: dict[str, Any] | None = Field(
        default=None, description="The recipe's own final summary line, when it wrote one."
    )


class JobList(BaseModel):
    """A page of jobs, newest first."""

    items: list[Job]
    next: str | None = Field(description="Pass as `cursor` for the next page; null at the end.")


class MetricPoint(BaseModel):
    """One optimizer step as the recipe reported it (unknown keys are kept)."""

    model_config = ConfigDict(extra="allow")

    step: int
    loss: EncodedFloat | None = None
    lr: EncodedFloat | None = None
    tokens_per_s: EncodedFloat | None = None
    grad_norm: EncodedFloat | None = None
    time: EncodedFloat | None = None
    val_loss: EncodedFloat | None = None


class MetricPage(BaseModel):
    """A page of metric points in step order."""

    items: list[MetricPoint]
    next: int | None = Field(
        description="Pass as `after_step` for the next page; null when no more points are stored."
    )


class MemoryEstimate(BaseModel):
    """Estimated memory of a job (formula in the job-service documentation)."""

    parameters_bytes: int = Field(description="Weights, gradients and optimizer state.")
    activations_bytes: int = Field(description="What autograd keeps for one micro-batch.")
    batch_bytes: int = Field(description="The step's token windows and the validation windows.")
    corpus_bytes: int = Field(description="Tokenization's batch of text and its ids.")
    runtime_bytes: int = Field(description="Interpreter, torch and communication per process.")
    per_rank_bytes: int = Field(description="Sum of the above, for one rank.")
    job_bytes: int = Field(description="per_rank_bytes x nproc_per_node.")
    limit_bytes: int = Field(description="The server's limit per job (--max-job-memory).")
    host_total_bytes: int
    host_available_bytes: int


class DataEstimate(BaseModel):
    """The training data as the recipe will see it."""

    source: str = Field(description="`built-in` or the path relative to a data root.")
    files: int = Field(description="Files read.")
    bytes: int = Field(description="Their size.")
    complete: bool = Field(description="False when the folder was too large to count fully.")
    format: Literal["text", "records", "parquet", "tokens", "mixed"] = Field(
        default="text",
        description="How the files are read: text, records (`.jsonl`/`.json`), parquet, "
        "tokens (`.bin`), or mixed.",
    )
    tokens_exact: bool = Field(
        default=True,
        description="Whether the token counts are exact (raw bytes, token files) or "
        "estimated (a tokenizer: about 4 bytes per token).",
    )
    train_tokens: int = Field(default=0, description="Training split (estimated for folders).")
    val_tokens: int = Field(default=0, description="Validation split (estimated for folders).")


class Admission(BaseModel):
    """What the job needs, as the server estimates it before starting anything."""

    model: str = Field(
        default="", description="The preset, or the model directory as `<model-root>/...`."
    )
    model_type: str | None = Field(
        default=None, description="`model_type` of a model directory's config.json."
    )
    model_params: int = Field(description="Parameters (counted from config.json for HF).")
    params_exact: bool = Field(
        default=True, description="False when the count follows a Llama-like layout guess."
    )
    max_seq_len: int | None = Field(
        description="Longest seq_len the model supports (null: not stated in its config)."
    )
    tokenizer_vocab: int | None = Field(
        default=None,
        description="Tokens the tokenizer can produce (256 for raw bytes; null for token "
        "files without a tokenizer, or a tokenizer without tokenizer.json).",
    )
    tokens_per_step: int
    memory: MemoryEstimate
    data: DataEstimate


class LaunchPlan(BaseModel):
    """Response of ``POST /v1/jobs:validate``: what the server would run."""

    valid: bool = True
    argv: list[str] = Field(
        description="The argv of the process the server spawns, with server paths shown as "
        "`<data-dir>`, `<job-dir>` and `<data-root>`."
    )
    torchrun_argv: list[str] = Field(
        description="The equivalent torchrun command line, to reproduce the job by hand."
    )
    env: dict[str, str] = Field(description="Environment variables the server sets for the job.")
    world_size: int
    gpus_per_node: int = Field(description="GPUs the job takes on each node (0: none).")
    global_batch_sequences: int | None = Field(
        description="Sequences per optimizer step: micro_batch_size x accum_steps x "
        "world_size (null for a script that gives neither)."
    )
    global_batch_tokens: int | None = Field(
        description="Tokens per optimizer step (recipe jobs only)."
    )
    total_tokens: int | None = Field(description="Tokens over the whole run (recipe jobs only).")
    admission: Admission | None = Field(
        description="The recipe's estimates (null for a script: the server cannot know)."
    )
    warnings: list[str]


ArtifactKind = Literal["checkpoint", "export", "metrics", "log", "tracking"]


class Artifact(BaseModel):
    """A file a job wrote."""

    path: str = Field(description="Relative to the job's folder, e.g. `export/config.json`.")
    shown: str = Field(
        description="`path` as it is safe to show: control, bidirectional and invisible "
        "characters (names a job chose) written as `\\uXXXX`, e.g. `\\u202e`."
    )
    bytes: int
    kind: ArtifactKind = Field(
        description="`checkpoint` (under `checkpoints/`), `export` (the HF directory under "
        "`export/`), `metrics` (the metrics files), `log` (the job log and the ranks' logs), "
        "`tracking` (TensorBoard's event files under `tracking/tensorboard/`, with "
        "`train.report_to` naming tensorboard)."
    )


class ArtifactList(BaseModel):
    """A page of a job's files, in path order."""

    items: list[Artifact]
    next: str | None = Field(
        default=None, description="Pass as `after` for the next page; null at the end."
    )


class LogLines(BaseModel):
    """The end of a job's combined log (launcher and all ranks, as torchrun tees them)."""

    lines: list[str]
    truncated: bool = Field(description="True when the log has more lines than returned.")


class UserInfo(BaseModel):
    """A user of the server."""

    name: str | None = Field(description="null: a server without users (everyone is admin).")
    admin: bool = Field(description="Sees and cancels every job.")


class UserList(BaseModel):
    """The users the server knows (from `--users-file`, and `--token`'s `admin`)."""

    items: list[UserInfo]


class Health(BaseModel):
    """Response of ``GET /healthz``."""

    status: Literal["ok"] = "ok"
    version: str


class LimitInfo(BaseModel):
    """One kind of kernel limit on local jobs."""

    name: Literal["memory", "pids", "cpus", "disk"]
    asked_by: str | None = Field(
        description="What asked for it: a flag or the users file; null: a server default."
    )
    held: bool = Field(description="Whether the kernel holds it for every job.")
    why: str = Field("", description="Why it is not held (empty when it is).")


class ServerInfo(BaseModel):
    """Response of ``GET /v1/server``: how this server runs jobs, and which limits on
    them are off."""

    version: str
    launcher: Literal["local", "slurm"]
    sandbox: Literal["bwrap", "none"]
    allow_unenforced_limits: bool = Field(
        description="Whether the server was started with --allow-unenforced-limits."
    )
    limits: list[LimitInfo] = Field(
        description="The local launcher's kernel limits (empty under Slurm, which holds its own)."
    )
    unenforced: list[str] = Field(description="The names of the limits that are not held.")


class FieldError(BaseModel):
    """One invalid field of a request."""

    field: str = Field(description="Dotted path, e.g. `body.train.steps`.")
    loc: list[str | int]
    message: str
    type: str


class Problem(BaseModel):
    """RFC 9457 problem details (``application/problem+json``)."""

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[FieldError] | None = None


def field_error(
    loc: tuple[str | int, ...] | list[str | int], message: str, kind: str
) -> FieldError:
    """A :class:`FieldError` for the location ``loc`` (``("body", "train", "steps")``)."""
    return FieldError(
        field=".".join(str(p) for p in loc), loc=list(loc), message=message, type=kind
    )
