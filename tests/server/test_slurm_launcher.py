"""The Slurm backend without a cluster: the state mapping, the generated batch script
(run by bash against stand-ins for ``srun``/``scontrol`` that record their argv), the
parsing of Slurm's outputs, and the spec checks of each launcher."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from server_helpers import job_spec, make_settings

from dmuon_server.launching.command import plan_view, program_of
from dmuon_server.launching.slurm import (
    BatchOptions,
    SlurmJob,
    batch_script,
    is_final,
    parse_sacct,
    parse_scontrol,
    service_state,
)
from dmuon_server.launching.slurm_jobs import write_batch_script
from dmuon_server.recipe.review import review
from dmuon_server.schemas import JobCreate

# The table of the job-service documentation, written out independently of the code.
MAPPING = [
    ("PENDING", "Priority", "queued"),
    ("RUNNING", None, "running"),
    ("COMPLETING", None, "running"),
    ("COMPLETED", None, "succeeded"),
    ("FAILED", "NonZeroExitCode", "failed"),
    ("NODE_FAIL", None, "failed"),
    ("OUT_OF_MEMORY", "OutOfMemory", "failed"),
    ("TIMEOUT", "TimeLimit", "failed"),
    ("CANCELLED", None, "cancelled"),
]


@pytest.mark.parametrize(("slurm", "why", "expected"), MAPPING)
def test_slurm_states_map_onto_the_services(slurm: str, why: str | None, expected: str) -> None:
    job = SlurmJob("42", slurm, why, 3 if expected == "failed" else 0)
    mapped = service_state(job)
    assert mapped.state == expected
    assert "Slurm job 42" in mapped.reason and slurm in mapped.reason
    if why is not None:
        assert why in mapped.reason  # the Slurm reason is shown
    assert is_final(job) == (expected not in ("queued", "running"))
    if expected == "failed":
        assert "exit code 3" in mapped.reason


@pytest.mark.parametrize("slurm", ["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"])
def test_a_requested_cancel_ends_cancelled_however_slurm_recorded_it(slurm: str) -> None:
    mapped = service_state(SlurmJob("7", slurm, None, 0), cancel_requested=True)
    assert mapped.state == "cancelled" and f"ended {slurm}" in mapped.reason


def test_slurm_outputs_are_parsed() -> None:
    one = (
        "JobId=12 JobName=dmuon-x UserId=root(0) JobState=FAILED Reason=NonZeroExitCode "
        "Dependency=(null) ExitCode=3:0 RunTime=00:00:04"
    )
    assert parse_scontrol(one) == SlurmJob("12", "FAILED", "NonZeroExitCode", 3, None)
    assert parse_scontrol("JobId=5 JobState=RUNNING Reason=None ExitCode=0:0") == SlurmJob(
        "5", "RUNNING", None, 0, None
    )
    assert parse_scontrol("slurm_load_jobs error: Invalid job id specified") is None
    acct = "12|FAILED|3:0|\n12.batch|FAILED|3:0|\n12.0|FAILED|3:0|\n"
    assert parse_sacct(acct) == SlurmJob("12", "FAILED", None, 3, None)
    # sacct writes "CANCELLED by 0"; a reused id: the newest record wins.
    assert parse_sacct("9|COMPLETED|0:0\n9|CANCELLED by 0|0:15\n") == SlurmJob(
        "9", "CANCELLED", None, 0, 15
    )
    assert parse_sacct("") is None


def _recorder(path: Path, name: str, body: str) -> None:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_the_batch_script_runs_the_runner_under_srun_with_exact_arguments(
    tmp_path: Path,
) -> None:
    """bash runs the script with ``srun`` and ``scontrol`` replaced by recorders: every
    argument arrives unchanged, odd characters included, and the #SBATCH lines carry the
    resources."""
    job_dir = tmp_path / "data dir with 'quotes' $HOME" / "jobs" / "abc"
    job_dir.mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    out = tmp_path / "srun.json"
    _recorder(
        bin_dir / "srun",
        "srun",
        f"import json, sys\njson.dump(sys.argv[1:], open({str(out)!r}, 'w'))\n",
    )
    _recorder(bin_dir / "scontrol", "scontrol", "print('node-a')\nprint('node-b')\n")
    recipe = ["-m", "dmuon.train", "--lr", "0.02", "--metrics-file", str(job_dir / "m.jsonl")]
    opts = BatchOptions("dmuon-abc", 2, 3, partition="gpu", time_limit="1-02:00", account="ml")
    text = batch_script(
        opts,
        python=sys.executable,
        job_dir=job_dir,
        log_file=job_dir / "job.log",
        torchrun_opts=["--tee", "3"],
        recipe=recipe,
        runner_flags=["--ignore-sigterm"],
    )
    script = job_dir / "job.sh"
    script.write_text(text)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.update(SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_ID="77")
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=60)
    argv = json.loads(out.read_text())
    rdzv = [a for a in argv if a.startswith("--rdzv-endpoint=")]
    assert len(rdzv) == 1 and rdzv[0].startswith("--rdzv-endpoint=node-a:")
    assert 0 < int(rdzv[0].rsplit(":", 1)[1]) < 65536
    argv.remove(rdzv[0])
    assert argv == [
        "--kill-on-bad-exit=1",
        "--ntasks-per-node=1",
        sys.executable, "-m", "dmuon_server.runner", "--job-dir", str(job_dir),
        "--ignore-sigterm", "--",
        "--nnodes=2", "--nproc-per-node=3", "--rdzv-backend=c10d", "--rdzv-id=77",
        "--tee", "3", *recipe,
    ]  # fmt: skip
    directives = [
        line[len("#SBATCH ") :] for line in text.splitlines() if line.startswith("#SBATCH")
    ]
    for d in ("--job-name=dmuon-abc", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=3",
              "--partition=gpu", "--time=1-02:00", "--account=ml"):  # fmt: skip
        assert d in directives
    parsed = {}
    for d in directives:  # as a shell reads them
        word = subprocess.run(
            ["bash", "-c", f"printf '%s' {d}"], capture_output=True, text=True, check=True
        ).stdout
        key, _, value = word.partition("=")
        parsed[key] = value
    assert parsed["--output"] == str(job_dir / "job.log")
    assert parsed["--chdir"] == str(job_dir)


def test_the_job_script_comes_from_the_stored_command(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, launcher="slurm")
    argv = [sys.executable, "-m", "dmuon_server.runner", "--job-dir", "/j", "--", "--standalone",
            "--nproc_per_node", "2", "--tee", "3", "--log-dir", "/j/logs", "-m", "fake_train",
            "--steps", "5"]  # fmt: skip
    recipe = program_of(argv)
    assert recipe == ["-m", "fake_train", "--steps", "5"]
    script = [*argv[: argv.index("-m", 6)], "/code/train.py", "-m", "x", "--lr", "1"]
    assert program_of(script) == ["/code/train.py", "-m", "x", "--lr", "1"]
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    spec = JobCreate.model_validate({**job_spec(2), "nnodes": 1})
    text = write_batch_script(settings, spec, job_dir, 2, recipe).read_text()
    assert "--standalone" not in text  # the nodes meet through c10d rendezvous instead
    assert "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT" in text
    assert (job_dir / "slurm-attempt-2.sh").is_file()
    assert "--gpus-per-node" not in text  # none asked for
    with_gpus = JobCreate.model_validate({**job_spec(2), "gpus_per_node": 2})
    text = write_batch_script(settings, with_gpus, job_dir, 3, script[-5:]).read_text()
    assert "#SBATCH --gpus-per-node=2" in text  # the spec's count: Slurm picks the devices
    assert "/code/train.py \\\n    -m x \\\n    --lr 1\n" in text  # one argv entry each


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("time_limit", "1:2:3:4"),
        ("time_limit", "ten minutes"),
        ("partition", "gpu\n#SBATCH --wrap=x"),
        ("account", "a b"),
        ("nnodes", 0),
    ],
)
def test_invalid_slurm_fields_are_refused_by_the_schema(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as e:
        JobCreate.model_validate({**job_spec(1), field: value})
    assert e.value.errors()[0]["loc"] == (field,)


def _refusal(settings_launcher: str, tmp_path: Path, **spec: object) -> dict[str, str]:
    settings = make_settings(tmp_path, launcher=settings_launcher)
    found = review(settings, JobCreate.model_validate({**job_spec(1), **spec}))
    assert not found.accepted
    return {err.field: err.message for err in found.errors}


def test_each_launcher_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    local = _refusal("local", tmp_path, nnodes=2, partition="debug", time_limit="10")
    assert "--launcher slurm" in local["body.nnodes"] and "nnodes=1" in local["body.nnodes"]
    assert "Slurm option" in local["body.partition"] and "body.time_limit" in local
    slurm = _refusal("slurm", tmp_path, max_restarts=2)
    assert "resume" in slurm["body.max_restarts"]
    ok = make_settings(tmp_path, launcher="slurm")
    spec = JobCreate.model_validate({**job_spec(1), "nnodes": 2, "partition": "debug"})
    plan = plan_view(ok, review(ok, spec), 0)
    assert plan.world_size == 2 and any("sbatch" in w for w in plan.warnings)


def _store_with(tmp_path: Path, **launched: str) -> tuple[Path, dict[str, str]]:
    """A data directory whose store holds one job per entry of ``launched``:
    ``name=slurm`` (running in Slurm), ``name=local`` (running on the host) or
    ``name=queued`` (waiting in the service's queue). Returns the settings' data dir and
    the job ids by name."""
    from dmuon_server.storage.store import Store

    settings = make_settings(tmp_path)
    settings.jobs_dir.mkdir(parents=True)
    store = Store(settings.db_path)
    ids = {}
    for name, how in launched.items():
        job, _ = store.create_job(
            job_id=f"job-{name}",
            name=name,
            nproc=1,
            spec="{}",
            spec_hash=name,
            idempotency_key=None,
            argv=[],
        )
        ids[name] = job.id
        if how == "queued":
            continue
        store.transition(job.id, "running", "started")
        if how == "slurm":
            number = store.start_attempt(job.id, "submitted", None)
            store.set_attempt_slurm_job(job.id, number, "4242")
        else:
            store.update_job(job.id, pid=os.getpid(), create_time=0.0)
    store.close()
    return settings.data_dir, ids


def test_a_data_dir_with_slurm_jobs_is_not_reopened_by_the_local_launcher(
    tmp_path: Path,
) -> None:
    from dmuon_server.app import create_app
    from dmuon_server.storage.datadir import StartupError
    from dmuon_server.storage.store import Store

    data_dir, ids = _store_with(tmp_path, a="slurm", b="queued", c="slurm")
    settings = make_settings(tmp_path, data_dir=data_dir, launcher="local")
    with pytest.raises(StartupError) as err:
        create_app(settings)
    message = str(err.value)
    assert message.startswith("2 job(s)") and "--launcher slurm" in message
    assert ids["a"] in message and ids["c"] in message and ids["b"] not in message
    # Nothing was changed: the Slurm jobs still run as far as the store knows.
    store = Store(settings.db_path)
    assert [j.state for j in store.jobs_in_states(["running"])] == ["running"] * 2
    store.close()
    # A queue of never-launched jobs opens under either launcher.
    data_dir, _ = _store_with(tmp_path / "queue", q="queued")
    create_app(make_settings(tmp_path / "queue", data_dir=data_dir, launcher="local"))


def test_local_jobs_block_the_slurm_launcher(tmp_path: Path) -> None:
    from dmuon_server.launching.handover import check_launcher_matches
    from dmuon_server.storage.datadir import StartupError
    from dmuon_server.storage.store import Store

    data_dir, ids = _store_with(tmp_path, here="local", waiting="queued")
    store = Store(make_settings(tmp_path, data_dir=data_dir).db_path)
    check_launcher_matches(store, "local")
    with pytest.raises(StartupError, match=f"--launcher local .*{ids['here']}"):
        check_launcher_matches(store, "slurm")
    store.close()
