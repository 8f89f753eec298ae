"""Nothing a job writes to its metrics file escapes its limits.

A hostile script job could fill the server's database and log through its metrics file:
1 MiB points, a file truncated after each round (the tailer took a shrunk file as new and
stored every round again: the database grew 305 MiB in 42 s while the user's volume held
24 MiB), and bad lines each echoed into the server's log (30 MiB of bad lines gave 32 MiB
of log). Checked here with a real `Store` (SQLite) and files written by the test:

* a line longer than `MAX_LINE_BYTES` is rejected, never stored;
* the points and events a job stores stop at its cap: the database file grows by less
  than the cap, `over_limit` names the limit and its source, and nothing more is read;
* a file that shrinks, or is rewritten in place to its old length or longer, closes its
  attempt's stream: the same lines written again are not stored twice, and the job is
  stopped, naming the append-only contract;
* rejected lines are logged once per interval per job, the rest counted ("and N more"),
  so 20,000 bad lines make a few log records; past `MAX_REJECTED_LINES` the job is
  stopped, naming why;
* another job's points are unaffected throughout.

End to end, `test_the_server_fails_a_job_that_floods_its_metrics` runs a live server with
a script job that floods its file.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dmuon_server.storage.store import Store
from dmuon_server.streams import metrics as metrics_module
from dmuon_server.streams.metrics import (
    CLOSED_OFFSET,
    MAX_LINE_BYTES,
    MAX_REJECTED_LINES,
    Hub,
    MetricsTailer,
)

CAP = 2 << 20


def _new_job(store: Store, job_id: str) -> None:
    store.create_job(
        job_id=job_id, name=None, nproc=1, spec="{}", spec_hash=job_id,
        idempotency_key=None, argv=[],
    )  # fmt: skip


def _steps(store: Store, job: str) -> list[int]:
    return [p.step for p in store.metrics_after(job, -1, 1 << 30)]


def _point(step: int, pad: int = 0) -> bytes:
    return json.dumps({"step": step, "loss": 1.0, "note": "x" * pad}).encode() + b"\n"


@pytest.fixture
def tailer(tmp_path: Path) -> tuple[MetricsTailer, Store]:
    store = Store(tmp_path / "db.sqlite3")
    for job in ("flood", "calm"):
        _new_job(store, job)
    caps = {"flood": (CAP, "--max-job-metrics-bytes")}
    return MetricsTailer(store, Hub(), cap_of=lambda job: caps.get(job)), store


def test_a_line_over_the_limit_is_rejected(
    tailer: tuple[MetricsTailer, Store], tmp_path: Path
) -> None:
    tail, store = tailer
    path = tmp_path / "calm.jsonl"
    path.write_bytes(_point(1) + _point(2, pad=MAX_LINE_BYTES) + _point(3))
    assert tail.poll("calm", path) == 2
    assert _steps(store, "calm") == [1, 3]
    assert tail.rejected_total == 1


def test_points_stop_at_the_jobs_cap_and_the_database_stays_under_it(
    tailer: tuple[MetricsTailer, Store], tmp_path: Path
) -> None:
    tail, store = tailer
    db = tmp_path / "db.sqlite3"
    before = db.stat().st_size
    flood, calm = tmp_path / "flood.jsonl", tmp_path / "calm.jsonl"
    step = 0
    for _ in range(40):  # 40 rounds of 8 points of 16 KiB: 5 MiB written, 2 MiB allowed
        with flood.open("ab") as f:
            for _ in range(8):
                step += 1
                f.write(_point(step, pad=16 << 10))
        tail.poll("flood", flood)
        calm.write_bytes(b"".join(_point(s) for s in range(1, step + 1)))
        tail.poll("calm", calm)
    assert "flood" in tail.over_limit
    assert "2,097,152 bytes a job may store (--max-job-metrics-bytes)" in tail.over_limit["flood"]
    assert store.stored_metrics_bytes("flood") <= CAP
    assert db.stat().st_size - before < CAP + (1 << 20)  # the cap, plus SQLite's pages
    stored = len(_steps(store, "flood"))
    with flood.open("ab") as f:
        f.write(_point(step + 1))
    assert tail.poll("flood", flood) == 0 and len(_steps(store, "flood")) == stored
    assert len(_steps(store, "calm")) == step  # the other job: every point
    assert "calm" not in tail.over_limit


def test_a_file_that_shrinks_is_not_read_again_from_the_start(
    tailer: tuple[MetricsTailer, Store], tmp_path: Path
) -> None:
    tail, store = tailer
    path = tmp_path / "calm.jsonl"
    rounds = b"".join(_point(s) for s in range(1, 6))
    path.write_bytes(rounds)
    assert tail.poll("calm", path) == 5
    for _ in range(3):  # truncated and written again, as the flooding script did
        path.write_bytes(_point(1))
        assert tail.poll("calm", path) == 0
        path.write_bytes(rounds + rounds)
        assert tail.poll("calm", path) == 0
    assert len(_steps(store, "calm")) == 5
    assert store.get_offset("calm", "metrics") == CLOSED_OFFSET
    shrank = f"metrics file shrank from {len(rounds):,} to {len(_point(1)):,} bytes"
    assert shrank in tail.over_limit["calm"]
    assert "never truncate or rewrite it" in tail.over_limit["calm"]


def test_a_file_rewritten_to_its_old_length_or_longer_is_not_read_on(
    tailer: tuple[MetricsTailer, Store], tmp_path: Path
) -> None:
    """A rewrite that leaves the file no shorter than the stored offset (the flooding
    script's rounds of equal lines): its size shows nothing, the bytes before the offset
    do. Across a server restart (a new tailer, no bytes kept) the next rewrite is caught."""
    tail, store = tailer
    path = tmp_path / "calm.jsonl"
    path.write_bytes(_point(1) + _point(2))
    assert tail.poll("calm", path) == 2
    with path.open("ab") as f:
        f.write(_point(3))
    assert tail.poll("calm", path) == 1 and tail.poll("calm", path) == 0  # appended: read on
    offset = store.get_offset("calm", "metrics")
    path.write_bytes(b"".join(_point(s) for s in (4, 5, 6, 7)))  # in place, and longer
    assert tail.poll("calm", path) == 0
    assert _steps(store, "calm") == [1, 2, 3]
    assert store.get_offset("calm", "metrics") == CLOSED_OFFSET
    assert f"metrics file was rewritten before byte {offset:,}" in tail.over_limit["calm"]
    assert "never truncate or rewrite it" in tail.over_limit["calm"]

    restarted = MetricsTailer(store, Hub())
    path = tmp_path / "flood.jsonl"
    path.write_bytes(_point(1))
    assert tail.poll("flood", path) == 1
    with path.open("ab") as f:
        f.write(_point(2))
    assert restarted.poll("flood", path) == 1  # nothing kept yet: read on from the offset
    path.write_bytes(_point(8) + _point(9))
    assert restarted.poll("flood", path) == 0 and _steps(store, "flood") == [1, 2]
    assert "was rewritten before byte" in restarted.over_limit["flood"]


def test_rejected_lines_are_counted_not_echoed_and_a_flood_stops_the_job(
    tailer: tuple[MetricsTailer, Store], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tail, _ = tailer
    path = tmp_path / "flood.jsonl"
    bad = b"not json " + b"y" * 180 + b"\n"
    with caplog.at_level(logging.WARNING, logger="dmuon_server.streams.metrics"):
        for _ in range(4):
            with path.open("ab") as f:
                f.write(bad * (MAX_REJECTED_LINES // 2))
            tail.poll("flood", path)
    logged = [r.getMessage() for r in caplog.records]
    assert sum("rejected metrics line" in m for m in logged) == 1  # one interval
    assert sum(len(m) for m in logged) < 4096
    assert "lines to its metrics file that are no metric points" in tail.over_limit["flood"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dmuon_server.streams.metrics"):
        tail.forget("flood")
    assert any("more rejected metrics lines" in r.getMessage() for r in caplog.records)


def test_the_interval_lets_a_later_line_be_logged(
    tailer: tuple[MetricsTailer, Store], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    tail, _ = tailer
    monkeypatch.setattr(metrics_module, "REJECTED_LOG_INTERVAL_S", 0.0)
    path = tmp_path / "calm.jsonl"
    with caplog.at_level(logging.WARNING, logger="dmuon_server.streams.metrics"):
        path.write_bytes(b"oops\n")
        tail.poll("calm", path)
        with path.open("ab") as f:
            f.write(b"oops again\n")
        tail.poll("calm", path)
    assert sum("rejected metrics line" in r.getMessage() for r in caplog.records) == 2


#: Writes 60 KiB points (under the line limit) to its metrics file for ever, appending,
#: or truncating the file after every round of 4 (``argv[1] == "truncate"``), as the
#: hostile script did; only the server can stop it.
FLOODER = r"""
import json, os, sys, time
path = os.environ["DMUON_METRICS_FILE"]
mode = "w" if sys.argv[1:] == ["truncate"] else "a"
step = 0
while True:
    with open(path, mode) as f:
        for _ in range(4):
            step += 1
            f.write(json.dumps({"step": step, "loss": 1.0, "pad": "x" * (60 << 10)}) + "\n")
    time.sleep(0.05)
"""

#: Writes ``argv[1]`` points of its own and ends well.
CALM = r"""
import json, os, sys, time
with open(os.environ["DMUON_METRICS_FILE"], "a") as f:
    for step in range(1, int(sys.argv[1]) + 1):
        f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")
        f.flush()
        time.sleep(0.05)
"""


def test_the_server_fails_a_job_that_floods_its_metrics(data_dir: Path, tmp_path: Path) -> None:
    """A live server with a 1 MiB cap, the three jobs running side by side: a job that
    floods its metrics file ends ``failed`` with the cap in its reason, one that truncates
    its file each round ends ``failed`` naming that; the database grows by less than the
    cap plus SQLite's pages, and the calm job beside them stores every point and
    succeeds."""
    from server_helpers import TERMINAL, LiveServer, wait_until

    code = tmp_path / "code"
    code.mkdir()
    (code / "flood.py").write_text(FLOODER)
    (code / "truncate.py").write_text(FLOODER)
    (code / "calm.py").write_text(CALM)
    cap = 1 << 20
    server = LiveServer(
        data_dir, "--code-root", str(code), "--max-job-metrics-bytes", str(cap),
        "--max-concurrent-jobs", "3",
    ).start()  # fmt: skip
    try:
        with server.client() as c:

            def submit(name: str, *args: str) -> str:
                spec = {"name": name, "nproc_per_node": 1,
                        "script": {"path": f"{name}.py", "args": list(args)}}  # fmt: skip
                return c.post("/v1/jobs", json=spec).json()["id"]

            flood, calm = submit("flood"), submit("calm", "40")
            truncating = submit("truncate", "truncate")
            size_before = sum(p.stat().st_size for p in data_dir.glob("*.sqlite3*"))

            def ended(job_id: str) -> dict | None:
                job = c.get(f"/v1/jobs/{job_id}").json()
                return job if job["state"] in TERMINAL else None

            done = wait_until(lambda: ended(flood), 120, "the flooding job to be stopped")
            assert done["state"] == "failed", done
            assert "--max-job-metrics-bytes" in done["reason"], done["reason"]
            done = wait_until(lambda: ended(truncating), 120, "the truncating job to be stopped")
            assert done["state"] == "failed", done
            assert "never truncate or rewrite it" in done["reason"], done["reason"]
            calm_done = wait_until(lambda: ended(calm), 120, "the calm job")
            assert calm_done["state"] == "succeeded", calm_done
            points = c.get(f"/v1/jobs/{calm}/metrics").json()["items"]
            assert [p["step"] for p in points] == list(range(1, 41))
            grown = sum(p.stat().st_size for p in data_dir.glob("*.sqlite3*")) - size_before
            assert grown < cap + (2 << 20), grown
    finally:
        server.stop()


@pytest.mark.parametrize("page", ["job-service.md", "zh/job-service.md"])
def test_the_docs_state_the_limits_the_code_holds(page: str) -> None:
    """The job-service page (EN and ZH) gives the code's own numbers."""
    from dmuon_server.config import Settings

    docs = Path(__file__).resolve().parents[2] / "docs"
    text = (docs / page).read_text(encoding="utf-8")
    section = text.split("{#metrics-limits}", 1)[1].split("####", 1)[0]
    assert f"{MAX_LINE_BYTES >> 10} KiB" in section
    assert f"{Settings.max_job_metrics_bytes >> 20} MiB" in section
    assert f"{MAX_REJECTED_LINES:,}" in section
    assert metrics_module.REJECTED_LOG_INTERVAL_S == 60.0  # "once a minute" / "每分钟"
    flag_row = next(line for line in text.splitlines() if "`--max-job-metrics-bytes" in line)
    assert f"`{Settings.max_job_metrics_bytes}`" in flag_row
