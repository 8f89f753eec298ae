"""Turning a job spec into a command line and an environment (never a shell string).

A job runs as ``python -m dmuon_server.runner --job-dir DIR -- <torchrun args>``; see
:mod:`dmuon_server.runner`. :func:`review` checks a spec against the server's limits and
what the recipe can do (:mod:`dmuon_server.admission`) before anything is planned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import dmuon_recipe_contract as contract

from dmuon_server.admission import ModelInputs, assess
from dmuon_server.config import (
    DATA_DIR_ENV_MARKER,
    JOB_ENV_MARKER,
    TOKEN_ENV,
    Settings,
    usable_cpus,
)
from dmuon_server.errors import field_error, invalid_request
from dmuon_server.hf_models import ModelDirError, read_model_dir, tokenizer_vocab
from dmuon_server.jobfiles import (
    CHECKPOINT_DIR,
    EXPORT_DIR,
    INIT_DIR,
    METRICS_FILE,
    TORCHRUN_LOG_DIR,
    CheckpointInfo,
    checkpoint_name,
    list_checkpoints,
    metrics_file,
)
from dmuon_server.paths import DataPathError, PublicPaths, resolve_data_path, resolve_model_path
from dmuon_server.schemas import (
    SLURM_ONLY_FIELDS,
    Admission,
    FieldError,
    JobCreate,
    LaunchPlan,
    ModelPath,
)

#: Environment variables of the server that must not leak into a job: torchrun reads its
#: options from PET_* variables, and rank variables would confuse the workers.
_SCRUBBED_PREFIXES = ("PET_", "TORCHELASTIC_")
_SCRUBBED_VARS = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        TOKEN_ENV,
    }
)


@dataclass
class Review:
    """A spec the server accepts: its paths, the estimates and the warnings, and the
    checkpoint ``init_from`` names."""

    data_path: Path | None
    admission: Admission
    warnings: list[str] = field(default_factory=list)
    init_checkpoint: CheckpointInfo | None = None
    model_path: Path | None = None
    tokenizer_path: Path | None = None


def with_recipe_defaults(spec: JobCreate) -> JobCreate:
    """``spec`` with the recipe's defaults written into the fields left out that the job
    record shows (``lr``, ``adamw_lr``, ``optimizer``, ``mode``, ``seed``).

    The defaults are the recipe's own (`dmuon_recipe_contract`); ``adamw_lr`` follows the
    optimizer: ``lr`` under dmuon, the baseline's rate under adamw.
    """
    t = spec.train
    optimizer = t.optimizer or contract.flag("optimizer").default
    lr = t.lr if t.lr is not None else contract.flag("lr").default
    adamw_lr = t.adamw_lr
    if adamw_lr is None:
        adamw_lr = lr if optimizer == "dmuon" else contract.ADAMW_BASELINE_LR
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


def resolve_init_from(settings: Settings, spec: JobCreate) -> CheckpointInfo | FieldError | None:
    """The checkpoint ``spec.init_from`` names, or the field error saying why it cannot be
    used (unknown job, no such checkpoint); None without ``init_from``."""
    ref = spec.init_from
    if ref is None:
        return None
    folder = settings.job_dir(ref.job) / CHECKPOINT_DIR
    if not settings.job_dir(ref.job).is_dir():  # the schema allows no "/" nor "."
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


def review(settings: Settings, spec: JobCreate) -> Review:
    """Check ``spec`` against the server's limits and the recipe; raise a 422 if it cannot run.

    The 422 names every field to change and carries the estimates as ``admission``.
    """
    errors: list[FieldError] = launcher_refusals(settings, spec)
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
    data_path: Path | None = None
    label: str | None = None
    if spec.train.data is not None:
        try:
            data_path = resolve_data_path(settings, spec.train.data)
            label = PublicPaths(settings).text(str(data_path))
        except DataPathError as e:
            errors.append(field_error(("body", "train", "data"), str(e), "value_error"))
    model, model_path, tokenizer_path = _resolve_model(settings, spec, errors, data_path)
    init = resolve_init_from(settings, spec)
    if isinstance(init, FieldError):
        errors.append(init)
        init = None
    if errors:  # the estimates need a valid world size, model and data path
        raise invalid_request(errors)
    admission, refusals, warnings = assess(
        spec.train, spec.nproc_per_node, data_path, label, settings.max_job_memory, model
    )
    if refusals:
        problem = invalid_request([field_error(r.loc, r.message, "admission") for r in refusals])
        problem.extra = {"admission": admission.model_dump(mode="json")}
        raise problem
    return Review(data_path, admission, warnings, init, model_path, tokenizer_path)


def _fmt_float(x: float) -> str:
    return repr(float(x))


@dataclass
class Command:
    """What the supervisor spawns for a job (real server paths)."""

    argv: list[str]
    torchrun_argv: list[str]
    env: dict[str, str]


def init_path(job_dir: Path, init: CheckpointInfo) -> Path:
    """Where a job's copy of its ``init_from`` checkpoint lives."""
    return job_dir / INIT_DIR / checkpoint_name(init.step)


def _option(dest: str) -> str:
    """The recipe's spelling of a flag (``--micro-batch-size``), from its contract."""
    return contract.flag(dest).option


def build_command(
    settings: Settings,
    spec: JobCreate,
    job_dir: Path,
    data_path: Path | None,
    init: CheckpointInfo | None = None,
    *,
    model_path: Path | None = None,
    tokenizer_path: Path | None = None,
) -> Command:
    """The runner's argv, the equivalent torchrun argv and the variables set for the job.

    This is the first attempt's command; :func:`attempt_argv` derives the later ones.
    ``spec`` has the recipe's defaults filled in (`with_recipe_defaults`); ``model_path``
    and ``tokenizer_path`` are the resolved ``train.model.path`` and ``train.tokenizer``.
    """
    t = with_recipe_defaults(spec).train
    n = spec.nproc_per_node
    model = str(model_path) if isinstance(t.model, ModelPath) else t.model
    values: list[tuple[str, str | None]] = [
        ("model", model),
        ("steps", str(t.steps)),
        ("micro_batch_size", str(t.micro_batch_size)),
        ("accum_steps", str(t.accum_steps)),
        ("seq_len", str(t.seq_len)),
        ("lr", _fmt_float(t.lr)),  # type: ignore[arg-type]
        ("adamw_lr", _fmt_float(t.adamw_lr)),  # type: ignore[arg-type]
        ("optimizer", t.optimizer),
        ("mode", t.mode),
        ("seed", str(t.seed)),
        ("warmup_steps", None if t.warmup_steps is None else str(t.warmup_steps)),
        ("eval_every", None if t.eval_every is None else str(t.eval_every)),
        ("metrics_file", str(job_dir / METRICS_FILE)),
        ("tokenizer", None if tokenizer_path is None else str(tokenizer_path)),
        ("data", None if data_path is None else str(data_path)),
        ("text_field", t.text_field),
        ("param_dtype", t.param_dtype),
        ("checkpoint_dir", str(job_dir / CHECKPOINT_DIR)),
        ("checkpoint_every", str(t.checkpoint_every)),
        ("keep_checkpoints", str(t.keep_checkpoints)),
        ("resume", "auto"),
        ("init_from", None if init is None else str(init_path(job_dir, init))),
        ("export_hf", str(job_dir / EXPORT_DIR) if t.export_hf else None),
    ]
    recipe = ["-m", settings.train_module]
    for dest, value in values:
        if value is not None:
            recipe += [_option(dest), value]
    for dest in ("activation_checkpointing", "compile"):
        if getattr(t, dest):
            recipe.append(_option(dest))
    torchrun_opts = [
        "--standalone",
        "--nproc_per_node",
        str(n),
        "--tee",
        "3",
        "--log-dir",
        str(job_dir / TORCHRUN_LOG_DIR),
    ]
    argv = [
        settings.python,
        "-m",
        "dmuon_server.runner",
        "--job-dir",
        str(job_dir),
        "--",
        *torchrun_opts,
        *recipe,
    ]
    torchrun_argv = [settings.python, "-m", "torch.distributed.run", *torchrun_opts, *recipe]
    return Command(argv, torchrun_argv, launch_env(settings, job_dir.name, n))


def _set_flag(argv: list[str], flag: str, value: str | None) -> list[str]:
    """``argv`` with the value of ``flag`` replaced (or the flag removed when None)."""
    out = list(argv)
    if flag not in out:
        return out if value is None else [*out, flag, value]
    i = out.index(flag)
    if value is None:
        del out[i : i + 2]
    else:
        out[i + 1] = value
    return out


def attempt_argv(
    argv: list[str], job_dir: Path, attempt: int, steps: int, *, resuming: bool
) -> list[str]:
    """The argv of attempt ``attempt`` of a job whose first command was ``argv``.

    The attempt writes its own metrics file and trains to ``steps``; ``--resume auto``
    makes the recipe continue from the latest checkpoint. When ``resuming`` (there is a
    checkpoint) ``--init-from`` is dropped: the checkpoint already holds the trained
    weights, and the recipe refuses both.
    """
    out = _set_flag(argv, _option("metrics_file"), str(job_dir / metrics_file(attempt)))
    out = _set_flag(out, _option("steps"), str(steps))
    if resuming:
        out = _set_flag(out, _option("init_from"), None)
    return out


def plan_view(
    settings: Settings, spec: JobCreate, accepted: Review, queued_ahead: int
) -> LaunchPlan:
    """The response of ``:validate``: command, batch arithmetic, estimates and warnings.

    Server paths are shown as placeholders (:class:`dmuon_server.paths.PublicPaths`).
    """
    spec = with_recipe_defaults(spec)
    t = spec.train
    n = spec.nproc_per_node
    job_dir = settings.job_dir("<job-id>")
    cmd = build_command(
        settings,
        spec,
        job_dir,
        accepted.data_path,
        accepted.init_checkpoint,
        model_path=accepted.model_path,
        tokenizer_path=accepted.tokenizer_path,
    )
    public = PublicPaths(settings, job_dir)
    cpus = usable_cpus()
    warnings: list[str] = []
    if n > cpus:
        warnings.append(
            f"nproc_per_node={n} is more than the {cpus} usable CPUs: ranks will share cores"
        )
    if t.warmup_steps is not None and t.warmup_steps >= t.steps:
        warnings.append(
            f"warmup_steps={t.warmup_steps} >= steps={t.steps}: the run never leaves warm-up"
        )
    if t.eval_every is not None and t.eval_every > t.steps:
        warnings.append(
            f"eval_every={t.eval_every} > steps={t.steps}: only step 0 and the end are evaluated"
        )
    if t.optimizer == "adamw" and t.mode == "z3":
        warnings.append("mode only changes how DMuon shares its matrices; adamw ignores it")
    warnings += accepted.warnings
    if settings.launcher == "slurm":
        warnings.append(
            f"submitted with sbatch: srun runs this command on each of the {spec.nnodes} "
            "node(s), with c10d rendezvous on the first node in place of --standalone"
        )
    if queued_ahead:
        warnings.append(f"{queued_ahead} job(s) are queued or running ahead of this one")
    seqs = t.micro_batch_size * t.accum_steps * n * spec.nnodes
    return LaunchPlan(
        argv=public.argv(cmd.argv),
        torchrun_argv=public.argv(cmd.torchrun_argv),
        env=public.env(cmd.env),
        world_size=n * spec.nnodes,
        global_batch_sequences=seqs,
        global_batch_tokens=seqs * t.seq_len,
        total_tokens=seqs * t.seq_len * t.steps,
        admission=accepted.admission,
        warnings=warnings,
    )


def launch_env(settings: Settings, job_id: str, nproc: int) -> dict[str, str]:
    """Variables the server sets for a job on top of its own environment.

    ``OMP_NUM_THREADS`` splits the usable CPUs evenly between the ranks (at least 1 each).
    """
    return {
        "OMP_NUM_THREADS": str(max(1, usable_cpus() // nproc)),
        "PYTHONUNBUFFERED": "1",
        JOB_ENV_MARKER: job_id,
        DATA_DIR_ENV_MARKER: str(settings.data_dir),
    }


def job_env(settings: Settings, plan_env: dict[str, str]) -> dict[str, str]:
    """The server's environment without its secrets and torchrun/rank variables, plus
    ``plan_env``.

    A job runs code paths its submitter chose, so it never receives the server's token
    (``DMUON_SERVER_TOKEN``) nor any variable named by ``--secret-env``.
    """
    secret = set(settings.secret_env)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _SCRUBBED_VARS and k not in secret and not k.startswith(_SCRUBBED_PREFIXES)
    }
    env.update(plan_env)
    return env
