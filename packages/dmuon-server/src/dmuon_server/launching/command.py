"""Turning a job spec into a command line and an environment (never a shell string).

A job runs as ``python -m dmuon_server.runner --job-dir DIR -- <torchrun args>``; see
:mod:`dmuon_server.runner`. The program torchrun starts is the recipe (``-m dmuon.train``
and its flags) or a user's script (its path and arguments). :func:`review` checks a spec
against the server's limits and what the recipe can do (:mod:`dmuon_server.recipe.admission`)
before anything is planned; it reports what is wrong, and the routes answer with it.

Every process of a job gets ``DMUON_JOB_ID``, ``DMUON_METRICS_FILE`` (the file of its
attempt), ``DMUON_CHECKPOINT_DIR``, ``DMUON_RESUME_FROM`` (the checkpoint an attempt
resumes from, when there is one), ``CUDA_VISIBLE_DEVICES`` (its GPUs, on a server with
GPUs) and, for a script that gives them, ``DMUON_STEPS``, ``DMUON_MICRO_BATCH_SIZE`` and
``DMUON_ACCUM_STEPS``. A recipe job on a server with data roots gets them in
``DMUON_DATA_ROOTS`` (`dmuon_recipe_contract.DATA_ROOTS_ENV`): a link inside its data folder
may lead anywhere in them, as admission allowed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import dmuon_recipe_contract as contract

from dmuon_server.config import (
    DATA_DIR_ENV_MARKER,
    JOB_ENV_MARKER,
    TOKEN_ENV,
    Settings,
    usable_cpus,
)
from dmuon_server.http.errors import field_error
from dmuon_server.recipe.admission import ModelInputs, assess
from dmuon_server.recipe.hf_models import ModelDirError, read_model_dir, tokenizer_vocab
from dmuon_server.scheduling.gpus import visible_devices
from dmuon_server.schemas import (
    GENERATED_FLAGS,
    SLURM_ONLY_FIELDS,
    Admission,
    FieldError,
    JobCreate,
    LaunchPlan,
    ModelPath,
)
from dmuon_server.storage.jobfiles import (
    CHECKPOINT_DIR,
    EXPORT_DIR,
    INIT_DIR,
    METRICS_FILE,
    TORCHRUN_LOG_DIR,
    TRACKING_DIR,
    CheckpointInfo,
    checkpoint_name,
    list_checkpoints,
    metrics_file,
)
from dmuon_server.storage.paths import (
    DataPathError,
    PublicPaths,
    resolve_code_path,
    resolve_data_path,
    resolve_model_path,
)

#: The variables every process of a job finds (see the module docstring).
JOB_ID_ENV = "DMUON_JOB_ID"
METRICS_FILE_ENV = "DMUON_METRICS_FILE"
CHECKPOINT_DIR_ENV = "DMUON_CHECKPOINT_DIR"
RESUME_FROM_ENV = "DMUON_RESUME_FROM"
#: torchrun's options before the program, and those of them that take a value.
_TORCHRUN_VALUE_OPTIONS = frozenset({"--nproc_per_node", "--tee", "--log-dir"})
_TORCHRUN_FLAGS = frozenset({"--standalone"})

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
    """What :func:`review` found: the fields to change (none: the server accepts the spec),
    the resolved data path or script, the estimates, the warnings, the checkpoint
    ``init_from`` names, the GPUs per node the job takes, and the resolved model directory
    and tokenizer."""

    errors: list[FieldError] = field(default_factory=list)
    data_path: Path | None = None
    script_path: Path | None = None
    admission: Admission | None = None
    warnings: list[str] = field(default_factory=list)
    init_checkpoint: CheckpointInfo | None = None
    gpus_per_node: int = 0
    model_path: Path | None = None
    tokenizer_path: Path | None = None

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
    settings: Settings, spec: JobCreate, visible: Callable[[str], bool] = lambda _: True
) -> Review:
    """Check ``spec`` against the server's limits and the recipe: whether it can run, and
    what it needs.

    The errors name every field to change; the estimates come along when the spec got far
    enough to make them. ``visible`` says whether the submitter may see a job (the source
    of ``init_from``).
    """
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
        settings.max_job_memory,
        model,
        settings.data_roots,
    )
    errors = [field_error(r.loc, r.message, "admission") for r in refusals]
    return Review(
        errors, data_path, None, admission, warnings, init, gpus, model_path, tokenizer_path
    )


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


def build_command(
    settings: Settings, spec: JobCreate, job_dir: Path, accepted: Review | None = None
) -> Command:
    """The runner's argv, the equivalent torchrun argv and the variables set for the job.

    This is the first attempt's command; :func:`attempt_argv` and :func:`launch_env`
    derive the later ones. ``accepted`` is the spec's :func:`review` (None: a recipe job
    with no paths to resolve, as for a preset on the built-in corpus).
    """
    accepted = accepted or Review()
    n = spec.nproc_per_node
    if spec.script is not None:
        assert accepted.script_path is not None
        program = [str(accepted.script_path), *spec.script.args]
    else:
        program = _recipe(settings, spec, job_dir, accepted)
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
        *program,
    ]
    torchrun_argv = [settings.python, "-m", "torch.distributed.run", *torchrun_opts, *program]
    env = launch_env(settings, spec, job_dir, attempt=1, gpus=None)
    return Command(argv, torchrun_argv, env)


def _option(dest: str) -> str:
    """The recipe's spelling of a flag (``--micro-batch-size``), from its contract."""
    return contract.flag(dest).option


def _recipe(settings: Settings, spec: JobCreate, job_dir: Path, accepted: Review) -> list[str]:
    """``-m <recipe> <flags>``: the recipe and its flags for ``spec.train``, with the
    recipe's defaults filled in (`with_recipe_defaults`) and the paths ``accepted`` resolved.
    """
    t = with_recipe_defaults(spec).train
    assert t is not None
    init = accepted.init_checkpoint
    model = str(accepted.model_path) if isinstance(t.model, ModelPath) else t.model
    tokenizer = accepted.tokenizer_path
    data = accepted.data_path
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
        ("tokenizer", None if tokenizer is None else str(tokenizer)),
        ("data", None if data is None else str(data)),
        ("text_field", t.text_field),
        ("param_dtype", t.param_dtype),
        ("reduce_dtype", t.reduce_dtype),
        ("broadcast_dtype", t.broadcast_dtype),
        ("muon_variant", t.muon_variant),
        ("ns_dtype", t.ns_dtype),
        ("checkpoint_dir", str(job_dir / CHECKPOINT_DIR)),
        ("checkpoint_every", str(t.checkpoint_every)),
        ("keep_checkpoints", str(t.keep_checkpoints)),
        ("on_checkpoint_error", t.on_checkpoint_error),
        ("collective_timeout", None if t.collective_timeout is None else str(t.collective_timeout)),
        ("resume", "auto"),
        ("init_from", None if init is None else str(init_path(job_dir, init))),
        ("export_hf", str(job_dir / EXPORT_DIR) if t.export_hf else None),
        ("tracking_dir", str(job_dir / TRACKING_DIR)),
    ]
    switches = ["activation_checkpointing", "compile"]
    for dest in GENERATED_FLAGS:  # the rest of the recipe's flags, as the contract has them
        value = getattr(t, dest)
        if dest == "run_name" and value is None and t.report_to not in (None, "none"):
            value = spec.name or job_dir.name  # the trackers' run: the job's name, or its id
        if isinstance(value, bool):
            switches += [dest] if value else []
        elif value is not None:
            values.append((dest, _fmt_float(value) if isinstance(value, float) else str(value)))
    recipe = ["-m", settings.train_module]
    for dest, value in values:
        if value is not None:
            recipe += [_option(dest), value]
    for dest in switches:
        if getattr(t, dest):
            recipe.append(_option(dest))
    return recipe


def program_of(runner_argv: list[str]) -> list[str]:
    """The program part of a stored runner argv: what follows torchrun's options (``-m
    MODULE FLAGS...`` of the recipe, or a script and its arguments)."""
    args = runner_argv[runner_argv.index("--") + 1 :]
    i = 0
    while i < len(args):
        if args[i] in _TORCHRUN_VALUE_OPTIONS:
            i += 2
        elif args[i] in _TORCHRUN_FLAGS:
            i += 1
        else:
            break
    return args[i:]


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
    spec: JobCreate, argv: list[str], job_dir: Path, attempt: int, *, resuming: bool
) -> list[str]:
    """The argv of attempt ``attempt`` of a job whose first command was ``argv``.

    The recipe's attempt writes its own metrics file and trains to the spec's steps;
    ``--resume auto`` makes it continue from the latest checkpoint. When ``resuming``
    (there is a checkpoint) ``--init-from`` is dropped: the checkpoint already holds the
    trained weights, and the recipe refuses both. A script's argv stays as it was (its
    attempt learns its metrics file and checkpoint from the environment).
    """
    if spec.train is None:
        return list(argv)
    steps = spec.train.steps
    out = _set_flag(argv, _option("metrics_file"), str(job_dir / metrics_file(attempt)))
    out = _set_flag(out, _option("steps"), str(steps))
    if resuming:
        out = _set_flag(out, _option("init_from"), None)
    return out


def plan_view(
    settings: Settings, spec: JobCreate, accepted: Review, queued_ahead: int
) -> LaunchPlan:
    """The response of ``:validate``: command, batch arithmetic, estimates and warnings.

    Server paths are shown as placeholders (:class:`dmuon_server.storage.paths.PublicPaths`).
    """
    spec = with_recipe_defaults(spec)
    t = spec.train
    n = spec.nproc_per_node
    world = n * spec.nnodes
    job_dir = settings.job_dir("<job-id>")
    cmd = build_command(settings, spec, job_dir, accepted)
    public = PublicPaths(settings, job_dir)
    cpus = usable_cpus()
    warnings: list[str] = []
    if n > cpus and not accepted.gpus_per_node:
        warnings.append(
            f"nproc_per_node={n} is more than the {cpus} usable CPUs: ranks will share cores"
        )
    seqs: int | None = None
    tokens: int | None = None
    if t is not None:
        seqs = t.micro_batch_size * t.accum_steps * world
        tokens = seqs * t.seq_len
        if t.warmup_steps is not None and t.warmup_steps >= t.steps:
            warnings.append(
                f"warmup_steps={t.warmup_steps} >= steps={t.steps}: the run never leaves warm-up"
            )
        if t.eval_every is not None and t.eval_every > t.steps:
            warnings.append(
                f"eval_every={t.eval_every} > steps={t.steps}: only step 0 and the end are "
                "evaluated"
            )
        if t.optimizer == "adamw" and t.mode == "z3":
            warnings.append("mode only changes how DMuon shares its matrices; adamw ignores it")
        warnings += accepted.warnings
    elif spec.script is not None and spec.script.micro_batch_size is not None:
        seqs = spec.script.micro_batch_size * (spec.script.accum_steps or 1) * world
    if settings.launcher == "slurm":
        warnings.append(
            f"submitted with sbatch: srun runs this command on each of the {spec.nnodes} "
            "node(s), with c10d rendezvous on the first node in place of --standalone"
        )
    if queued_ahead:
        warnings.append(f"{queued_ahead} job(s) are queued or running ahead of this one")
    return LaunchPlan(
        argv=public.argv(cmd.argv),
        torchrun_argv=public.argv(cmd.torchrun_argv),
        env=public.env(cmd.env),
        world_size=world,
        gpus_per_node=accepted.gpus_per_node,
        global_batch_sequences=seqs,
        global_batch_tokens=tokens,
        total_tokens=tokens * t.steps if t is not None and tokens is not None else None,
        admission=accepted.admission,
        warnings=warnings,
    )


def launch_env(
    settings: Settings,
    spec: JobCreate,
    job_dir: Path,
    *,
    attempt: int,
    gpus: list[int] | None,
    resume_from: Path | None = None,
) -> dict[str, str]:
    """Variables the server sets for attempt ``attempt`` of a job, on top of its own
    environment (see the module docstring).

    ``gpus`` are the job's devices (None before it holds any, as in a dry run).
    ``OMP_NUM_THREADS`` splits the usable CPUs evenly between the ranks (at least 1 each).
    """
    env = {
        "OMP_NUM_THREADS": str(max(1, usable_cpus() // spec.nproc_per_node)),
        "PYTHONUNBUFFERED": "1",
        JOB_ENV_MARKER: job_dir.name,
        DATA_DIR_ENV_MARKER: str(settings.data_dir),
        JOB_ID_ENV: job_dir.name,
        METRICS_FILE_ENV: str(job_dir / metrics_file(attempt)),
        CHECKPOINT_DIR_ENV: str(job_dir / CHECKPOINT_DIR),
    }
    if resume_from is not None:
        env[RESUME_FROM_ENV] = str(resume_from)
    if spec.train is not None and spec.train.data is not None and settings.data_roots:
        env[contract.DATA_ROOTS_ENV] = os.pathsep.join(map(str, settings.data_roots))
    if settings.launcher == "local" and settings.gpus and gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(gpus)
    s = spec.script
    if s is not None:
        for name, value in (
            ("DMUON_STEPS", s.steps),
            ("DMUON_MICRO_BATCH_SIZE", s.micro_batch_size),
            ("DMUON_ACCUM_STEPS", s.accum_steps),
        ):
            if value is not None:
                env[name] = str(value)
    return env


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
