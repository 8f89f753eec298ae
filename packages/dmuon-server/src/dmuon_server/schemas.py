"""Pydantic request and response models of the REST API.

Non-finite numbers: JSON has no NaN or infinity, so every non-finite float the recipe
reports (for example a diverged ``loss``) is sent as one of the strings ``"NaN"``,
``"Infinity"`` or ``"-Infinity"`` -- the convention of the protobuf JSON mapping. Finite
numbers stay numbers. :func:`encode_nonfinite` does the conversion.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

import dmuon_recipe_contract as contract
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dmuon_server.storage.states import ACTIVE_STATES, ALL_STATES, TERMINAL_STATES, JobState

__all__ = ["ACTIVE_STATES", "ALL_STATES", "TERMINAL_STATES", "JobState"]

NonFinite = Literal["NaN", "Infinity", "-Infinity"]
#: A float that may be non-finite, encoded as in the module docstring.
EncodedFloat = float | NonFinite


def encode_nonfinite(value: Any) -> Any:
    """Return ``value`` with every non-finite float replaced by ``"NaN"``/``"Infinity"``/...

    Works on nested dicts and lists; other values are returned unchanged.
    """
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return "NaN"
        return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {str(k): encode_nonfinite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [encode_nonfinite(v) for v in value]
    return value


#: Text shown to people (job names): no C0 or C1 control characters, no bidirectional
#: controls (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), no zero-width
#: characters (U+200B-U+200D, U+2060, U+FEFF) and no line or paragraph separators
#: (U+2028, U+2029), which would let one name pass for another in a list.
NAME_PATTERN = r"^[^\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]+$"


class _Strict(BaseModel):
    """Base for request bodies: unknown fields and type coercion are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)


#: A job saves a checkpoint every this many steps unless its spec says otherwise.
DEFAULT_CHECKPOINT_EVERY = 50
#: How many checkpoints a job keeps unless its spec says otherwise.
DEFAULT_KEEP_CHECKPOINTS = 3

PositiveLR = Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)]


def _choices(dest: str) -> Any:
    """The ``Literal`` of a recipe flag's choices (from the recipe's contract)."""
    return Literal[contract.flag(dest).choices]  # type: ignore[valid-type]


def _default_text(dest: str) -> str:
    value = contract.flag(dest).default
    return "the recipe's default" if value is None else f"the recipe's default, `{value}`"


def _recipe_count(dest: str, what: str, most: int) -> Any:
    """A positive integer field of the recipe whose default is the recipe's own."""
    flag = contract.flag(dest)
    return Field(
        default=flag.default,
        ge=1,
        le=most,
        description=f"{what} (`{flag.option}`); {_default_text(dest)}.",
    )


PresetName = Literal[tuple(sorted(contract.PRESETS))]  # type: ignore[valid-type]
RootedPath = Annotated[str, Field(min_length=1, max_length=4096)]


class ModelPath(_Strict):
    """A Hugging Face model directory inside one of the server's model roots."""

    path: RootedPath = Field(
        description="The directory (`config.json`, with or without `*.safetensors` weights), "
        "relative to a model root or absolute inside one; symlinks and `..` cannot leave "
        "the roots."
    )


def _one_model_error(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate ``train.model`` as a preset or a path, with one error naming both forms."""
    try:
        return handler(value)
    except ValidationError:
        presets = ", ".join(sorted(contract.PRESETS))
        raise PydanticCustomError(
            "model_type",
            'must be a preset name ({presets}) or an object with a "path": a Hugging Face '
            "model directory inside a model root",
            {"presets": presets},
        ) from None


ModelChoice = Annotated[PresetName | ModelPath, WrapValidator(_one_model_error)]


class _TrainSpecByHand(_Strict):
    """The recipe's settings the server checks or shapes itself (paths inside its roots,
    the job folder's checkpoints and export, sizes it admits by); `TrainSpec` adds every
    other flag of the recipe, generated from its contract."""

    model: ModelChoice = Field(
        description='A preset name, or `{"path": ...}`: a Hugging Face model directory '
        "inside a model root (`--model`)."
    )
    steps: int = _recipe_count("steps", "Optimizer steps", 1_000_000)
    micro_batch_size: int = _recipe_count(
        "micro_batch_size", "Sequences per rank per micro-batch", 4096
    )
    accum_steps: int = _recipe_count(
        "accum_steps", "Micro-batches accumulated per optimizer step", 1024
    )
    seq_len: int = _recipe_count("seq_len", "Tokens per sequence", 65_536)
    lr: PositiveLR | None = Field(
        default=None, description=f"Muon learning rate (`--lr`); {_default_text('lr')}."
    )
    adamw_lr: PositiveLR | None = Field(
        default=None,
        description="AdamW learning rate (`--adamw-lr`): every parameter under adamw, the "
        f"embedding, norms and head under dmuon; the recipe's default, `{contract.ADAMW_LR}`.",
    )
    optimizer: _choices("optimizer") | None = Field(  # type: ignore[valid-type]
        default=None, description=f"Optimizer (`--optimizer`); {_default_text('optimizer')}."
    )
    mode: _choices("mode") | None = Field(  # type: ignore[valid-type]
        default=None, description=f"DMuon sharding mode (`--mode`); {_default_text('mode')}."
    )
    seed: int | None = Field(
        default=None,
        ge=0,
        le=2**32 - 1,
        description=f"Random seed (`--seed`); {_default_text('seed')}.",
    )
    eval_every: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description=(
            "Evaluate at step 0, every N steps and at the end; 0 = never (`--eval-every`). "
            "The recipe's default when omitted."
        ),
    )
    warmup_steps: int | None = Field(
        default=None,
        ge=0,
        le=1_000_000,
        description="Linear warm-up steps (`--warmup-steps`); the recipe's default when omitted.",
    )
    tokenizer: RootedPath | None = Field(
        default=None,
        description="A `tokenizer.json` or tokenizer directory inside a model root "
        "(`--tokenizer`); default: the model directory's tokenizer, raw bytes for presets.",
    )
    data: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=(
            "Training data path (`--data`): a text file or folder, `.jsonl`/`.json`, "
            "`.parquet`, or `.bin` token files with their `FILE.bin.json` sidecar. Must lie "
            "inside one of the server's data roots after symlinks and `..` are resolved; "
            "the recipe's built-in data when omitted."
        ),
    )
    text_field: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        pattern=r"^[^\x00-\x1f]+$",
        description="Field holding the text of `.jsonl`, `.json` and `.parquet` records "
        f"(`--text-field`); {_default_text('text_field')}.",
    )
    param_dtype: _choices("param_dtype") | None = Field(  # type: ignore[valid-type]
        default=None,
        description="Compute dtype (`--param-dtype`): `bfloat16` is FSDP2 mixed precision "
        f"with float32 masters and reduction; {_default_text('param_dtype')}.",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="Recompute each decoder layer in backward (`--activation-checkpointing`).",
    )
    compile: bool = Field(
        default=False, description="`torch.compile` each decoder layer (`--compile`)."
    )
    export_hf: bool = Field(
        default=False,
        description="At the end, write a Hugging Face model directory into the job's "
        "`export/` folder (`--export-hf`), listed under `GET /v1/jobs/{id}/artifacts`.",
    )
    checkpoint_every: int = Field(
        default=DEFAULT_CHECKPOINT_EVERY,
        ge=0,
        le=1_000_000,
        description=(
            "Save a checkpoint every N steps into the job's `checkpoints/` folder "
            "(`--checkpoint-every`); 0 = only the final one and the one written on cancel. "
            "A job is always checkpointed at its end."
        ),
    )
    keep_checkpoints: int = Field(
        default=DEFAULT_KEEP_CHECKPOINTS,
        ge=0,
        le=1_000_000,
        description="Keep the newest K checkpoints (`--keep-checkpoints`); 0 keeps all.",
    )
    reduce_dtype: _choices("reduce_dtype") | None = Field(  # type: ignore[valid-type]
        default=None,
        description="Dtype the dedicated matrices' gradients are summed in on their way to "
        "the owner (`--reduce-dtype`); `bfloat16` halves those bytes, the accumulation, "
        f"masters and momentum stay float32; {_default_text('reduce_dtype')}.",
    )
    broadcast_dtype: _choices("broadcast_dtype") | None = Field(  # type: ignore[valid-type]
        default=None,
        description="Dtype the dedicated matrices are broadcast in (`--broadcast-dtype`); "
        f"`bfloat16` halves those bytes; {_default_text('broadcast_dtype')}.",
    )
    muon_variant: _choices("muon_variant") | None = Field(  # type: ignore[valid-type]
        default=None,
        description="Update rule of the dedicated matrices under `dmuon` "
        "(`--muon-variant`): `normuon` adds per-row second-moment normalization; "
        f"{_default_text('muon_variant')}.",
    )
    ns_dtype: _choices("ns_dtype") | None = Field(  # type: ignore[valid-type]
        default=None,
        description="Newton-Schulz dtype under `dmuon` (`--ns-dtype`); `auto` is bfloat16 on "
        "CUDA and on CPUs that multiply it natively, float32 elsewhere; "
        f"{_default_text('ns_dtype')}.",
    )
    on_checkpoint_error: _choices("on_checkpoint_error") | None = Field(  # type: ignore[valid-type]
        default=None,
        description="A checkpoint that cannot be written, as on a full disk "
        "(`--on-checkpoint-error`): `stop` fails the job (exit code 4, not retried), `warn` "
        "keeps training and adds a `checkpoint_failed` warning to the job's events each "
        f"time; {_default_text('on_checkpoint_error')}.",
    )
    collective_timeout: int | None = Field(
        default=None,
        ge=1,
        le=86_400,
        description="Seconds a collective waits for every process (`--collective-timeout`): "
        "a process that died or stalled (stopped, hung) makes the others fail within it, "
        "and the attempt counts as failed for `max_restarts`; "
        f"{_default_text('collective_timeout')}.",
    )

    @property
    def preset(self) -> str | None:
        """The preset name, or None for a model directory."""
        return self.model if isinstance(self.model, str) else None


#: Recipe flags the server decides for every job, never part of a spec: paths (the job
#: folder's metrics file, checkpoints and trackers, the recipe's own cache), and where a job
#: starts from (``resume``; the spec's ``init_from`` names another job's checkpoint).
SERVER_SET_FLAGS = frozenset(
    {"metrics_file", "checkpoint_dir", "resume", "init_from", "cache_dir", "tracking_dir"}
)

_TRACKER = "(" + "|".join(contract.TRACKER_NAMES) + ")"
#: What ``train.report_to`` may say: none, all, or a comma-separated list of trackers.
REPORT_TO_PATTERN = rf"^(none|all|{_TRACKER}(,{_TRACKER})*)$"
#: Patterns of the text fields generated from the contract (anything printable otherwise).
_TEXT_PATTERNS = {"report_to": REPORT_TO_PATTERN}

#: The most an integer or float field generated from the recipe's contract may be.
_GENERATED_MAX = 1_000_000_000

_FLOAT_BOUNDS: dict[str | None, dict[str, float]] = {
    "positive": {"gt": 0.0, "le": _GENERATED_MAX},
    "non_negative": {"ge": 0.0, "le": _GENERATED_MAX},
    "fraction": {"ge": 0.0, "le": 1.0},
    "open_fraction": {"gt": 0.0, "lt": 1.0},
    None: {"ge": -_GENERATED_MAX, "le": _GENERATED_MAX},
}


#: The OpenAPI key that marks a `train` field as one only the dmuon optimizer takes
#: (`dmuon_recipe_contract.MUON_ONLY_FLAGS`).
MUON_ONLY_KEY = "x-muon-only"


def _generated_field(flag: contract.Flag) -> tuple[Any, Any]:
    """``(annotation, Field)`` of a spec field for a recipe flag, from its contract entry:
    its type, bounds and choices; left out, the recipe's default applies."""
    help_text = flag.help[0].upper() + flag.help[1:]
    # The dashboard's DMuon-vs-AdamW pair leaves these out of the AdamW run.
    extra = {MUON_ONLY_KEY: True} if flag.dest in contract.MUON_ONLY_FLAGS else None
    described = {
        "description": f"{help_text} (`{flag.option}`); {_default_text(flag.dest)}.",
        "json_schema_extra": extra,
    }
    if flag.kind == "bool":
        return bool, Field(
            default=False, **{**described, "description": f"{help_text} (`{flag.option}`)."}
        )
    if flag.kind == "int":
        low = flag.minimum if flag.minimum is not None else -_GENERATED_MAX
        return int | None, Field(default=None, ge=low, le=_GENERATED_MAX, **described)
    if flag.kind == "float":
        bounds = _FLOAT_BOUNDS[flag.bound]
        number = Annotated[float, Field(allow_inf_nan=False, **bounds)]
        return number | None, Field(default=None, **described)
    if flag.kind == "choice":
        return _choices(flag.dest) | None, Field(default=None, **described)
    if flag.kind == "str":
        pattern = _TEXT_PATTERNS.get(flag.dest, NAME_PATTERN)
        text = Annotated[str, Field(min_length=1, max_length=256, pattern=pattern)]
        return text | None, Field(default=None, **described)
    raise TypeError(f"recipe flag {flag.option} of kind {flag.kind!r} needs a hand-written field")


#: The recipe flags `TrainSpec` takes from the contract, in the recipe's order.
GENERATED_FLAGS: tuple[str, ...] = tuple(
    f.dest
    for f in contract.FLAGS
    if f.dest not in _TrainSpecByHand.model_fields and f.dest not in SERVER_SET_FLAGS
)

TrainSpec = create_model(
    "TrainSpec",
    __base__=_TrainSpecByHand,
    __doc__="""The recipe's settings; each maps to one ``python -m dmuon.train`` flag.

    Field names, choices and defaults are the recipe's own (`dmuon_recipe_contract`); a
    field left out takes the recipe's default, and the job record shows the value used.
    Every flag of the recipe is a field, except those the server sets for each job
    (`SERVER_SET_FLAGS`).
    """,
    **{dest: _generated_field(contract.flag(dest)) for dest in GENERATED_FLAGS},
)


#: An argument of a script: any text but NUL (it becomes one argv entry, never shell text).
ScriptArg = Annotated[str, Field(max_length=1024, pattern=r"^[^\x00]*$")]


class ScriptSpec(_Strict):
    """Your own training script, run by torchrun like the recipe."""

    path: str = Field(
        min_length=1,
        max_length=4096,
        pattern=r"^[^\x00]+$",
        description="The Python file (`.py`) to run, inside one of the server's code roots "
        "(`--code-root`) after symlinks and `..` are resolved; a relative path is looked up "
        "in each root in turn.",
    )
    args: list[ScriptArg] = Field(
        default_factory=list,
        max_length=256,
        description="Its command-line arguments, each passed as one argv entry (no shell).",
    )
    steps: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Steps the script runs, if it says: shown as progress and ETA, given to "
        "it as `DMUON_STEPS`, and what `POST /v1/jobs/{id}/resume` compares a checkpoint to.",
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Given to the script as `DMUON_MICRO_BATCH_SIZE`, if set.",
    )
    accum_steps: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Micro-batches per optimizer step, given to the script as "
        "`DMUON_ACCUM_STEPS`, if set.",
    )


class InitFrom(_Strict):
    """A checkpoint of another job to take the initial weights from."""

    job: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Id of the job that saved it.",
    )
    step: Annotated[int, Field(ge=0, le=99_999_999)] | Literal["latest"] = Field(
        description="Step of the checkpoint, or `latest` for that job's newest one "
        "(resolved when this job is submitted)."
    )


#: Slurm partition and account names as the job spec accepts them.
SLURM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
#: Slurm's time-limit formats: minutes, minutes:seconds, hours:minutes:seconds,
#: days-hours, days-hours:minutes, days-hours:minutes:seconds.
SLURM_TIME_PATTERN = r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2})$"
#: The spec fields only the Slurm launcher uses.
SLURM_ONLY_FIELDS = ("partition", "time_limit", "account")


class JobCreate(_Strict):
    """Body of ``POST /v1/jobs`` and ``POST /v1/jobs:validate``."""

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=NAME_PATTERN,
        description="A label for people; need not be unique. No control, format or "
        "line-separator characters (no right-to-left override, zero-width space, ...).",
    )
    nproc_per_node: int = Field(
        ge=1,
        le=1024,
        description="Processes torchrun starts (world size); at most the server's limit.",
    )
    nnodes: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Nodes the job runs on, one torchrun agent each (world size: nnodes x "
        "nproc_per_node). More than 1 needs the Slurm launcher (`--launcher slurm`).",
    )
    partition: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=SLURM_NAME_PATTERN,
        description="Slurm partition (`sbatch --partition`); the cluster's default when "
        "omitted. Slurm launcher only.",
    )
    time_limit: str | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        pattern=SLURM_TIME_PATTERN,
        description="Slurm time limit (`sbatch --time`): `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, "
        "`D-HH:MM` or `D-HH:MM:SS`; the partition's default when omitted. Slurm launcher only.",
    )
    account: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=SLURM_NAME_PATTERN,
        description="Slurm account to charge (`sbatch --account`). Slurm launcher only.",
    )
    train: TrainSpec | None = Field(
        default=None,
        description="The reference recipe's settings (`python -m dmuon.train`); give this "
        "or `script`.",
    )
    script: ScriptSpec | None = Field(
        default=None,
        description="Your own training script instead of the recipe (`--code-root`); give "
        "this or `train`.",
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="Queue priority: a higher one starts first; first come, first served "
        "within a priority.",
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="GPUs per node, one per process: `nproc_per_node` (the default on a "
        "server with GPUs) or 0 (none: the processes see no GPU). Under Slurm it becomes "
        "`--gpus-per-node`; omitted, no GPU is asked for.",
    )
    max_restarts: int = Field(
        default=0,
        ge=0,
        le=100,
        description=(
            "Relaunch the job up to this many times when a rank dies (killed, out of memory, "
            "crashed); each relaunch resumes from the job's latest checkpoint. Usage errors "
            "and divergence are never retried."
        ),
    )
    init_from: InitFrom | None = Field(
        default=None,
        description="Start from the weights of another job's checkpoint (`--init-from`); "
        "the optimizer starts fresh at step 1. Recipe jobs only.",
    )

    @model_validator(mode="after")
    def _one_program(self) -> JobCreate:
        if (self.train is None) == (self.script is None):
            raise ValueError(
                "give either train (the recipe's settings) or script (your own training "
                "script), not both and not neither"
            )
        if self.script is not None and self.init_from is not None:
            raise ValueError(
                "init_from is the recipe's (--init-from); a script loads the weights it "
                "wants itself"
            )
        t = self.train
        if t is not None and t.optimizer == "adamw":
            muon_only = [
                name
                for name in contract.MUON_ONLY_FLAGS
                if getattr(t, name, None) not in (None, contract.flag(name).default)
            ]
            if muon_only:
                raise ValueError(
                    f"{', '.join(muon_only)}: only for the dmuon optimizer (they change how "
                    'its Muon matrices are updated); drop them or set "optimizer": "dmuon"'
                )
        return self

    @property
    def steps(self) -> int | None:
        """The steps the job runs (the script's, when it said)."""
        return self.train.steps if self.train is not None else self.script.steps  # type: ignore[union-attr]

    def with_steps(self, steps: int) -> JobCreate:
        """This spec with another number of steps (``train.steps`` or ``script.steps``)."""
        if self.train is not None:
            return self.model_copy(update={"train": self.train.model_copy(update={"steps": steps})})
        assert self.script is not None
        return self.model_copy(update={"script": self.script.model_copy(update={"steps": steps})})


class ResumeRequest(_Strict):
    """Body of ``POST /v1/jobs/{id}/resume`` (may be omitted)."""

    steps: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="New total number of optimizer steps (more than the latest "
        "checkpoint's step); the job's own `train.steps` (or `script.steps`) when omitted.",
    )


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
        default=None, description="Who submitted it (null on a server without users)."
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
