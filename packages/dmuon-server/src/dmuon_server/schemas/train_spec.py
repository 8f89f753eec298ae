"""The recipe's part of a job spec (``train``): the fields written by hand, and one field per
other flag of the recipe, generated from its contract (`dmuon_recipe_contract`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import dmuon_recipe_contract as contract
from pydantic import (
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    create_model,
    model_validator,
)
from pydantic_core import PydanticCustomError

from dmuon_server.schemas.common import (
    NAME_PATTERN,
    StrictModel,
)

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


class ModelPath(StrictModel):
    """A Hugging Face model directory inside one of the server's model roots."""

    path: RootedPath = Field(
        description="The directory (`config.json`, with or without `*.safetensors` weights), "
        "relative to a model root or absolute inside one; symlinks and `..` cannot leave "
        "the roots."
    )


def _one_model_error(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate ``train.model`` as a preset or a path, with one error naming both forms.

    A string that names no preset is a path, as the recipe's ``--model`` takes it (the
    same spelling as a ``--config`` file); it is held as ``{"path": ...}``."""
    if isinstance(value, str) and value not in contract.PRESETS:
        value = {"path": value}
    try:
        return handler(value)
    except ValidationError:
        presets = ", ".join(sorted(contract.PRESETS))
        raise PydanticCustomError(
            "model_type",
            "must be a preset name ({presets}) or a Hugging Face model directory inside a "
            'model root, as a string or as {"path": ...}',
            {"presets": presets},
        ) from None


# The string arm documents the path spelling in the schema; `_one_model_error` turns such
# a string into a `ModelPath` before the union sees it, so a value is a preset or a path.
ModelChoice = Annotated[PresetName | ModelPath | RootedPath, WrapValidator(_one_model_error)]


class _TrainSpecByHand(StrictModel):
    """The recipe's settings the server checks or shapes itself (paths inside its roots,
    the job folder's checkpoints and export, sizes it admits by); `TrainSpec` adds every
    other flag of the recipe, generated from its contract."""

    model: ModelChoice = Field(
        description="A preset name (`--model`), or a Hugging Face model directory inside a "
        'model root: its path as a string, as `--model` takes it, or `{"path": ...}`.'
    )

    @model_validator(mode="before")
    @classmethod
    def _as_in_a_config_file(cls, data: Any) -> Any:
        """The recipe's ``--config`` TOML file, parsed, is a spec too: its keys may be
        spelled as options (``micro-batch-size``), and one level of tables groups them."""
        if not isinstance(data, dict):
            return data
        flat: dict[str, Any] = {}
        for key, value in data.items():
            name = key.replace("-", "_") if isinstance(key, str) else key
            inner = value if isinstance(value, dict) and name not in cls.model_fields else None
            for item, item_value in (inner or {name: value}).items():
                item = item.replace("-", "_") if isinstance(item, str) else item
                if item in flat:
                    raise ValueError(f"{item} is given twice (the file's tables included)")
                flat[item] = item_value
        return flat

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
_TEXT_PATTERNS = {
    "report_to": REPORT_TO_PATTERN,
    "profile_steps": r"^[1-9][0-9]{0,8}:[1-9][0-9]{0,8}$",
}

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
