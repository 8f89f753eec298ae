"""The streams of a job share one publisher: every stream gets every stored point once, in
order, to its ``end``, while the database is read per change and not per stream; idle
streams read nothing; a stream that falls behind the publisher's log reads the rest from
the database. In process, on a real store; the oracle is what was stored."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dmuon_server.storage.records import PointRecord, TransitionRecord
from dmuon_server.storage.store import Store
from dmuon_server.streams import feeds
from dmuon_server.streams.events import job_events
from dmuon_server.streams.feeds import EventStreams
from dmuon_server.streams.metrics import Hub


class CountingStore(Store):
    """A store that counts the reads the streams make."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.reads = 0
        self.histories = 0

    def history(self, job_id: str) -> list[TransitionRecord]:
        self.histories += 1
        return super().history(job_id)

    def metrics_after(self, job_id: str, after_step: int, limit: int) -> list[PointRecord]:
        self.reads += 1
        return super().metrics_after(job_id, after_step, limit)


def _store(tmp_path: Path) -> CountingStore:
    store = CountingStore(tmp_path / "db.sqlite")
    store.create_job(
        job_id="j", name=None, nproc=1, spec="{}", spec_hash="h", idempotency_key=None, argv=[]
    )
    store.transition("j", "running", "started")
    return store


def _ingest(store: Store, hub: Hub, steps: range) -> None:
    points = [(s, {"step": s, "loss": 1.0 / (s + 1)}) for s in steps]
    store.ingest("j", "metrics", steps.stop, points)
    hub.notify("j")


async def _follow(
    streams: EventStreams,
    store: Store,
    after: int = -1,
    seen: list[str] | None = None,
    **kw: Any,
) -> list[str]:
    """The stream's events as ``metric:<step>``, ``state:<state>``, ``end:<payload>``,
    ``heartbeat``, appended to ``seen`` (a new list by default) as they arrive."""
    seen = [] if seen is None else seen
    async for text in job_events(streams, store, "j", after):
        if text.startswith(": heartbeat"):
            seen.append("heartbeat")
        elif text.startswith("id: "):
            seen.append("metric:" + text.split("\n", 1)[0][4:])
        elif text.startswith("event: state"):
            seen.append("state:" + json.loads(text.split("data: ", 1)[1])["state"])
        elif text.startswith("event: end"):
            seen.append("end:" + text.split("data: ", 1)[1].strip())
        if kw.get("slow") and seen:  # joined, then stalled until the gate opens
            await kw["slow"].wait()
    return seen


def _metric_steps(seen: list[str]) -> list[int]:
    return [int(s.split(":")[1]) for s in seen if s.startswith("metric:")]


def test_many_streams_share_one_reader_and_each_gets_every_point_once(tmp_path: Path) -> None:
    store, hub = _store(tmp_path), Hub()

    async def run() -> tuple[list[list[str]], int]:
        streams = EventStreams(store, hub)
        _ingest(store, hub, range(0, 20))  # a backlog before anyone follows
        followers = [asyncio.create_task(_follow(streams, store)) for _ in range(40)]
        late = None
        for batch in range(30):
            await asyncio.sleep(0.01)
            _ingest(store, hub, range(20 + 10 * batch, 30 + 10 * batch))
            if batch == 15:  # one more stream, resuming after step 100
                late = asyncio.create_task(_follow(streams, store, after=100))
        await asyncio.sleep(0.05)
        store.transition("j", "succeeded", "done", exit_code=0)
        hub.notify("j")
        assert late is not None
        seen = await asyncio.wait_for(asyncio.gather(*followers, late), 30)
        return seen, streams.open

    seen, still_open = asyncio.run(run())
    for events in seen[:-1]:
        assert events[0] == "state:running"
        assert _metric_steps(events) == list(range(320))
        assert events[-2] == "state:succeeded"
        assert json.loads(events[-1][4:]) == {
            "state": "succeeded",
            "exit_code": 0,
            "reason": "done",
            "last_step": 319,
        }
    assert _metric_steps(seen[-1]) == list(range(101, 320))
    assert still_open == 0
    # Polling per stream would read at least 41 streams x 31 changes = 1,271 times; the
    # publisher reads once per wake-up (at most once per change, twice at the end), and
    # each stream once to join.
    assert store.reads <= 32 + 2 + 41, store.reads


def test_idle_streams_read_nothing_and_get_their_heartbeats(tmp_path: Path) -> None:
    store, hub = _store(tmp_path), Hub()

    async def run() -> list[list[str]]:
        streams = EventStreams(store, hub, heartbeat_s=0.2)
        followers = [asyncio.create_task(_follow(streams, store)) for _ in range(100)]
        # Every follower's first read done (on a loaded machine that takes more than a
        # fixed 0.3 s), then a moment for the last to settle: from there on, idle.
        deadline = asyncio.get_running_loop().time() + 10
        while store.reads < len(followers) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        reads = store.reads
        await asyncio.sleep(1.0)
        assert store.reads == reads, "idle streams read the database"
        store.transition("j", "cancelled", "stopped")
        hub.notify("j")
        return await asyncio.wait_for(asyncio.gather(*followers), 10)

    for events in asyncio.run(run()):
        assert events[0] == "state:running" and events[-1].startswith("end:")
        assert events.count("heartbeat") >= 3  # 1.3 s idle, a heartbeat due every 0.2 s


def test_a_stream_behind_the_log_reads_the_rest_from_the_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(feeds, "LOG_SIZE", 8)
    store, hub = _store(tmp_path), Hub()

    async def run() -> tuple[list[str], list[str]]:
        streams = EventStreams(store, hub)
        gate = asyncio.Event()
        quick_seen: list[str] = []
        slow = asyncio.create_task(_follow(streams, store, slow=gate))
        quick = asyncio.create_task(_follow(streams, store, seen=quick_seen))
        await asyncio.sleep(0.05)
        for start in range(0, 200, 5):  # 40 changes of 5 points: far more than 8 entries
            _ingest(store, hub, range(start, start + 5))
            # The quick stream keeps up however slow the machine: the next change comes
            # only once it has this one (the publisher reads in a worker thread).
            async with asyncio.timeout(10):
                while len(_metric_steps(quick_seen)) < start + 5:
                    await asyncio.sleep(0.001)
        gate.set()
        store.transition("j", "failed", "exit 1", exit_code=1)
        hub.notify("j")
        return await asyncio.wait_for(asyncio.gather(slow, quick), 10)

    both = asyncio.run(run())
    # The feed's start, the two joins, and the slow stream's read of what it missed.
    assert store.histories == 4
    for events in both:
        assert _metric_steps(events) == list(range(200))
        assert events[-2:] == [
            "state:failed",
            'end:{"state": "failed", "exit_code": 1, "reason": "exit 1", "last_step": 199}',
        ]


def test_a_stream_of_a_finished_job_sends_its_points_and_ends(tmp_path: Path) -> None:
    store, hub = _store(tmp_path), Hub()
    _ingest(store, hub, range(0, 7))
    store.transition("j", "succeeded", "done", exit_code=0)

    async def run() -> list[list[str]]:
        streams = EventStreams(store, hub)
        return await asyncio.wait_for(
            asyncio.gather(_follow(streams, store), _follow(streams, store, after=3)), 10
        )

    whole, resumed = asyncio.run(run())
    assert whole[0] == "state:succeeded" and _metric_steps(whole) == list(range(7))
    assert _metric_steps(resumed) == [4, 5, 6]
    for events in (whole, resumed):
        assert json.loads(events[-1][4:])["last_step"] == 6
        assert sum(e.startswith("end:") for e in events) == 1


def test_the_streams_benchmark_runs_and_reports_its_figures(tmp_path: Path) -> None:
    """`benchmarks/server_streams.py` on a small scale: its figures are measured, not made
    up (every request answered, the streams opened, CPU shares between 0 and 1 core)."""
    out = tmp_path / "streams.json"
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "server_streams.py"
    argv = ["--streams", "30", "--load-streams", "10", "--jobs", "3", "--rps", "20"]
    argv += ["--load-s", "1", "--idle-s", "0.5", "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(bench), *argv], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["requests"] == 20 and figures["streams"] == 30
    assert 0 <= figures["idle_cpu_no_streams"] < 1 and 0 <= figures["idle_cpu_streams"] < 1
    assert 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
    assert "REST with 10 streams open: 20 requests" in done.stdout


def test_a_failing_database_stalls_the_streams_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the store that fails (a full disk, an I/O error) halfway through is
    retried: no point it had read is skipped, and the streams go on to the end."""
    monkeypatch.setattr(feeds, "RETRY_S", 0.05)
    store, hub = _store(tmp_path), Hub()
    failures = {"left": 0}
    transitions_after = store.transitions_after

    def flaky(job_id: str, after_id: int) -> Any:
        if failures["left"]:
            failures["left"] -= 1
            raise OSError("disk I/O error")
        return transitions_after(job_id, after_id)

    monkeypatch.setattr(store, "transitions_after", flaky)

    async def run() -> list[str]:
        streams = EventStreams(store, hub)
        follower = asyncio.create_task(_follow(streams, store))
        await asyncio.sleep(0.05)
        failures["left"] = 2  # after the points were read, twice
        _ingest(store, hub, range(0, 10))
        await asyncio.sleep(0.3)
        _ingest(store, hub, range(10, 15))
        store.transition("j", "succeeded", "done", exit_code=0)
        hub.notify("j")
        return await asyncio.wait_for(follower, 10)

    events = asyncio.run(run())
    assert _metric_steps(events) == list(range(15))
    assert events[-2:] == [
        "state:succeeded",
        'end:{"state": "succeeded", "exit_code": 0, "reason": "done", "last_step": 14}',
    ]
