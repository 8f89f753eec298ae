"""Server settings: one immutable object built by the CLI (or a test) and passed down."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

#: Environment variable naming the training module the server launches under torchrun.
TRAIN_MODULE_ENV = "DMUON_SERVER_TRAIN_MODULE"
#: Environment variable holding the bearer token.
TOKEN_ENV = "DMUON_SERVER_TOKEN"
#: Environment variable every process of a job carries, with the job id as its value. The
#: supervisor uses it to find (and end) stray processes of a job, even ones that left the
#: job's process group or session, e.g. torchrun workers (they run in sessions of their own).
JOB_ENV_MARKER = "DMUON_SERVER_JOB"
#: Environment variable every process of a job carries, with the server's data directory.
DATA_DIR_ENV_MARKER = "DMUON_SERVER_DATA_DIR"
#: Largest request body accepted by default (1 MiB); a job spec is a few hundred bytes.
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: Share of the host's RAM one job may be estimated to use, by default.
DEFAULT_JOB_MEMORY_FRACTION = 0.5
#: Processes and threads a local job may run at once unless ``--max-job-pids`` says.
DEFAULT_JOB_PIDS = 4096


def format_gib(n: int) -> str:
    """``n`` bytes in GiB with the precision a person gave it: the fewest decimals (up to
    6) that give back the same bytes (``0.25 GiB``, ``1.5 GiB``), else two."""
    value = n / 2**30
    for decimals in range(7):
        if int(round(value, decimals) * 2**30) == n:
            return f"{value:.{decimals}f} GiB"
    return f"{value:.2f} GiB"


def default_max_job_memory() -> int:
    """Half of the host's RAM: room for the server, other jobs and the page cache."""
    import psutil

    return int(psutil.virtual_memory().total * DEFAULT_JOB_MEMORY_FRACTION)


def usable_cpus() -> int:
    """Return the number of CPUs this process may run on (affinity-aware, at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


#: The names a loopback server answers to without ``--allowed-host``.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
#: The runner's exit report in a job's folder (written by `dmuon_server.runner`).
EXIT_FILE = "exit.json"


@dataclass(frozen=True)
class Settings:
    """Everything the server needs to know; immutable once the app is built.

    Attributes:
        data_dir: Folder holding the SQLite database and one working folder per job.
        token: Bearer token; when set, every endpoint but ``/healthz`` requires it.
        max_concurrent_jobs: How many jobs run at the same time; the rest wait in the queue.
            None: the number of GPUs on a server with GPUs, else 1.
        max_nproc_per_node: The largest ``nproc_per_node`` a job may ask for. Defaults to the
            number of usable CPUs: the recipe runs one process per CPU core with gloo.
        data_roots: Folders a job's ``train.data`` path must lie in (after resolving symlinks
            and ``..``). None by default: jobs then train on the recipe's default corpus only.
        model_roots: Folders a job's ``train.model.path`` and ``train.tokenizer`` must lie
            in, resolved the same way. None by default: jobs then train presets only.
        train_module: The Python module torchrun runs (``-m``); ``dmuon.train`` unless
            ``DMUON_SERVER_TRAIN_MODULE`` says otherwise.
        python: The interpreter jobs run with (the server's own by default).
        heartbeat_s: Seconds between SSE heartbeat comments.
        cancel_grace_s: Seconds between SIGTERM and SIGKILL when a job is cancelled: the
            recipe finishes its step and saves a checkpoint in that time.
        poll_interval_s: How often the supervisor looks at running jobs and their metrics.
        disk_reserve_bytes: Space the server sets aside in the data directory
            (:class:`dmuon_server.storage.datadir.SpaceReserve`) and gives back when the disk fills,
            so that it can still record how the jobs ended; 0 sets none aside.
        log_tail_lines: How many log lines a failure report carries.
        max_body_bytes: Largest request body; larger ones get 413 before they are read.
        max_job_memory: Bytes a job (all its ranks) may be estimated to need; a larger
            job is refused at submission, and a local job that uses more is stopped by the
            kernel (its cgroup's memory limit). Half of the host's RAM by default.
        secret_env: Names of environment variables that never reach a job, besides the
            token variable (always scrubbed).
        launcher: Where jobs run: ``local`` (torchrun on this host) or ``slurm`` (one
            ``sbatch`` submission per attempt; the data directory must be on a filesystem
            all nodes share).
        slurm_poll_interval_s: How often the state of a Slurm job is asked from Slurm.
        gpus: The GPUs jobs may use (``--gpus``; empty: none). A job takes one per process
            and sees only its own (``CUDA_VISIBLE_DEVICES``).
        code_roots: Folders a script job's ``script.path`` must lie in (``--code-root``);
            none by default: script jobs are refused.
        users_file: The users and their token hashes (``--users-file``), or None.
        job_user: The Unix account jobs run as (``--job-user``) when their user has no
            ``unix_user``; None: the server's own (see :mod:`dmuon_server.launching.identity`).
        allow_same_user_jobs: Whether script jobs may run as the server's own account, and
            a root server may run jobs as root (``--allow-same-user-jobs``).
        sandbox: ``bwrap``: each local job runs in a bubblewrap sandbox that shows it only
            its folder, its code, the data and model roots and a private ``/proc``
            (:mod:`dmuon_server.launching.sandbox`); ``none``: no sandbox. The CLI's
            ``auto`` becomes one of them at start-up.
        token_file: The file the token was read from (``--token-file``) or generated in
            (``<data-dir>/token``); hidden from jobs like the data directory.
        host_network: Whether every local job keeps the host's network in the sandbox
            (``--job-network host``); otherwise only the jobs of users with
            ``host_network`` in the users file do, and the others get a loopback-only
            network of their own.
        working_dir: The folder the server was started from (hidden from jobs).
        job_env: More of the server's environment variables jobs receive (``--job-env``;
            ``NAME`` or a prefix ``NAME*``) besides
            :data:`dmuon_server.launching.command.JOB_ENV_ALLOWED`.
        max_job_pids: Processes (threads included) a local job may run at once, held by
            the job's cgroup (:mod:`dmuon_server.launching.cgroups`).
        max_job_cpus: CPUs' worth of time a local job may use (its cgroup's CPU quota);
            None: the usable CPUs. ``max_job_memory`` is the cgroup's memory limit.
        max_job_metrics_bytes: Bytes of the server's database a job's metric points and
            events may take (lower where its user's ``disk_gib`` is lower); a job past it
            is stopped and fails, naming the limit.
        limits_asked: The kernel limits a flag asked for (``memory``, ``pids``, ``cpus``):
            a local server that cannot hold one refuses to start
            (:mod:`dmuon_server.launching.enforcement`); a default it cannot hold is
            reported.
        allow_unenforced_limits: Start anyway (``--allow-unenforced-limits``), reporting
            the limits that are off in ``GET /v1/server`` and on the dashboard.
        allowed_hosts: Host names requests may name besides the loopback ones
            (``--allowed-host``); see :mod:`dmuon_server.http.hosts`. Given, they turn the
            ``Host`` and ``Origin`` checks on for a server with a token too.
    """

    data_dir: Path = field(default_factory=lambda: Path(".dmuon"))
    token: str | None = None
    max_concurrent_jobs: int | None = None
    max_nproc_per_node: int = field(default_factory=usable_cpus)
    data_roots: tuple[Path, ...] = ()
    model_roots: tuple[Path, ...] = ()
    train_module: str = field(
        default_factory=lambda: os.environ.get(TRAIN_MODULE_ENV) or "dmuon.train"
    )
    python: str = field(default_factory=lambda: __import__("sys").executable)
    heartbeat_s: float = 15.0
    cancel_grace_s: float = 30.0
    poll_interval_s: float = 0.2
    disk_reserve_bytes: int = 4 << 20
    log_tail_lines: int = 50
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_job_memory: int = field(default_factory=default_max_job_memory)
    secret_env: tuple[str, ...] = ()
    launcher: Literal["local", "slurm"] = "local"
    slurm_poll_interval_s: float = 1.0
    allowed_hosts: tuple[str, ...] = ()
    gpus: tuple[int, ...] = ()
    code_roots: tuple[Path, ...] = ()
    users_file: Path | None = None
    job_user: str | None = None
    allow_same_user_jobs: bool = False
    sandbox: Literal["bwrap", "none"] = "none"
    token_file: Path | None = None
    host_network: bool = False
    job_env: tuple[str, ...] = ()
    max_job_pids: int = DEFAULT_JOB_PIDS
    max_job_cpus: float | None = None
    max_job_metrics_bytes: int = 256 << 20
    limits_asked: tuple[str, ...] = ()
    allow_unenforced_limits: bool = False
    working_dir: Path = field(default_factory=lambda: Path(os.getcwd()))

    @property
    def server_files(self) -> tuple[Path, ...]:
        """What no job may see: the data directory, the users and token files and the
        folder the server was started from (a sandbox masks them; see
        :func:`dmuon_server.launching.sandbox.wrap`)."""
        files = [self.data_dir, self.users_file, self.token_file]
        roots = (*self.code_roots, *self.data_roots, *self.model_roots)
        if not any(self.working_dir == r or r in self.working_dir.parents for r in roots):
            files.append(self.working_dir)  # unless a root the operator gave is there
        return tuple(Path(f) for f in files if f is not None)

    def __post_init__(self) -> None:
        """Normalise paths (absolute, symlinks resolved) and check the numbers."""
        data_dir = Path(os.path.realpath(self.data_dir))
        object.__setattr__(self, "data_dir", data_dir)
        roots = self.data_roots or ()
        object.__setattr__(self, "data_roots", tuple(Path(os.path.realpath(r)) for r in roots))
        models = self.model_roots or ()
        object.__setattr__(self, "model_roots", tuple(Path(os.path.realpath(r)) for r in models))
        object.__setattr__(self, "working_dir", Path(os.path.realpath(self.working_dir)))
        if self.token_file is not None:
            object.__setattr__(self, "token_file", Path(os.path.realpath(self.token_file)))
        code = self.code_roots or ()
        object.__setattr__(self, "code_roots", tuple(Path(os.path.realpath(r)) for r in code))
        if self.max_concurrent_jobs is None:
            object.__setattr__(self, "max_concurrent_jobs", len(self.gpus) or 1)
        if self.max_concurrent_jobs < 1:
            raise ValueError("max_concurrent_jobs must be at least 1")
        if self.max_nproc_per_node < 1:
            raise ValueError("max_nproc_per_node must be at least 1")
        if self.launcher not in ("local", "slurm"):
            raise ValueError(f"launcher must be 'local' or 'slurm', not {self.launcher!r}")
        if self.sandbox not in ("bwrap", "none"):
            raise ValueError(f"sandbox must be 'bwrap' or 'none', not {self.sandbox!r}")
        if self.max_body_bytes < 1 or self.max_job_memory < 1:
            raise ValueError("max_body_bytes and max_job_memory must be at least 1")
        if self.token is not None and not self.token:
            object.__setattr__(self, "token", None)

    @property
    def job_slots(self) -> int:
        """Jobs that may be active at once (``max_concurrent_jobs`` once resolved)."""
        return int(self.max_concurrent_jobs or 1)

    @property
    def host_check(self) -> tuple[str, ...] | None:
        """The host names requests may name, or None when ``Host`` is not checked (a
        server with tokens and no ``--allowed-host``)."""
        if (self.token or self.users_file) and not self.allowed_hosts:
            return None
        return (*LOOPBACK_NAMES, *self.allowed_hosts)

    @property
    def db_path(self) -> Path:
        """Path of the SQLite database."""
        return self.data_dir / "dmuon-server.sqlite3"

    @property
    def jobs_dir(self) -> Path:
        """Folder holding one working folder per job."""
        return self.data_dir / "jobs"

    def job_dir(self, job_id: str) -> Path:
        """Working folder of one job."""
        return self.jobs_dir / job_id


def flag_problem(args: Any) -> str | None:
    """What is wrong with the numbers and folders ``dmuon-server``'s parsed flags (``args``)
    give, or None (``--gpus`` is checked where it is parsed)."""
    for name, value in (
        ("--max-concurrent-jobs", args.max_concurrent_jobs),
        ("--max-nproc", args.max_nproc),
        ("--max-body-bytes", args.max_body_bytes),
    ):
        if value is not None and value < 1:
            return f"{name} must be at least 1"
    if args.cancel_grace < 0 or args.heartbeat <= 0:
        return "--cancel-grace-s >= 0 and --heartbeat > 0"
    for flag, number in (("--max-job-memory", args.max_job_memory),
                         ("--max-job-cpus", args.max_job_cpus)):  # fmt: skip
        if number is not None and not number > 0:
            return f"{flag} must be a positive number"
    if args.max_job_metrics_bytes < 1 << 20:
        return "--max-job-metrics-bytes must be at least 1 MiB (1048576)"
    if args.max_job_pids is not None and args.max_job_pids < 16:
        return "--max-job-pids must be at least 16 (torchrun and a rank need a few)"
    for flag, roots in (
        ("--data-root", args.data_root),
        ("--model-root", args.model_root),
        ("--code-root", args.code_root),
    ):
        for root in roots or ():
            if not root.is_dir():
                return f"{flag} {root} is not an existing folder; create it or fix the path"
    return None


def settings_from_flags(
    args: Any,
    token: str | None,
    token_file: Path | None,
    gpus: tuple[int, ...],
    allowed_hosts: tuple[str, ...] | None,
) -> Settings:
    """The server's settings from ``dmuon-server``'s parsed flags (``args``), with the
    token, the file it came from, the GPUs and the host names requests may name."""
    return Settings(
        data_dir=args.data_dir,
        token=token,
        max_concurrent_jobs=args.max_concurrent_jobs,
        max_nproc_per_node=args.max_nproc or len(gpus) or usable_cpus(),
        data_roots=tuple(args.data_root or ()),
        model_roots=tuple(args.model_root or ()),
        cancel_grace_s=args.cancel_grace,
        heartbeat_s=args.heartbeat,
        max_body_bytes=args.max_body_bytes,
        max_job_memory=(
            int(args.max_job_memory * (1 << 30))
            if args.max_job_memory is not None
            else default_max_job_memory()
        ),
        max_job_pids=args.max_job_pids or DEFAULT_JOB_PIDS,
        limits_asked=tuple(
            name
            for name, value in (
                ("memory", args.max_job_memory),
                ("pids", args.max_job_pids),
                ("cpus", args.max_job_cpus),
            )
            if value is not None
        ),
        allow_unenforced_limits=args.allow_unenforced_limits,
        max_job_cpus=args.max_job_cpus,
        max_job_metrics_bytes=args.max_job_metrics_bytes,
        secret_env=tuple(args.secret_env),
        job_env=tuple(args.job_env),
        launcher=args.launcher,
        allowed_hosts=allowed_hosts,
        gpus=gpus,
        code_roots=tuple(args.code_root or ()),
        users_file=args.users_file,
        job_user=args.job_user,
        allow_same_user_jobs=args.allow_same_user_jobs,
        token_file=token_file,
        host_network=args.job_network == "host",
    )
