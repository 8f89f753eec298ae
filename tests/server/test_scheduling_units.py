"""The small modules of scheduling on their own: the GPU allocator, the queue policy and the
users file, each against cases written out by hand."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_server.scheduling import gpus, queue_policy
from dmuon_server.scheduling.queue_policy import Place, Waiting
from dmuon_server.storage.states import JobState
from dmuon_server.users import TOKEN_USER, User, Users, UsersFileError

# ----------------------------------------------------------------------------- GPUs


def test_gpu_lists_and_their_mistakes() -> None:
    assert gpus.parse("0,1,2,3") == (0, 1, 2, 3)
    assert gpus.parse(" 3, 1 ") == (3, 1)
    assert gpus.parse("none") == ()
    for bad in ("0,,1", "a", "0,0", "-1", "0;1"):
        with pytest.raises(gpus.GpuSpecError):
            gpus.parse(bad)


def test_auto_without_a_driver_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert gpus.parse("auto") == ()


def test_the_allocator_takes_the_lowest_free_devices() -> None:
    assert gpus.allocate((0, 1, 2, 3), busy=[1], count=2) == [0, 2]
    assert gpus.allocate((0, 1, 2, 3), busy=[0, 1, 2], count=2) is None
    assert gpus.allocate((0, 1), busy=[0, 1], count=0) == []
    from dmuon_server.launching.command import visible_devices

    assert visible_devices([2, 3]) == "2,3" and visible_devices([]) == ""


@settings(max_examples=200, deadline=None)
@given(
    needs=st.lists(st.integers(0, 4), max_size=12),
    busy=st.sets(st.integers(0, 7), max_size=8),
    capacity=st.one_of(st.none(), st.integers(1, 6)),
)
def test_the_plan_never_gives_a_device_twice_and_keeps_the_order(
    needs: list[int], busy: set[int], capacity: int | None
) -> None:
    devices = tuple(range(8))
    queue = [Waiting(f"j{i}", n) for i, n in enumerate(needs)]
    plan = queue_policy.plan(
        queue, devices=devices, busy=sorted(busy), running=0, capacity=capacity
    )
    given_out = [d for _, got in plan.starts for d in got]
    assert len(given_out) == len(set(given_out)) and not set(given_out) & busy
    started = [job_id for job_id, _ in plan.starts]
    assert started == [w.job_id for w in queue[: len(started)]]  # a prefix: no backfill
    assert all(len(got) == needs[int(j[1:])] for j, got in plan.starts)
    if capacity is not None:
        assert len(started) <= capacity
    assert [plan.places[w.job_id].position for w in queue] == list(range(1, len(queue) + 1))


# ------------------------------------------------------------------------ the queue


def test_reasons_name_the_gpus_the_free_ones_and_the_jobs_ahead() -> None:
    queue = [Waiting("big", 4), Waiting("small", 1), Waiting("cpu", 0)]
    plan = queue_policy.plan(queue, devices=(0, 1, 2, 3), busy=[0, 1], running=1, capacity=4)
    assert plan.starts == []  # the small one would fit, but waits behind the big one
    assert plan.places == {
        "big": Place(1, "waiting for 4 GPUs: 2 free"),
        "small": Place(2, "1 job ahead"),
        "cpu": Place(3, "2 jobs ahead"),
    }
    full = queue_policy.plan(
        [Waiting("a", 2), Waiting("b", 0)], devices=(0, 1), running=1, capacity=1
    )
    assert full.places["a"] == Place(1, "1 of 1 running (--max-concurrent-jobs)")
    assert full.places["b"] == Place(2, "1 of 1 running (--max-concurrent-jobs), 1 job ahead")
    too_big = queue_policy.plan([Waiting("huge", 8)], devices=(0, 1, 2, 3))
    assert "more than this server has (4, --gpus)" in too_big.places["huge"].reason


def test_what_fits_starts_in_order_until_the_head_waits() -> None:
    queue = [Waiting("a", 2), Waiting("b", 2), Waiting("c", 1), Waiting("d", 0)]
    plan = queue_policy.plan(queue, devices=(0, 1, 2, 3), busy=[3], capacity=None)
    assert plan.starts == [("a", [0, 1])]
    assert plan.places["a"] == Place(1, "next to start")
    assert plan.places["b"] == Place(2, "waiting for 2 GPUs: 1 free")
    assert plan.places["c"] == Place(3, "1 job ahead")
    cpu_only = queue_policy.plan([Waiting("x"), Waiting("y"), Waiting("z")], capacity=2)
    assert [j for j, _ in cpu_only.starts] == ["x", "y"]
    assert cpu_only.places["z"] == Place(3, "2 of 2 running (--max-concurrent-jobs)")


# ---------------------------------------------------------------------------- users


def _write(path: Path, users: list[dict], mode: int = 0o600) -> Path:
    path.write_text(json.dumps({"users": users}))
    os.chmod(path, mode)
    return path


def _h(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_users_are_found_by_their_tokens_hash(tmp_path: Path) -> None:
    f = _write(
        tmp_path / "users.json",
        [
            {"name": "ada", "token_sha256": _h("t-ada")},
            {"name": "root", "token_sha256": _h("t-r"), "admin": True},
        ],
    )
    users = Users(f, token="t-token")
    assert users.authenticate("t-ada") == User("ada", admin=False)
    assert users.authenticate("t-r") == User("root", admin=True)
    assert users.authenticate("t-token") == User(TOKEN_USER, admin=True)
    assert users.authenticate("t-ad") is None and users.authenticate("") is None
    assert [u.name for u in users.all()] == ["ada", "root", TOKEN_USER]
    assert Users(None, None).enabled is False and users.enabled


@pytest.mark.parametrize(
    ("entries", "mode", "why"),
    [
        ([{"name": "ada", "token_sha256": _h("x")}], 0o644, "chmod 600"),
        ([{"name": "ada", "token_sha256": _h("x")}], 0o620, "chmod 600"),
        ([{"name": "ada", "token_sha256": "t-ada"}], 0o600, "never the token itself"),
        ([{"name": "a b", "token_sha256": _h("x")}], 0o600, "letters, digits"),
        ([{"name": "ada", "token_sha256": _h("x"), "admin": "yes"}], 0o600, "true or false"),
        ([{"name": "ada", "token_sha256": _h("x"), "role": 1}], 0o600, "give name"),
        (
            [{"name": "ada", "token_sha256": _h("x")}, {"name": "ada", "token_sha256": _h("y")}],
            0o600,
            "given twice",
        ),
        (
            [{"name": "ada", "token_sha256": _h("x")}, {"name": "bob", "token_sha256": _h("x")}],
            0o600,
            "the same token",
        ),
        (
            [{"name": "ada", "token_sha256": _h("x"), "limits": {"disk_gib": "50"}}],
            0o600,
            "disk_gib must be a number",
        ),
        (
            [{"name": "ada", "token_sha256": _h("x"), "limits": {"disk_gib": 0}}],
            0o600,
            "from 0.01",
        ),
        (
            [{"name": "ada", "token_sha256": _h("x"), "limits": {"disk_gb": 5}}],
            0o600,
            "the GiB ones",
        ),
        (
            [{"name": "ada", "token_sha256": _h("x"), "limits": {"memory_gib": True}}],
            0o600,
            "memory_gib must be a number",
        ),
    ],
)
def test_a_bad_users_file_is_refused_naming_why(
    tmp_path: Path, entries: list[dict], mode: int, why: str
) -> None:
    with pytest.raises(UsersFileError, match=why):
        Users(_write(tmp_path / "users.json", entries, mode))


def test_a_disk_quota_is_a_limit_like_the_others(tmp_path: Path) -> None:
    entries = [
        {"name": "ada", "token_sha256": _h("t-ada"), "limits": {"disk_gib": 2.5}},
        {"name": "bob", "token_sha256": _h("t-bob")},
        {"name": "root", "token_sha256": _h("t-r"), "admin": True},
    ]
    f = tmp_path / "users.json"
    f.write_text(json.dumps({"users": entries, "default_limits": {"disk_gib": 40}}))
    f.chmod(0o600)
    users = Users(f)
    assert users.limits_of("ada").disk_gib == 2.5
    assert users.limits_of("bob").disk_gib == 40
    assert users.limits_of("root").disk_gib is None


def test_a_users_memory_per_job_is_the_smaller_of_theirs_and_the_servers() -> None:
    from dmuon_server.users import Limits

    server = 4 * 2**30
    assert Limits().job_memory(server) == (server, "--max-job-memory")
    assert Limits(memory_gib=8).job_memory(server) == (server, "--max-job-memory")
    assert Limits(memory_gib=1.5).job_memory(server) == (
        int(1.5 * 2**30),
        "memory_gib in the users file",
    )


def test_a_reload_keeps_the_old_users_when_the_new_file_is_bad(tmp_path: Path) -> None:
    f = _write(tmp_path / "users.json", [{"name": "ada", "token_sha256": _h("t-ada")}])
    users = Users(f)
    _write(
        f,
        [
            {"name": "ada", "token_sha256": _h("t-ada")},
            {"name": "bob", "token_sha256": _h("t-bob")},
        ],
    )
    assert users.reload() is None and users.authenticate("t-bob") == User("bob")
    f.write_text("{not json")
    assert "not JSON" in (users.reload() or "")
    assert users.authenticate("t-bob") == User("bob")  # the users loaded before stay
    with pytest.raises(UsersFileError, match="called 'admin'"):
        Users(_write(f, [{"name": "admin", "token_sha256": _h("z")}]), token="t")


# ------------------------------------------------------- the supervisor over a Slurm-like launcher


class _SubmittingLauncher:
    """Stands for Slurm's launcher: starting a job submits it (it stays ``queued``, no
    longer waiting in the service's queue, with no local devices)."""

    capacity = None
    launched_total = 0

    def __init__(self, store: Any) -> None:
        self.store = store
        self.started: list[tuple[str, list[int]]] = []

    def recover(self) -> None:
        pass

    def tick(self, isolated: Any) -> None:
        pass

    def waiting(self, job: Any) -> bool:
        return job.slurm_job_id is None

    def start(self, job: Any, gpus: list[int]) -> None:
        self.started.append((job.id, gpus))
        self.store.update_job(job.id, slurm_job_id=str(len(self.started)))

    def cancel(self, job: Any) -> None:
        pass


def test_under_slurm_submitted_jobs_count_against_the_gpu_limit(tmp_path: Path) -> None:
    """A user's ``gpus`` limit counts GPUs per node x nodes of the jobs submitted to Slurm
    (pending there or running); the server's own devices play no part."""
    from server_helpers import job_spec, make_settings

    from dmuon_server.launching.identity import JobIdentities
    from dmuon_server.scheduling.supervisor import Supervisor
    from dmuon_server.schemas import JobCreate
    from dmuon_server.storage.store import Store
    from dmuon_server.streams.metrics import Hub, MetricsTailer

    settings = make_settings(tmp_path, launcher="slurm")
    users_file = _write(
        tmp_path / "users.json",
        [{"name": "ada", "token_sha256": _h("a" * 32), "limits": {"gpus": 8}}],
    )
    users = Users(users_file)
    store = Store(settings.db_path)
    hub = Hub()
    launcher = _SubmittingLauncher(store)
    supervisor = Supervisor(
        settings,
        store,
        hub,
        MetricsTailer(store, hub),
        launcher,  # type: ignore[arg-type]
        identities=JobIdentities(settings, users),
    )
    for i, (per_node, nodes) in enumerate([(2, 2), (4, 1), (1, 1)]):
        spec = JobCreate.model_validate({**job_spec(1), "gpus_per_node": per_node, "nnodes": nodes})
        store.create_job(
            job_id=f"j{i}",
            name=None,
            nproc=1,
            spec=spec.model_dump_json(),
            spec_hash=str(i),
            idempotency_key=None,
            argv=[],
            user="ada",
        )
    supervisor.tick()
    # 2 x 2 + 4 = 8 GPUs submitted, no local device given; the third would make 9.
    assert launcher.started == [("j0", []), ("j1", [])]
    places = supervisor.queue_places()
    assert places["j2"].reason == "ada holds 8 of 8 GPUs and this job needs 1 (their limit)"
    # Rounds with nothing changed do not plan again (planning costs O(queue)): the round
    # after the one that started jobs plans once more, then none until something changes.
    rounds: list[int] = []
    plan = supervisor._plan
    supervisor._plan = lambda: (rounds.append(1), plan())[1]  # type: ignore[method-assign]
    for _ in range(5):
        supervisor.tick()
    assert rounds == [1] and len(launcher.started) == 2
    store.transition("j0", JobState.RUNNING, "Slurm started it")
    store.transition("j0", JobState.SUCCEEDED, "done", exit_code=0)
    supervisor.tick()
    assert launcher.started[-1] == ("j2", []) and rounds == [1, 1]
    store.close()


def test_a_job_receives_only_the_allow_listed_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's variables a job gets: the documented allow-list and ``--job-env``;
    an operator's credential that nobody listed stays with the server (the oracle is the
    environment the server was given)."""
    from server_helpers import make_settings

    from dmuon_server.launching.command import JOB_ENV_ALLOWED, job_env

    given = {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "HF_HOME": "/models",
        "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000",
        "AWS_SECRET_ACCESS_KEY": "operator-key",
        "GITHUB_TOKEN": "ghp-operator",
        "MY_TEAM_SETTING": "x",
        "MY_CLOUD_KEY": "listed-but-secret",
        "DMUON_SERVER_TOKEN": "the-token",
        "RANK": "3",
    }
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    settings = make_settings(
        tmp_path, job_env=("MY_TEAM_*", "MY_CLOUD_KEY"), secret_env=("MY_CLOUD_KEY",)
    )
    env = job_env(settings, {"DMUON_JOB_ID": "j"})
    seen = {k: env.get(k) for k in given}
    assert seen == {
        "PATH": "/usr/bin",
        "LANG": "C.UTF-8",
        "HF_HOME": "/models",
        "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000",
        "AWS_SECRET_ACCESS_KEY": None,
        "GITHUB_TOKEN": None,
        "MY_TEAM_SETTING": "x",
        "MY_CLOUD_KEY": None,  # --secret-env wins over --job-env
        "DMUON_SERVER_TOKEN": None,
        "RANK": None,
    }
    assert env["DMUON_JOB_ID"] == "j"
    assert "PATH" in JOB_ENV_ALLOWED
