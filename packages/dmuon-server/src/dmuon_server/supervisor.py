"""Launching, watching and cancelling training jobs.

A job runs as ``python -m dmuon_server.runner --job-dir DIR -- <torchrun args>``: torchrun
(run in-process by the runner) in a session and process group of its own, in its working
folder ``DIR`` under the data directory, with stdout and stderr going to ``DIR/job.log`` and
not to pipes, so the job neither notices nor dies when the server stops. torchrun tees the
output of every rank into that log (``--tee 3``) and keeps one log folder per rank under
``DIR/torchrun-logs``. The runner writes ``DIR/exit.json`` when torchrun returns: the exit
code and, for a crash, the rank that failed first.

The supervisor thread, every ``poll_interval_s``:

* tails each active job's metrics file into the store (``starting`` -> ``running`` with the
  first point);
* notices jobs that ended (its own children are reaped with ``Popen.poll``; a job it
  re-attached to after a restart is recognised by pid *and* process create time, so a
  reused pid is never mistaken for the job), and records ``succeeded``/``failed``/
  ``cancelled`` from the exit report, after a final read of the metrics file;
* escalates cancellations: SIGTERM to every process of the job at once, SIGKILL to what is
  left after ``cancel_grace_s``;
* starts queued jobs in FIFO order while fewer than ``max_concurrent_jobs`` are active.

"Every process of the job" is the runner, all its descendants, and every process carrying
``DMUON_SERVER_JOB=<id>`` in its environment: torchrun starts each worker in a session of
its own, so a process-group signal alone would miss them, and a worker orphaned by a killed
torchrun is no longer a descendant of anything the server knows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from dmuon_server.config import DATA_DIR_ENV_MARKER, JOB_ENV_MARKER, Settings, usable_cpus
from dmuon_server.metrics import Hub, MetricsTailer
from dmuon_server.runner import EXIT_FILE
from dmuon_server.schemas import ACTIVE_STATES, JobCreate, LaunchPlan
from dmuon_server.store import Store

log = logging.getLogger("dmuon_server.supervisor")

METRICS_FILE = "metrics.jsonl"
LOG_FILE = "job.log"
TORCHRUN_LOG_DIR = "torchrun-logs"
#: Tolerance when comparing a process's create time with the recorded one.
_CREATE_TIME_TOLERANCE_S = 0.05
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
    }
)


class DataPathError(ValueError):
    """A ``train.data`` path that does not exist or lies outside the data roots."""


def resolve_data_path(settings: Settings, data: str) -> Path:
    """Resolve ``data`` (symlinks and ``..``) and check that it lies in a data root."""
    if "\x00" in data:
        raise DataPathError("the path contains a NUL character")
    resolved = Path(os.path.realpath(data))
    roots = settings.data_roots or ()
    if not any(resolved == root or resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise DataPathError(
            f"{resolved} is outside the allowed data roots ({allowed}); put the data under "
            "one of them or start the server with --data-root"
        )
    if not resolved.exists():
        raise DataPathError(f"{resolved} does not exist")
    return resolved


def _fmt_float(x: float) -> str:
    return repr(float(x))


def build_plan(settings: Settings, spec: JobCreate, job_dir: Path, queued_ahead: int) -> LaunchPlan:
    """Return the exact command, environment and batch arithmetic of a job.

    ``spec.train.data`` must have been checked with :func:`resolve_data_path`.
    """
    t = spec.train
    n = spec.nproc_per_node
    recipe = [
        "-m",
        settings.train_module,
        "--model",
        t.model,
        "--steps",
        str(t.steps),
        "--micro-batch-size",
        str(t.micro_batch_size),
        "--accum-steps",
        str(t.accum_steps),
        "--seq-len",
        str(t.seq_len),
        "--lr",
        _fmt_float(t.lr),
        "--adamw-lr",
        _fmt_float(t.adamw_lr),
        "--optimizer",
        t.optimizer,
        "--mode",
        t.mode,
        "--seed",
        str(t.seed),
    ]
    if t.warmup_steps is not None:
        recipe += ["--warmup-steps", str(t.warmup_steps)]
    if t.eval_every is not None:
        recipe += ["--eval-every", str(t.eval_every)]
    recipe += ["--metrics-file", str(job_dir / METRICS_FILE)]
    if t.data is not None:
        recipe += ["--data", str(resolve_data_path(settings, t.data))]
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
    cpus = usable_cpus()
    env = launch_env(settings, job_dir.name, n)
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
    if queued_ahead:
        warnings.append(f"{queued_ahead} job(s) are queued or running ahead of this one")
    seqs = t.micro_batch_size * t.accum_steps * n
    return LaunchPlan(
        argv=argv,
        torchrun_argv=torchrun_argv,
        env=env,
        world_size=n,
        global_batch_sequences=seqs,
        global_batch_tokens=seqs * t.seq_len,
        total_tokens=seqs * t.seq_len * t.steps,
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


def job_env(plan_env: dict[str, str]) -> dict[str, str]:
    """The server's environment, scrubbed of torchrun/rank variables, plus ``plan_env``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _SCRUBBED_VARS and not k.startswith(_SCRUBBED_PREFIXES)
    }
    env.update(plan_env)
    return env


def _verified_process(pid: int | None, create_time: float | None) -> psutil.Process | None:
    """The live (non-zombie) process ``pid`` if it is the one created at ``create_time``."""
    if pid is None or create_time is None:
        return None
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - create_time) > _CREATE_TIME_TOLERANCE_S:
            return None
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def find_job_processes(job_id: str, root: psutil.Process | None = None) -> list[psutil.Process]:
    """Every live process of a job: ``root``, its descendants and env-marked processes."""
    found: dict[int, psutil.Process] = {}
    if root is not None:
        with contextlib.suppress(psutil.Error):
            found[root.pid] = root
            for child in root.children(recursive=True):
                found[child.pid] = child
    me = os.getpid()
    for p in psutil.process_iter():
        if p.pid in found or p.pid == me:
            continue
        try:
            if p.environ().get(JOB_ENV_MARKER) == job_id:
                found[p.pid] = p
        except (psutil.Error, OSError):
            continue
    alive = []
    for p in found.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            continue
    return alive


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def _signal_job(job: dict[str, Any], root: psutil.Process | None, sig: int) -> int:
    """Signal every process of the job, then its process group.

    The ranks go first and torchrun (the runner, the group leader) last: a torchrun that
    is signalled while its ranks still live shuts them down itself, which takes it seconds;
    with the ranks already gone it exits in a fraction of one. The group is signalled
    only while its leader is verified to be the recorded process (pid and create time),
    so a reused pgid is never hit. Returns how many processes were signalled.
    """
    procs = find_job_processes(job["id"], root)
    leader = [p for p in procs if root is not None and p.pid == root.pid]
    _signal_all([p for p in procs if p not in leader], sig)
    _signal_all(leader, sig)
    if root is not None and job["pgid"] is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(int(job["pgid"]), sig)
    return len(procs)


def tail_lines(path: Path, n: int, max_bytes: int = 1 << 20) -> tuple[list[str], bool]:
    """Return the last ``n`` lines of a text file (reading at most ``max_bytes``).

    The second value tells whether the file has more lines than returned.
    """
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            start = max(0, size - max_bytes)
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        return [], False
    lines = data.decode("utf-8", "replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first line is probably cut
    truncated = start > 0 or len(lines) > n
    return lines[-n:] if n else [], truncated


class Supervisor:
    """Owns the job processes: FIFO dispatch, watching, cancellation, restart recovery."""

    def __init__(self, settings: Settings, store: Store, hub: Hub, tailer: MetricsTailer) -> None:
        """Create a supervisor; :meth:`start` runs it."""
        self.settings = settings
        self.store = store
        self.hub = hub
        self.tailer = tailer
        self._lock = threading.RLock()
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._cancel_deadline: dict[str, float] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.launched_total = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Re-attach to jobs of a previous server and start the supervisor thread.

        Does nothing when the thread is already running.
        """
        if self._thread is not None and self._thread.is_alive():
            return
        self.settings.jobs_dir.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._recover()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="dmuon-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the supervisor thread. Running jobs are left running, on purpose."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def wake(self) -> None:
        """Ask the supervisor thread to look at the jobs now."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # keep supervising whatever one job did
                log.exception("supervisor tick failed")
            self._wake.wait(self.settings.poll_interval_s)
            self._wake.clear()

    def tick(self) -> None:
        """One round: watch active jobs, then start queued ones."""
        with self._lock:
            for job in self.store.jobs_in_states(ACTIVE_STATES):
                self._watch(job)
            self._dispatch()

    # ------------------------------------------------------------------- recovery

    def _recover(self) -> None:
        for job in self.store.jobs_in_states(ACTIVE_STATES):
            job_id = job["id"]
            if job["pid"] is None:
                # The previous server stopped between marking the job and recording its pid.
                procs = [
                    p
                    for p in find_job_processes(job_id)
                    if "dmuon_server.runner" in " ".join(_cmdline(p))
                ]
                if procs:
                    p = procs[0]
                    self.store.update_job(
                        job_id, pid=p.pid, pgid=os.getpgid(p.pid), create_time=p.create_time()
                    )
                    log.info("job %s: adopted runner pid %d", job_id, p.pid)
                else:
                    _signal_all(find_job_processes(job_id), signal.SIGKILL)
                    self.store.transition(
                        job_id,
                        "failed",
                        "the server stopped while launching the job; submit it again",
                        from_states=ACTIVE_STATES,
                    )
                continue
            proc = _verified_process(job["pid"], job["create_time"])
            if proc is not None:
                log.info("job %s: re-attached to pid %d", job_id, job["pid"])
                if job["cancel_requested_at"] is not None:
                    self._cancel_deadline[job_id] = (
                        job["cancel_requested_at"] + self.settings.cancel_grace_s
                    )
                    _signal_job(job, proc, signal.SIGTERM)
            # Jobs whose processes vanished are finalised by the first tick.

    # ------------------------------------------------------------------- dispatch

    def _dispatch(self) -> None:
        active = len(self.store.jobs_in_states(ACTIVE_STATES))
        free = self.settings.max_concurrent_jobs - active
        if free <= 0:
            return
        for job in self.store.jobs_in_states(["queued"])[:free]:
            self._launch(job)

    def _launch(self, job: dict[str, Any]) -> None:
        job_id = job["id"]
        job_dir = self.settings.job_dir(job_id)
        argv: list[str] = json.loads(job["argv"])
        plan_env = launch_env(self.settings, job_id, int(job["nproc"]))
        # Mark the job before spawning: a server that dies in between finds the job by its
        # environment marker on restart instead of launching it a second time.
        if not self.store.transition(
            job_id, "starting", "launching torchrun", from_states=["queued"]
        ):
            return
        try:
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / "spec.json").write_text(job["spec"])
            with (job_dir / LOG_FILE).open("ab") as logf:
                proc = subprocess.Popen(
                    argv,
                    cwd=job_dir,
                    env=job_env(plan_env),
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    close_fds=True,
                )
        except OSError as e:
            self.store.transition(job_id, "failed", f"could not start the job: {e}")
            self.hub.notify(job_id)
            return
        self._children[job_id] = proc
        try:
            create_time = psutil.Process(proc.pid).create_time()
        except psutil.Error:
            create_time = time.time()
        self.store.update_job(job_id, pid=proc.pid, pgid=proc.pid, create_time=create_time)
        self.launched_total += 1
        log.info("job %s: started pid %d", job_id, proc.pid)
        self.hub.notify(job_id)

    # ---------------------------------------------------------------------- watch

    def _watch(self, job: dict[str, Any]) -> None:
        job_id = job["id"]
        job_dir = self.settings.job_dir(job_id)
        metrics_path = job_dir / METRICS_FILE
        if job["pid"] is None:
            return  # being launched by this very thread, or adopted in _recover
        self.tailer.poll(job_id, metrics_path)
        if (
            job["state"] == "starting"
            and metrics_path.exists()
            and self.store.transition(
                job_id, "running", "the recipe is writing metrics", from_states=["starting"]
            )
        ):
            self.hub.notify(job_id)
        child = self._children.get(job_id)
        if child is not None:
            ended = child.poll() is not None
        else:
            ended = _verified_process(job["pid"], job["create_time"]) is None
        if not ended:
            deadline = self._cancel_deadline.get(job_id)
            if deadline is not None and time.time() >= deadline:
                root = _verified_process(job["pid"], job["create_time"])
                n = _signal_job(job, root, signal.SIGKILL)
                log.warning("job %s: grace period over, SIGKILL to %d process(es)", job_id, n)
                self._cancel_deadline[job_id] = float("inf")
            return
        self._finalize(job)

    def _finalize(self, job: dict[str, Any]) -> None:
        job_id = job["id"]
        job_dir = self.settings.job_dir(job_id)
        self.tailer.poll(job_id, job_dir / METRICS_FILE, final=True)
        # Whatever survived the runner is an orphan: end it (and wait for it) now.
        leftovers = find_job_processes(job_id)
        if leftovers:
            log.warning("job %s: killing %d leftover process(es)", job_id, len(leftovers))
            _signal_all(leftovers, signal.SIGKILL)
            psutil.wait_procs(leftovers, timeout=5)
        child = self._children.pop(job_id, None)
        child_rc = child.returncode if child is not None else None
        self._cancel_deadline.pop(job_id, None)
        report = _read_exit_report(job_dir / EXIT_FILE)
        fresh = self.store.get_job(job_id) or job
        cancel = fresh["cancel_requested_at"] is not None
        rc = report.get("returncode") if report else child_rc
        failure = None
        if cancel:
            state, reason = "cancelled", "cancelled on request"
        elif report and rc == 0:
            state, reason = "succeeded", "torchrun exited with code 0"
        else:
            state = "failed"
            failure = self._failure(job_dir, report, child_rc)
            reason = failure.pop("reason")
            rc = failure["exit_code"]
        changed = self.store.transition(
            job_id,
            state,
            reason,
            from_states=ACTIVE_STATES,
            exit_code=rc,
            failure=json.dumps(failure) if failure else None,
        )
        if changed:
            log.info("job %s: %s (%s)", job_id, state, reason)
        self.hub.notify(job_id)

    def _failure(
        self, job_dir: Path, report: dict[str, Any] | None, child_rc: int | None
    ) -> dict[str, Any]:
        n = self.settings.log_tail_lines
        if report is None:
            if child_rc is not None and child_rc < 0:
                why = f"the job's launcher was killed by {_sig_name(-child_rc)}"
            elif child_rc is not None:
                why = f"the job's launcher exited with code {child_rc} without an exit report"
            else:
                why = "the job's processes vanished while the server was down (no exit report)"
            lines, _ = tail_lines(job_dir / LOG_FILE, n)
            return {
                "reason": why,
                "rank": None,
                "exit_code": child_rc,
                "signal": _sig_name(-child_rc) if child_rc is not None and child_rc < 0 else None,
                "message": why,
                "log_file": str(job_dir / LOG_FILE),
                "log_tail": lines,
            }
        first = report.get("first_failure")
        if first:
            rank = first.get("rank")
            code = first.get("exitcode")
            sig = first.get("signal")
            what = f"killed by {sig}" if sig else f"exited with code {code}"
            log_file, lines = _rank_log_tail(job_dir, first, n)
            return {
                "reason": f"rank {rank} {what}",
                "rank": rank,
                "exit_code": code,
                "signal": sig,
                "message": first.get("message") or None,
                "log_file": log_file,
                "log_tail": lines,
            }
        rc = report.get("returncode")
        sig = report.get("signal")
        err = report.get("error")
        why = (
            f"torchrun received {sig}"
            if sig
            else (f"torchrun failed: {err}" if err else f"torchrun exited with code {rc}")
        )
        lines, _ = tail_lines(job_dir / LOG_FILE, n)
        return {
            "reason": why,
            "rank": None,
            "exit_code": rc,
            "signal": sig,
            "message": err,
            "log_file": str(job_dir / LOG_FILE),
            "log_tail": lines,
        }

    # --------------------------------------------------------------------- cancel

    def cancel(self, job_id: str) -> dict[str, Any] | None:
        """Request cancellation; SIGTERM goes out at once, SIGKILL after the grace period.

        Returns the job row after the request (None for an unknown job). Idempotent.
        """
        with self._lock:
            job = self.store.get_job(job_id)
            if job is None or job["state"] in ("succeeded", "failed", "cancelled"):
                return job
            job = self.store.request_cancel(job_id)
            assert job is not None
            if job["state"] == "queued":
                self.store.transition(
                    job_id, "cancelled", "cancelled while queued", from_states=["queued"]
                )
            elif job_id not in self._cancel_deadline:
                self._cancel_deadline[job_id] = time.time() + self.settings.cancel_grace_s
                root = _verified_process(job["pid"], job["create_time"])
                n = _signal_job(job, root, signal.SIGTERM)
                log.info("job %s: SIGTERM to %d process(es)", job_id, n)
            self.hub.notify(job_id)
        self.wake()
        return self.store.get_job(job_id)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _sig_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _read_exit_report(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _rank_log_tail(job_dir: Path, failure: dict[str, Any], n: int) -> tuple[str | None, list[str]]:
    """The last lines a failed rank wrote (its stderr, else its stdout)."""
    rank_dir: Path | None = None
    if failure.get("log_dir"):
        rank_dir = Path(failure["log_dir"])
    else:
        local = failure.get("local_rank", failure.get("rank"))
        candidates = sorted(
            (job_dir / TORCHRUN_LOG_DIR).glob(f"*/attempt_*/{local}"),
            key=lambda p: p.stat().st_mtime,
        )
        rank_dir = candidates[-1] if candidates else None
    if rank_dir is None:
        lines, _ = tail_lines(job_dir / LOG_FILE, n)
        return str(job_dir / LOG_FILE), lines
    for name in ("stderr.log", "stdout.log"):
        lines, _ = tail_lines(rank_dir / name, n)
        if any(line.strip() for line in lines):
            return str(rank_dir / name), lines
    return str(rank_dir / "stderr.log"), []
