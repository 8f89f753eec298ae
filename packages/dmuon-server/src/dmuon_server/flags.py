"""The flags of ``dmuon-server``: where it listens and who may call it, how much it runs
at once and what each job may take, and what reaches a job and how it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from dmuon_server import __version__
from dmuon_server.config import (
    DEFAULT_JOB_MEMORY_FRACTION,
    DEFAULT_JOB_PIDS,
    DEFAULT_MAX_BODY_BYTES,
    TOKEN_ENV,
)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when there is one and its help does not say it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, [], False, argparse.SUPPRESS) or "default" in text:
            return text
        return super()._get_help_string(action) or text


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``dmuon-server``."""
    p = argparse.ArgumentParser(
        prog="dmuon-server",
        description="Job controller that launches DMuon training with torchrun and streams "
        "its step/loss metrics over REST and Server-Sent Events.",
        formatter_class=_HelpFormatter,
    )
    _listen_and_auth_flags(p)
    _capacity_flags(p)
    _limit_flags(p)
    _job_flags(p)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return p


def _listen_and_auth_flags(p: argparse.ArgumentParser) -> None:
    """Where the server listens and who may call it."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one")
    p.add_argument("--data-dir", type=Path, default=Path(".dmuon"), help="state and job folders")
    p.add_argument(
        "--token",
        default=None,
        help=f"bearer token required on every endpoint but /healthz (or env {TOKEN_ENV}); "
        "mandatory on a non-loopback --host. Visible in `ps`: prefer --token-file",
    )
    p.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="read the bearer token from FILE (one trailing newline is dropped)",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="answer requests without a token, for one person on a machine of their own: "
        "every local account could otherwise list, cancel and submit jobs that run as this "
        "server's account. Without it (and without --token, --token-file or --users-file) "
        "the server makes a token, keeps it in <data-dir>/token and prints it",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name requests may be addressed to besides 127.0.0.1, localhost and "
        "[::1] (repeatable); without a token only those are answered (DNS rebinding), with "
        "a token the check applies once this is given",
    )
    p.add_argument(
        "--users-file",
        type=Path,
        default=None,
        metavar="FILE",
        help='users and their token hashes, {"users": [{"name", "token_sha256", "admin"}]}; '
        "each sees only their own jobs, admins all; not readable by other users; reloaded "
        "on SIGHUP",
    )


def _capacity_flags(p: argparse.ArgumentParser) -> None:
    """How much the server runs at once, on what, and the limits of one job."""
    p.add_argument(
        "--max-concurrent-jobs",
        type=int,
        default=None,
        help="jobs running at once (default: the number of GPUs with --gpus, else 1)",
    )
    p.add_argument(
        "--gpus",
        default="auto",
        metavar="auto|none|LIST",
        help="GPUs jobs may use, one per process: auto (those NVML or nvidia-smi reports), "
        "none, or indices such as 0,1,2,3",
    )
    p.add_argument(
        "--max-nproc",
        type=int,
        default=None,
        help="largest nproc_per_node a job may ask for (default: the number of GPUs with "
        "--gpus, one process each; else the usable CPUs)",
    )
    p.add_argument(
        "--data-root",
        action="append",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder train.data may point into (repeatable); default: none, jobs train "
        "on the recipe's built-in corpus",
    )
    p.add_argument(
        "--model-root",
        action="append",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder train.model.path and train.tokenizer may point into (repeatable); "
        "default: none, jobs train presets only",
    )
    p.add_argument(
        "--code-root",
        action="append",
        type=Path,
        default=None,
        metavar="DIR",
        help="folder a script job's script.path may point into (repeatable); default: "
        "none, only the recipe runs",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; larger ones get 413 before they are read",
    )


def _limit_flags(p: argparse.ArgumentParser) -> None:
    """What the kernel holds each local job to, and starting where it cannot."""
    p.add_argument(
        "--max-job-memory",
        type=float,
        default=None,
        metavar="GIB",
        # argparse formats help with %: a percent sign must be doubled.
        help="memory of one job, in GiB: a larger estimate is refused, and a local job that "
        "uses more is stopped by the kernel (its cgroup); default: "
        f"{DEFAULT_JOB_MEMORY_FRACTION * 100:.0f}%% of the host's RAM",
    )
    p.add_argument(
        "--max-job-pids",
        type=int,
        default=None,
        metavar="N",
        help="processes and threads a local job may run at once (its cgroup; default: "
        f"{DEFAULT_JOB_PIDS})",
    )
    p.add_argument(
        "--allow-unenforced-limits",
        action="store_true",
        help="start even where the machine cannot hold a limit a flag or the users file "
        "asks for (no cgroup, no disk volumes); GET /v1/server and the dashboard then say "
        "which limits are off. Without it such a server refuses to start",
    )
    p.add_argument(
        "--max-job-cpus",
        type=float,
        default=None,
        metavar="CPUS",
        help="CPU time of a local job, in CPUs (its cgroup; default: no limit)",
    )


def _job_flags(p: argparse.ArgumentParser) -> None:
    """What reaches a job and how it runs: environment, account, sandbox, network."""
    p.add_argument(
        "--max-job-metrics-bytes",
        type=int,
        default=256 << 20,
        metavar="BYTES",
        help="bytes of the server's database one job's metric points and events may take "
        "(lower where its user's disk_gib is); a job past it is stopped and fails "
        "(default: 256 MiB)",
    )
    p.add_argument(
        "--secret-env",
        action="append",
        default=[],
        metavar="NAME",
        help=f"environment variable jobs must not see (repeatable; {TOKEN_ENV} never "
        "reaches a job)",
    )
    p.add_argument(
        "--job-env",
        action="append",
        default=[],
        metavar="NAME",
        help="an environment variable of the server jobs also receive (repeatable; NAME* "
        "for a prefix); by default only the documented allow-list reaches a job",
    )
    p.add_argument(
        "--cancel-grace-s",
        dest="cancel_grace",
        type=float,
        default=30.0,
        help="seconds a cancelled job gets to save a checkpoint between SIGTERM and SIGKILL",
    )
    p.add_argument(
        "--heartbeat", type=float, default=15.0, help="seconds between SSE heartbeat comments"
    )
    p.add_argument(
        "--launcher",
        choices=["local", "slurm"],
        default="local",
        help="where jobs run: local (torchrun on this host) or slurm (sbatch; the data "
        "directory must be on a filesystem every node mounts at the same path)",
    )
    p.add_argument(
        "--job-user",
        default=None,
        metavar="ACCOUNT",
        help="Unix account jobs run as when their user has no unix_user in the users file "
        "(a dedicated unprivileged account; the server must run as root)",
    )
    p.add_argument(
        "--allow-same-user-jobs",
        action="store_true",
        help="let jobs without an account of their own run as the server's own Unix account "
        "(script jobs are refused otherwise, and a root server refuses to start): a job can "
        "then read the server's files",
    )
    p.add_argument(
        "--sandbox",
        choices=["auto", "bwrap", "none"],
        default="auto",
        help="run each local job in a bubblewrap sandbox that shows it only its folder, its "
        "code, the data and model roots and its own processes: bwrap (required), none, or "
        "auto (bwrap where it works)",
    )
    p.add_argument("--token-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--job-network",
        choices=["isolated", "host"],
        default="isolated",
        help="a sandboxed local job's network: isolated (loopback only, its own: no job "
        "reaches another's rendezvous store, ports or sockets) or host (every job keeps the "
        "host's network; for one person's server). Per user: host_network in the users file",
    )
