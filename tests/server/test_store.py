"""The store on its own: the per-job summary kept at ingest against the stored points, the
size of stored points, and the migration of a version-1 database."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import dmuon_recipe_contract as contract
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmuon_server.storage.store import EventRecord, Store

_SPEC = "{}"


def _new_job(store: Store, job_id: str = "j") -> None:
    store.create_job(
        job_id=job_id,
        name=None,
        nproc=1,
        spec=_SPEC,
        spec_hash="h",
        idempotency_key=None,
        argv=[],
    )


def _expected(points: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The summary written out from the final points (the oracle)."""
    steps = sorted(points)
    with_loss = [s for s in steps if points[s].get("loss") is not None]
    with_val = [s for s in steps if points[s].get("val_loss") is not None]
    return {
        "points": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "first_time": points[steps[0]].get("time") if steps else None,
        "last_time": points[steps[-1]].get("time") if steps else None,
        "last_loss": points[with_loss[-1]]["loss"] if with_loss else None,
        "first_val_loss": points[with_val[0]]["val_loss"] if with_val else None,
        "last_val_loss": points[with_val[-1]]["val_loss"] if with_val else None,
    }


values = st.one_of(st.none(), st.floats(0, 10), st.sampled_from(["NaN", "Infinity"]))
lines = st.lists(
    st.tuples(
        st.integers(0, 30),
        st.fixed_dictionaries(
            {},
            optional={"loss": values, "val_loss": values, "time": st.floats(0, 100)},
        ),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(lines, max_size=4), keep=st.one_of(st.none(), st.integers(0, 30)))
def test_summary_follows_every_ingest(
    tmp_path_factory: Any, batches: list, keep: int | None
) -> None:
    """Points in any order, steps seen twice (merged key by key), then an attempt that
    drops the points after a checkpoint: the summary equals the one written out from the
    stored points after every step."""
    store = Store(tmp_path_factory.mktemp("store") / "db.sqlite3")
    _new_job(store)
    stored: dict[int, dict[str, Any]] = {}
    for batch in batches:
        store.ingest("j", "metrics", 0, [(s, {"step": s, **d}) for s, d in batch], rejected=1)
        for s, d in batch:
            stored[s] = {**stored.get(s, {}), "step": s, **d}
        got = store.metric_summary("j")
        assert {k: getattr(got, k) for k in _expected(stored)} == _expected(stored)
    assert store.metric_summary("j").rejected_lines == len(batches)
    store.start_attempt("j", "restart", keep)
    stored = {s: d for s, d in stored.items() if keep is not None and s <= keep}
    got = store.metric_summary("j")
    assert {k: getattr(got, k) for k in _expected(stored)} == _expected(stored)
    assert got.rejected_lines == len(batches)  # dropping points keeps the count
    rows = store.metrics_after("j", -1, 1000)
    assert [r.step for r in rows] == sorted(stored)
    store.close()


def test_points_of_a_kilobyte_stay_on_their_pages(tmp_path: Path) -> None:
    """A WITHOUT ROWID table spills a row above about 1,000 bytes into overflow pages of
    its own (4.3x the data); a rowid table keeps it on its page."""
    store = Store(tmp_path / "db.sqlite3")
    _new_job(store)
    pad = "x" * 950
    points = [(s, {"step": s, "loss": 1.0, "note": pad}) for s in range(1, 3001)]
    raw = sum(len(json.dumps(d)) + 1 for _, d in points)
    for i in range(0, len(points), 500):
        store.ingest("j", "metrics", 0, points[i : i + 500])
    store.close()
    with sqlite3.connect(tmp_path / "db.sqlite3") as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    size = (tmp_path / "db.sqlite3").stat().st_size
    assert size < 1.5 * raw, f"{size / raw:.2f}x the points' bytes"


_V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('schema_version', '1');
CREATE TABLE jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, name TEXT,
    state TEXT NOT NULL, nproc INTEGER NOT NULL, spec TEXT NOT NULL, spec_hash TEXT NOT NULL,
    idempotency_key TEXT UNIQUE, created_at REAL NOT NULL, started_at REAL, finished_at REAL,
    exit_code INTEGER, reason TEXT, pid INTEGER, pgid INTEGER, create_time REAL,
    cancel_requested_at REAL, failure TEXT, recipe_summary TEXT, argv TEXT, slurm_job_id TEXT
);
CREATE TABLE metrics (
    job_id TEXT NOT NULL, step INTEGER NOT NULL, data TEXT NOT NULL, loss REAL,
    received_at REAL NOT NULL, PRIMARY KEY (job_id, step)
) WITHOUT ROWID;
"""


def test_a_version_1_database_is_migrated(tmp_path: Path) -> None:
    db = tmp_path / "db.sqlite3"
    with sqlite3.connect(db) as c:
        c.executescript(_V1_SCHEMA)
        for n, job_id in enumerate(("old", "new"), start=1):
            c.execute(
                "INSERT INTO jobs (id, state, nproc, spec, spec_hash, created_at, reason,"
                " idempotency_key) VALUES (?, 'queued', 1, '{}', 'h', ?, 'submitted', ?)",
                (job_id, float(n), "k" if job_id == "old" else None),
            )
        for step in range(1, 6):
            data = {"step": step, "loss": 6.0 - step, "time": float(step)}
            if step == 5:
                data["val_loss"] = 1.5
            c.execute(
                "INSERT INTO metrics VALUES ('old', ?, ?, ?, ?)",
                (step, json.dumps(data), data["loss"], 100.0 + step),
            )
    store = Store(db)
    got = store.metric_summary("old")
    assert (got.points, got.first_step, got.last_step, got.last_loss) == (5, 1, 5, 1.0)
    assert (got.first_val_loss, got.last_val_loss) == (1.5, 1.5)
    assert (got.first_received_at, got.last_received_at) == (101.0, 105.0)
    assert [r.step for r in store.metrics_after("old", -1, 10)] == [1, 2, 3, 4, 5]
    assert [j.id for j in store.jobs_in_states(["queued"])] == ["old", "new"]  # queue order
    # Idempotency keys became per user: the old key stays bound for its (unnamed) user.
    again, created = store.create_job(
        job_id="x", name=None, nproc=1, spec=_SPEC, spec_hash="h", idempotency_key="k", argv=[]
    )
    assert (again.id, created) == ("old", False)
    bobs, created = store.create_job(
        job_id="bobs", name=None, nproc=1, spec=_SPEC, spec_hash="other", idempotency_key="k",
        argv=[], user="bob",
    )  # fmt: skip
    assert created and bobs.user == "bob" and bobs.queue_seq > again.queue_seq
    store.close()
    with sqlite3.connect(db) as c:
        ddl = c.execute("SELECT sql FROM sqlite_master WHERE name = 'metrics'").fetchone()[0]
        assert "WITHOUT ROWID" not in ddl and "loss" not in ddl
        assert c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("2",)
    Store(db).close()  # opening it again changes nothing


def test_a_skipped_checkpoint_corrects_the_step_an_attempt_resumed_from(tmp_path: Path) -> None:
    """An attempt is recorded as resuming from the newest checkpoint on disk; when the
    recipe passes it over as damaged, its ``checkpoint_skipped`` line carries the step it
    really resumed from (0: none left), which the attempt then shows. The oracle is the
    step written in the event."""
    store = Store(tmp_path / "db.sqlite")
    _new_job(store)
    first = store.start_attempt("j", "submitted", None)
    second = store.start_attempt("j", "restart", 6)
    third = store.start_attempt("j", "restart", 6)

    def skipped(attempt: int, step: int) -> EventRecord:
        return EventRecord(attempt, contract.CHECKPOINT_SKIPPED_EVENT, "warning", "m", step)

    store.ingest("j", "m1", 10, [], events=[skipped(first, 3)])
    store.ingest("j", "m2", 10, [], events=[skipped(second, 4)])
    store.ingest("j", "m3", 10, [], events=[skipped(third, 0)])
    other = EventRecord(second, contract.CHECKPOINT_FAILED_EVENT, "warning", "m", 2)
    store.ingest("j", "m2", 20, [], events=[other])
    steps = {a.number: a.resumed_from_step for a in store.attempts("j")}
    assert steps == {first: None, second: 4, third: None}


def test_every_move_follows_the_one_transition_table(tmp_path: Path) -> None:
    """From each state a job can be in, each state it may move to is accepted and every
    other one raises (a finished job does not move at all: only a resume queues it)."""
    from dmuon_server.storage.states import (
        ALL_STATES,
        TERMINAL_STATES,
        TRANSITIONS,
        IllegalTransition,
        JobState,
    )

    store = Store(tmp_path / "db.sqlite3")
    ways_in = {
        JobState.QUEUED: [],
        JobState.STARTING: [JobState.STARTING],
        JobState.RUNNING: [JobState.STARTING, JobState.RUNNING],
    }
    for current in ALL_STATES:
        for new in ALL_STATES:
            job_id = f"{current}-{new}"
            _new_job(store, job_id)
            for step in ways_in.get(current, [current]):
                assert store.transition(job_id, step, "set up")
            if current in TERMINAL_STATES:
                assert store.transition(job_id, new, "after the end") is False
                assert store.get_job(job_id).state == current
            elif new in TRANSITIONS[current]:
                assert store.transition(job_id, new, "allowed"), (current, new)
                assert store.get_job(job_id).state == new
            else:
                with pytest.raises(IllegalTransition, match=f"a {current} job cannot move"):
                    store.transition(job_id, new, "not allowed")
                assert store.get_job(job_id).state == current  # nothing was written
    # The pairs the table refuses, written out: a start before the queue, a step back.
    refused = {(c, n) for c in ways_in for n in ALL_STATES if n not in TRANSITIONS[c]}
    assert refused == {
        (JobState.STARTING, JobState.QUEUED),
        (JobState.RUNNING, JobState.RUNNING),
    }
    store.close()
