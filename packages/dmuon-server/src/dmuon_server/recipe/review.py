"""The review of a job spec: can this server run it, and what does it need?

:func:`review` fills the recipe's defaults into the spec once (`with_recipe_defaults`),
checks it against the server's limits (processes, GPUs, the launcher's own fields) and what
the recipe can do (:mod:`dmuon_server.recipe.admission`), resolves its paths (data, model,
tokenizer, script, the checkpoint ``init_from`` names) and reports every field to change.
The routes answer with it; the command line is built from the accepted review
(:mod:`dmuon_server.launching.command`), never from the spec as submitted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import dmuon_recipe_contract as contract

from dmuon_server.config import (
    Settings,
)
from dmuon_server.recipe.admission import ModelInputs, assess
from dmuon_server.recipe.hf_models import ModelDirError, read_model_dir, tokenizer_vocab
from dmuon_server.schemas import (
    SLURM_ONLY_FIELDS,
    Admission,
    FieldError,
    JobCreate,
    ModelPath,
)
from dmuon_server.schemas.responses import field_error
from dmuon_server.storage.jobfiles import (
    CHECKPOINT_DIR,
    CheckpointInfo,
    list_checkpoints,
)
from dmuon_server.storage.paths import (
    DataPathError,
    PublicPaths,
    resolve_code_path,
    resolve_data_path,
    resolve_model_path,
)


@dataclass
class Review:
    """What :func:`review` found: the fields to change (none: the server accepts the spec),
    the resolved data path or script, the estimates, the warnings, the checkpoint
    ``init_from`` names, the GPUs per node the job takes, the resolved model directory and
    tokenizer, and the spec with the recipe's defaults."""

    errors: list[FieldError] = field(default_factory=list)
    data_path: Path | None = None
    script_path: Path | None = None
    admission: Admission | None = None
    warnings: list[str] = field(default_factory=list)
    init_checkpoint: CheckpointInfo | None = None
    gpus_per_node: int = 0
    model_path: Path | None = None
    tokenizer_path: Path | None = None
    #: The spec with the recipe's defaults filled in: what the job record keeps and the
    #: command line is built from.
    spec: JobCreate | None = None

    @property
    def accepted(self) -> bool:
        """Whether the job can run as given."""
        return not self.errors


def with_recipe_defaults(spec: JobCreate) -> JobCreate:
    """``spec`` with the recipe's defaults written into the fields left out that the job
    record shows (``lr``, ``adamw_lr``, ``optimizer``, ``mode``, ``seed``).

    The defaults are the recipe's own (`dmuon_recipe_contract`), ``adamw_lr`` the same
    under both optimizers. A script job is returned as it is.
    """
    t = spec.train
    if t is None:
        return spec
    optimizer = t.optimizer or contract.flag("optimizer").default
    lr = t.lr if t.lr is not None else contract.flag("lr").default
    adamw_lr = t.adamw_lr
    if adamw_lr is None:
        adamw_lr = contract.ADAMW_LR
    filled = t.model_copy(
        update={
            "optimizer": optimizer,
            "lr": lr,
            "adamw_lr": adamw_lr,
            "mode": t.mode or contract.flag("mode").default,
            "seed": t.seed if t.seed is not None else contract.flag("seed").default,
        }
    )
    return spec.model_copy(update={"train": filled})


def _token_data(data_path: Path | None) -> bool:
    """Whether the data are token files (a ``.bin``, or a folder holding them)."""
    if data_path is None:
        return False
    if data_path.is_file():
        return contract.data_kind(data_path) == "tokens"
    return next(data_path.rglob(f"*{contract.TOKEN_SUFFIX}"), None) is not None


def _resolve_model(
    settings: Settings, spec: JobCreate, errors: list[FieldError], data_path: Path | None
) -> tuple[ModelInputs | None, Path | None, Path | None]:
    """The model side of a spec: ``(inputs for the estimates, model dir, tokenizer path)``.

    Appends to ``errors`` (with the recipe's messages) what the recipe would refuse.
    """
    t = spec.train
    assert t is not None
    public = PublicPaths(settings)
    tokenizer_path: Path | None = None
    if t.tokenizer is not None:
        try:
            tokenizer_path = resolve_model_path(settings, t.tokenizer, "tokenizer")
        except DataPathError as e:
            errors.append(field_error(("body", "train", "tokenizer"), str(e), "value_error"))
            return None, None, None
    if not isinstance(t.model, ModelPath):
        vocab = 256 if tokenizer_path is None else tokenizer_vocab(tokenizer_path)
        embed = contract.PRESETS[t.model].vocab_size
        if vocab is not None and vocab > embed:
            what = "--tokenizer " + public.text(str(tokenizer_path))
            errors.append(
                field_error(("body", "train", "tokenizer"),
                            contract.vocab_message(vocab, embed, what, t.model), "admission")
            )  # fmt: skip
        return ModelInputs(t.model, None, vocab), None, tokenizer_path
    loc = ("body", "train", "model", "path")
    try:
        model_dir = resolve_model_path(settings, t.model.path, "model")
    except DataPathError as e:
        errors.append(field_error(loc, str(e), "value_error"))
        return None, None, None
    label = public.text(str(model_dir))
    try:
        hf = read_model_dir(model_dir, label)
    except ModelDirError as e:
        errors.append(field_error(loc, str(e), "value_error"))
        return None, None, None
    tokens_only = _token_data(data_path)
    if tokenizer_path is None and not hf.has_tokenizer and not tokens_only:
        errors.append(
            field_error(
                ("body", "train", "tokenizer"), contract.no_tokenizer_message(label), "value_error"
            )
        )
        return None, None, None
    source = tokenizer_path or (model_dir if hf.has_tokenizer else None)
    vocab = tokenizer_vocab(source) if source is not None else None
    if vocab is not None and vocab > hf.vocab_size:
        what = "the tokenizer " + public.text(str(source))
        errors.append(
            field_error(("body", "train", "tokenizer"),
                        contract.vocab_message(vocab, hf.vocab_size, what, label), "admission")
        )  # fmt: skip
    return ModelInputs(label, hf, vocab), model_dir, tokenizer_path


def resolve_init_from(
    settings: Settings, spec: JobCreate, visible: Callable[[str], bool] = lambda _: True
) -> CheckpointInfo | FieldError | None:
    """The checkpoint ``spec.init_from`` names, or the field error saying why it cannot be
    used (unknown job, no such checkpoint); None without ``init_from``. A job the
    submitter may not see (``visible``) is unknown to them."""
    ref = spec.init_from
    if ref is None:
        return None
    folder = settings.job_dir(ref.job) / CHECKPOINT_DIR
    # The schema allows no "/" nor "." in the id.
    if not settings.job_dir(ref.job).is_dir() or not visible(ref.job):
        return field_error(
            ("body", "init_from", "job"),
            f"there is no job {ref.job!r} on this server; give the id of a job that saved "
            "checkpoints (GET /v1/jobs)",
            "value_error",
        )
    found = list_checkpoints(folder, sizes=False)
    if not found:
        return field_error(
            ("body", "init_from", "job"),
            f"job {ref.job} has no checkpoint (yet); wait for one "
            f"(GET /v1/jobs/{ref.job}/checkpoints) or start without init_from",
            "value_error",
        )
    if ref.step == "latest":
        return found[-1]
    for c in found:
        if c.step == ref.step:
            return c
    steps = ", ".join(str(c.step) for c in found)
    return field_error(
        ("body", "init_from", "step"),
        f"job {ref.job} has no checkpoint of step {ref.step}; it has step(s) {steps} "
        '(or pass "latest")',
        "value_error",
    )


def launcher_refusals(settings: Settings, spec: JobCreate) -> list[FieldError]:
    """The fields of ``spec`` the server's launcher cannot honour, each with what to do."""
    errors: list[FieldError] = []
    if settings.launcher == "local":
        if spec.nnodes > 1:
            errors.append(
                field_error(
                    ("body", "nnodes"),
                    f"nnodes={spec.nnodes}: this server runs jobs on its own host only "
                    "(--launcher local); use nnodes=1, or a server started with "
                    "--launcher slurm",
                    "less_than_equal",
                )
            )
        for name in SLURM_ONLY_FIELDS:
            if getattr(spec, name) is not None:
                errors.append(
                    field_error(
                        ("body", name),
                        f"{name} is a Slurm option and this server runs jobs on its own host "
                        "(--launcher local); leave it out, or use a server started with "
                        "--launcher slurm",
                        "value_error",
                    )
                )
    elif spec.max_restarts > 0:
        errors.append(
            field_error(
                ("body", "max_restarts"),
                "the Slurm launcher does not relaunch failed jobs (max_restarts must be 0); "
                "resume the job from its checkpoint instead (POST /v1/jobs/{id}/resume)",
                "less_than_equal",
            )
        )
    return errors


def gpus_per_node(settings: Settings, spec: JobCreate) -> int:
    """The GPUs per node a job takes: its ``gpus_per_node``, else one per process on a
    local server with GPUs, none otherwise."""
    if spec.gpus_per_node is not None:
        return spec.gpus_per_node
    return spec.nproc_per_node if settings.launcher == "local" and settings.gpus else 0


def gpus_of_job(settings: Settings, spec: JobCreate) -> int:
    """The GPUs a job uses in all: its GPUs per node times its nodes (what a user's
    ``gpus`` limit counts)."""
    return gpus_per_node(settings, spec) * spec.nnodes


def gpu_refusals(settings: Settings, spec: JobCreate) -> list[FieldError]:
    """Why the local launcher cannot give the job the GPUs it asks for, if it cannot."""
    if settings.launcher != "local" or spec.gpus_per_node in (None, 0):
        return []
    loc = ("body", "gpus_per_node")
    have = len(settings.gpus)
    if not have:
        return [
            field_error(
                loc,
                f"gpus_per_node={spec.gpus_per_node}: this server has no GPUs (--gpus none); "
                "leave it out or use 0",
                "value_error",
            )
        ]
    if spec.gpus_per_node != spec.nproc_per_node:
        return [
            field_error(
                loc,
                f"gpus_per_node={spec.gpus_per_node}: each process takes one GPU, so give "
                f"nproc_per_node ({spec.nproc_per_node}) or 0, or leave it out",
                "value_error",
            )
        ]
    return []


def _too_many_gpus(settings: Settings, spec: JobCreate, gpus: int) -> list[FieldError]:
    have = len(settings.gpus)
    if settings.launcher != "local" or gpus <= have:
        return []
    field = "gpus_per_node" if spec.gpus_per_node is not None else "nproc_per_node"
    return [
        field_error(
            ("body", field),
            f"the job needs {gpus} GPUs (one per process) and this server has {have} "
            f"(--gpus {','.join(map(str, settings.gpus))}); ask for at most {have} processes, "
            "or set gpus_per_node to 0 to run without GPUs",
            "less_than_equal",
        )
    ]


def review(
    settings: Settings,
    spec: JobCreate,
    visible: Callable[[str], bool] = lambda _: True,
    memory: tuple[int, str] | None = None,
) -> Review:
    """Check ``spec`` against the server's limits and the recipe: whether it can run, and
    what it needs; the review's ``spec`` is ``spec`` with the recipe's defaults.

    The errors name every field to change; the estimates come along when the spec got far
    enough to make them. ``visible`` says whether the submitter may see a job (the source
    of ``init_from``); ``memory`` is the submitter's memory per job and where that limit
    comes from (default: the server's ``--max-job-memory``).
    """
    spec = with_recipe_defaults(spec)
    memory = memory or (settings.max_job_memory, "--max-job-memory")
    found = _review(settings, spec, visible, memory)
    found.spec = spec
    return found


def _review(
    settings: Settings,
    spec: JobCreate,
    visible: Callable[[str], bool],
    memory: tuple[int, str],
) -> Review:
    errors: list[FieldError] = launcher_refusals(settings, spec) + gpu_refusals(settings, spec)
    gpus = gpus_per_node(settings, spec)
    errors += _too_many_gpus(settings, spec, gpus)
    if spec.nproc_per_node > settings.max_nproc_per_node:
        errors.append(
            field_error(
                ("body", "nproc_per_node"),
                f"{spec.nproc_per_node} processes is more than this server runs per job "
                f"(at most {settings.max_nproc_per_node}, one per CPU core unless "
                "configured with --max-nproc)",
                "less_than_equal",
            )
        )
    if spec.script is not None:
        try:
            script = resolve_code_path(settings, spec.script.path)
        except DataPathError as e:
            errors.append(field_error(("body", "script", "path"), str(e), "value_error"))
            return Review(errors, gpus_per_node=gpus)
        return Review(errors, script_path=script, gpus_per_node=gpus)
    assert spec.train is not None
    data_path: Path | None = None
    label: str | None = None
    if spec.train.data is not None:
        try:
            data_path = resolve_data_path(settings, spec.train.data)
            label = PublicPaths(settings).text(str(data_path))
        except DataPathError as e:
            errors.append(field_error(("body", "train", "data"), str(e), "value_error"))
    model, model_path, tokenizer_path = _resolve_model(settings, spec, errors, data_path)
    init = resolve_init_from(settings, spec, visible)
    if isinstance(init, FieldError):
        errors.append(init)
        init = None
    if errors:  # the estimates need a valid world size, model and data path
        return Review(errors, gpus_per_node=gpus)
    admission, refusals, warnings = assess(
        spec.train,
        spec.nproc_per_node,
        data_path,
        label,
        memory[0],
        model,
        settings.data_roots,
        limit_name=memory[1],
    )
    errors = [field_error(r.loc, r.message, "admission") for r in refusals]
    return Review(
        errors, data_path, None, admission, warnings, init, gpus, model_path, tokenizer_path
    )
