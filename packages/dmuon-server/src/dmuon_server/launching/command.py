"""Turning a job spec into a command line and an environment (never a shell string).

A job runs as ``python -m dmuon_server.runner --job-dir DIR -- <torchrun args>``; see
:mod:`dmuon_server.runner`. The program torchrun starts is the recipe (``-m dmuon.train``
and its flags) or a user's script (its path and arguments). It is built from a spec that
:func:`dmuon_server.recipe.review.review` accepted, with the recipe's defaults filled in
and its paths resolved there.

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
from dataclasses import dataclass
from pathlib import Path

import dmuon_recipe_contract as contract

from dmuon_server.config import (
    DATA_DIR_ENV_MARKER,
    JOB_ENV_MARKER,
    TOKEN_ENV,
    Settings,
    usable_cpus,
)
from dmuon_server.recipe.review import Review
from dmuon_server.schemas import (
    GENERATED_FLAGS,
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
    metrics_file,
)
from dmuon_server.storage.paths import (
    PublicPaths,
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


#: The server's environment variables a job receives (a name ending in ``*`` is a prefix);
#: ``--job-env`` adds more. Everything else (credentials of the operator's shell, cloud
#: keys, the server's own settings) stays with the server.
JOB_ENV_ALLOWED: tuple[str, ...] = (
    # the system: finding programs and libraries, language, time zone, certificates, proxies
    "PATH", "LD_LIBRARY_PATH", "LANG", "LANGUAGE", "LC_*", "TZ", "TERM",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    # Python and the numeric libraries
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
    "OPENBLAS_*", "MKL_*", "KMP_*", "GOMP_*",
    # PyTorch, CUDA and NCCL
    "TORCH_*", "CUDA_*", "NCCL_*", "NVIDIA_*", "CUBLAS_*", "CUDNN_*",
    # Hugging Face, trackers, DMuon's own switches
    "HF_*", "TRANSFORMERS_*", "TOKENIZERS_*", "MLFLOW_*", "WANDB_*", "DMUON_*",
)  # fmt: skip


def env_allowed(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether the variable ``name`` matches one of ``patterns`` (exact names, or prefixes
    written with a trailing ``*``)."""
    return any(name.startswith(p[:-1]) if p.endswith("*") else name == p for p in patterns)


def visible_devices(gpus: list[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` of a job holding ``gpus`` (empty: it sees none)."""
    return ",".join(str(d) for d in gpus)


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


def build_command(settings: Settings, job_dir: Path, accepted: Review) -> Command:
    """The runner's argv, the equivalent torchrun argv and the variables set for the job
    whose spec ``accepted`` reviewed (its ``spec``, with the recipe's defaults).

    This is the first attempt's command; :func:`attempt_argv` and :func:`launch_env`
    derive the later ones.
    """
    spec = accepted.spec
    assert spec is not None, "build_command takes a review made by review()"
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
    """``-m <recipe> <flags>``: the recipe and its flags for ``spec.train`` (the reviewed
    spec, with the recipe's defaults), with the paths ``accepted`` resolved."""
    t = spec.train
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


def plan_view(settings: Settings, accepted: Review, queued_ahead: int) -> LaunchPlan:
    """The response of ``:validate`` for a reviewed spec: command, batch arithmetic,
    estimates and warnings.

    Server paths are shown as placeholders (:class:`dmuon_server.storage.paths.PublicPaths`).
    """
    spec = accepted.spec
    assert spec is not None, "plan_view takes a review made by review()"
    t = spec.train
    n = spec.nproc_per_node
    world = n * spec.nnodes
    job_dir = settings.job_dir("<job-id>")
    cmd = build_command(settings, job_dir, accepted)
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
    """The server's variables a job may see (`JOB_ENV_ALLOWED` and ``--job-env``), without
    its secrets and torchrun/rank variables, plus ``plan_env``.

    A job runs code paths its submitter chose, so it never receives the server's token
    (``DMUON_SERVER_TOKEN``) nor any variable named by ``--secret-env``, nor any other
    variable of the server's that the allow-list does not name.
    """
    secret = set(settings.secret_env)
    allowed = (*JOB_ENV_ALLOWED, *settings.job_env)
    env = {
        k: v
        for k, v in os.environ.items()
        if env_allowed(k, allowed)
        and k not in _SCRUBBED_VARS
        and k not in secret
        and not k.startswith(_SCRUBBED_PREFIXES)
    }
    env.update(plan_env)
    return env
