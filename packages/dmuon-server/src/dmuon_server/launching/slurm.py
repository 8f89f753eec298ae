"""Running jobs on a Slurm cluster: the batch script, the Slurm commands, the state mapping.

Each attempt of a job is one ``sbatch`` submission of a script written into the job's
folder. The script runs one ``srun`` task per allocated node; each task is the server's
runner (:mod:`dmuon_server.runner`) around torchrun, which meets the other nodes' torchrun
agents through c10d rendezvous on the first node of the allocation. Everything a request
contributes to the script is validated by the schema first and shell-quoted here.

The job's folder (the server's data directory) must be on a filesystem every node mounts
at the same path: the recipe writes its metrics, checkpoints and logs there, and the
server reads them from there.

Finished jobs: ``scontrol show job`` knows a job for ``MinJobAge`` seconds after it ended;
after that the server asks ``sacct``, and, on clusters without accounting storage
(no slurmdbd), ``sacct --completion`` (the ``JobCompType`` record).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dmuon_server.launching.identity import Account, drop_privileges
from dmuon_server.storage.states import JobState

#: The commands the backend runs; all must be on the server's PATH.
SLURM_COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sacct")
#: Slurm states of jobs that have not started yet.
PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
#: Slurm states of jobs that hold (or are cleaning up) their nodes.
RUNNING_STATES = frozenset(
    {
        "RUNNING",
        "CONFIGURING",
        "COMPLETING",
        "SUSPENDED",
        "STOPPED",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
    }
)
#: Slurm's end states that are failures of the job.
FAILED_STATES = frozenset(
    {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)
_COMMAND_TIMEOUT_S = 30.0


class SlurmError(Exception):
    """A Slurm command failed; the message says which and what it printed."""


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm says about one job.

    Attributes:
        job_id: Slurm's job id.
        state: Slurm's state name (``RUNNING``, ``CANCELLED``, ...; ``CANCELLED by 0``
            is reported as ``CANCELLED``).
        reason: Slurm's reason (``Priority``, ``NonZeroExitCode``, ``TimeLimit``, ...),
            or None when Slurm gives none.
        exit_code: The batch script's exit code, when known.
        signal: The signal number that ended the batch script, when one did.
    """

    job_id: str
    state: str
    reason: str | None = None
    exit_code: int | None = None
    signal: int | None = None


@dataclass(frozen=True)
class ServiceState:
    """A Slurm state as the service shows it: its state and the ``reason`` text."""

    state: JobState
    reason: str


def service_state(job: SlurmJob, *, cancel_requested: bool = False) -> ServiceState:
    """Map Slurm's view of a job onto the service's states.

    PENDING (and requeued) is ``queued``, RUNNING (and the other states of a job holding
    nodes) ``running``, COMPLETED ``succeeded``, CANCELLED ``cancelled``, and
    FAILED/NODE_FAIL/OUT_OF_MEMORY/TIMEOUT (and the other end states) ``failed``. A job
    whose cancellation the service requested ends ``cancelled`` however Slurm recorded
    it: the trainer exits non-zero after saving its checkpoint on SIGTERM.
    """
    tag = f"Slurm job {job.job_id}"
    why = f": {job.reason}" if job.reason and job.reason != "None" else ""
    if job.state in PENDING_STATES:
        return ServiceState(JobState.QUEUED, f"{tag} is {job.state}{why}")
    if job.state in RUNNING_STATES:
        return ServiceState(JobState.RUNNING, f"{tag} is {job.state}{why}")
    ended = f"{tag} ended {job.state}"
    if cancel_requested:
        return ServiceState(JobState.CANCELLED, f"cancelled on request ({ended})")
    if job.state == "COMPLETED":
        return ServiceState(JobState.SUCCEEDED, f"{ended} (exit code 0)")
    if job.state == "CANCELLED":
        return ServiceState(JobState.CANCELLED, f"{ended} (scancel outside the service){why}")
    detail = []
    if job.exit_code is not None:
        detail.append(f"exit code {job.exit_code}")
    if job.signal:
        detail.append(f"signal {job.signal}")
    if job.reason and job.reason != "None":
        detail.append(job.reason)
    return ServiceState(JobState.FAILED, ended + (f" ({', '.join(detail)})" if detail else ""))


def is_final(job: SlurmJob) -> bool:
    """Whether Slurm is done with the job (it no longer pends or holds nodes)."""
    return job.state not in PENDING_STATES and job.state not in RUNNING_STATES


@dataclass(frozen=True)
class BatchOptions:
    """The resources of one submission.

    Attributes:
        job_name: Slurm's job name (``--job-name``).
        nnodes: Nodes (``--nodes``); one torchrun agent per node.
        nproc_per_node: Processes torchrun starts on each node; also the CPUs asked for
            per node (``--cpus-per-task``).
        partition: ``--partition``, or the cluster's default when None.
        time_limit: ``--time`` in one of Slurm's formats, or the partition's default.
        account: ``--account``, or the user's default.
        gpus_per_node: ``--gpus-per-node`` when above 0 (Slurm picks the devices).
    """

    job_name: str
    nnodes: int
    nproc_per_node: int
    partition: str | None = None
    time_limit: str | None = None
    account: str | None = None
    gpus_per_node: int = 0


def _quoted(argv: list[str]) -> str:
    """``argv`` shell-quoted, one option (with its value) per continued line."""
    lines: list[list[str]] = []
    for a in argv:
        if lines and not a.startswith("-") and len(lines[-1]) == 1 and lines[-1][0].startswith("-"):
            lines[-1].append(a)
        else:
            lines.append([a])
    return " \\\n    ".join(" ".join(shlex.quote(a) for a in line) for line in lines)


def batch_script(
    opts: BatchOptions,
    *,
    python: str,
    job_dir: Path,
    log_file: Path,
    torchrun_opts: list[str],
    recipe: list[str],
    runner_flags: list[str] | None = None,
) -> str:
    """The ``sbatch`` script of one attempt.

    ``torchrun_opts`` are torchrun's options other than the node count and the
    rendezvous (log directory, tee); ``recipe`` is ``-m MODULE FLAGS...``. The rendezvous
    port is picked free on the first node, where the batch script runs.
    """
    directives = [
        f"--job-name={opts.job_name}",
        f"--nodes={opts.nnodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={opts.nproc_per_node}",
        f"--chdir={job_dir}",
        f"--output={log_file}",
        "--open-mode=append",
    ]
    if opts.partition:
        directives.append(f"--partition={opts.partition}")
    if opts.time_limit:
        directives.append(f"--time={opts.time_limit}")
    if opts.account:
        directives.append(f"--account={opts.account}")
    if opts.gpus_per_node > 0:
        directives.append(f"--gpus-per-node={opts.gpus_per_node}")
    for d in directives:
        if "\n" in d or "\r" in d:  # the schema's patterns already refuse these
            raise ValueError(f"a line break in an sbatch option: {d!r}")
    runner = [python, "-m", "dmuon_server.runner", "--job-dir", str(job_dir)]
    runner += [*(runner_flags or []), "--"]
    torchrun = [
        f"--nnodes={opts.nnodes}",
        f"--nproc-per-node={opts.nproc_per_node}",
        "--rdzv-backend=c10d",
    ]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {shlex.quote(d)}" for d in directives),
        "# Written by dmuon-server: one torchrun agent per node, c10d rendezvous on the",
        "# first node of the allocation (this script runs there).",
        "set -euo pipefail",
        # awk reads the whole list: `head` would end scontrol with SIGPIPE (and pipefail).
        'head_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk \'NR == 1\')"',
        f"rdzv_port=\"$({shlex.quote(python)} -c 'import socket; s = socket.socket(); "
        's.bind(("", 0)); print(s.getsockname()[1])\')"',
        "exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 \\",
        "    " + _quoted([*runner, *torchrun]) + " \\",
        '    --rdzv-endpoint="$head_node:$rdzv_port" --rdzv-id="$SLURM_JOB_ID" \\',
        "    " + _quoted([*torchrun_opts, *recipe]),
        "",
    ]
    return "\n".join(lines)


_KV = re.compile(r"(\w+)=(\S*)")


def parse_scontrol(text: str) -> SlurmJob | None:
    """A job from ``scontrol show job --oneliner ID`` output (None if it has no JobId)."""
    fields = dict(_KV.findall(text))
    if "JobId" not in fields or "JobState" not in fields:
        return None
    code, sig = _exit_code(fields.get("ExitCode"))
    reason = fields.get("Reason")
    reason = None if reason in (None, "", "None") else reason
    return SlurmJob(fields["JobId"], fields["JobState"], reason, code, sig)


def parse_sacct(text: str) -> SlurmJob | None:
    """A job from ``sacct --parsable2 --noheader -o JobID,State,ExitCode[,Reason]`` output.

    Steps (``ID.batch``, ``ID.0``) are skipped; when the id was used twice (a cluster
    whose controller state was reset), the newest record wins.
    """
    for line in reversed(text.splitlines()):
        cols = line.split("|")
        if len(cols) < 3 or "." in cols[0]:
            continue
        state = cols[1].split()[0] if cols[1].strip() else "UNKNOWN"
        code, sig = _exit_code(cols[2])
        reason = cols[3] if len(cols) > 3 and cols[3] else None
        return SlurmJob(cols[0], state, reason, code, sig)
    return None


def _exit_code(text: str | None) -> tuple[int | None, int | None]:
    """``"3:0"`` -> (3, None); ``"0:15"`` -> (0, 15)."""
    if not text or ":" not in text:
        return None, None
    code, _, sig = text.partition(":")
    try:
        return int(code), (int(sig) or None)
    except ValueError:
        return None, None


class SlurmClient:
    """Submits, follows and cancels jobs with Slurm's command-line tools."""

    def missing_commands(self) -> list[str]:
        """The Slurm commands not found on PATH."""
        return [c for c in SLURM_COMMANDS if shutil.which(c) is None]

    def _run(
        self, argv: list[str], env: dict[str, str] | None = None, account: Account | None = None
    ) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env=env,
                stdin=subprocess.DEVNULL,
                timeout=_COMMAND_TIMEOUT_S,
                check=False,
                **drop_privileges(account),
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SlurmError(f"{argv[0]} could not run: {e}") from None

    def submit(self, script: Path, env: dict[str, str], account: Account | None = None) -> str:
        """``sbatch`` the script with ``env`` as the job's environment, as ``account`` (so
        that Slurm runs the job as that account; None: the server's own); return the job
        id."""
        out = self._run(["sbatch", "--parsable", str(script)], env=env, account=account)
        if out.returncode != 0:
            msg = (out.stderr or out.stdout).strip().replace("sbatch: error: ", "")
            raise SlurmError(f"sbatch refused the job: {msg}")
        return out.stdout.strip().split(";")[0]

    def query(self, job_id: str) -> SlurmJob | None:
        """Slurm's state of ``job_id``: from the controller while it knows the job, else
        from accounting (:meth:`query_accounting`); None if nothing knows it.
        """
        return self.query_controller(job_id) or self.query_accounting(job_id)

    def query_controller(self, job_id: str) -> SlurmJob | None:
        """``scontrol show job``: pending and running jobs, and finished ones for
        ``MinJobAge`` seconds; None when the controller does not know the job."""
        out = self._run(["scontrol", "show", "job", "--oneliner", job_id])
        if out.returncode == 0:
            return parse_scontrol(out.stdout)
        if "Invalid job id" in out.stderr:
            return None
        raise SlurmError(f"scontrol show job {job_id} failed: {out.stderr.strip()}")

    def query_accounting(self, job_id: str) -> SlurmJob | None:
        """``sacct``: the accounting database (slurmdbd), or, on clusters without one,
        the job-completion record (``sacct --completion``, ``JobCompType``)."""
        base = ["sacct", "--noheader", "--parsable2", "-j", job_id]
        out = self._run([*base, "-X", "-o", "JobID,State,ExitCode,Reason"])
        if out.returncode == 0 and (job := parse_sacct(out.stdout)) is not None:
            return job
        out = self._run([*base, "--completion", "-o", "JobID,State,ExitCode"])
        return parse_sacct(out.stdout) if out.returncode == 0 else None

    def find_by_name(self, name: str) -> list[str]:
        """Ids of the pending and running jobs called ``name``, oldest first."""
        out = self._run(["squeue", "--noheader", f"--name={name}", "--format=%i"])
        if out.returncode != 0:
            raise SlurmError(f"squeue --name={name} failed: {out.stderr.strip()}")
        return sorted(out.stdout.split(), key=lambda i: (len(i), i))

    def signal_steps(self, job_id: str, signal_name: str) -> None:
        """Send a signal to the job's steps (the srun tasks: the runners and torchrun)."""
        self._run(["scancel", f"--signal={signal_name}", job_id])

    def cancel(self, job_id: str) -> None:
        """End the job now (Slurm's SIGTERM, then SIGKILL after its ``KillWait``)."""
        out = self._run(["scancel", job_id])
        if out.returncode != 0:
            raise SlurmError(f"scancel {job_id} failed: {out.stderr.strip()}")
