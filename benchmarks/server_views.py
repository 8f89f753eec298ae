"""Job views against stored points, and the database's size against the metrics file.

For each point count (1k, 100k, 500k by default) one job's metrics file is written and
ingested into a fresh data directory by the server's own tailer
(:class:`dmuon_server.streams.metrics.MetricsTailer`, the code a running server uses), then a
``dmuon-server`` process is started on that directory and timed through HTTP:

* ``GET /v1/jobs/{id}`` and ``GET /v1/jobs`` (the dashboard's views of a job);
* ``GET /v1/jobs/{id}/metrics?limit=1`` alone, and again while three clients poll
  ``GET /v1/jobs`` without pause (three dashboard tabs).

A view's cost should not grow with the points: the report gives each median against the
1k one. The size part writes points of about 1 KB (``--wide-bytes``) and of the recipe's
usual size, and reports the database file (after a WAL checkpoint) over the metrics file.

    python benchmarks/server_views.py                 # 1k, 100k, 500k points
    python benchmarks/server_views.py --points 1000 20000 --requests 10
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from cli_types import positive_int

SPEC = {
    "nproc_per_node": 1,
    "train": {
        "model": "tiny",
        "steps": 1,
        "micro_batch_size": 2,
        "accum_steps": 1,
        "seq_len": 32,
        "lr": 0.02,
        "adamw_lr": 0.003,
        "optimizer": "dmuon",
        "mode": "z2",
        "seed": 0,
    },
}


def metric_line(step: int, pad: int) -> str:
    """One line as the recipe writes it (a val_loss every 50 steps), padded with an extra
    field to about ``pad`` bytes when ``pad`` > 0."""
    rec: dict[str, Any] = {
        "step": step,
        "loss": 5.0 / (1 + step / 1000),
        "lr": 0.02,
        "tokens_per_s": 123456.7 + step % 97,
        "grad_norm": 1.0 / (1 + step % 13),
        "time": step * 0.137,
    }
    if step % 50 == 0:
        rec["val_loss"] = rec["loss"] + 0.05
    line = json.dumps(rec)
    if pad > len(line):
        rec["note"] = "x" * (pad - len(line) - 12)
        line = json.dumps(rec)
    return line + "\n"


def write_metrics(path: Path, points: int, pad: int) -> int:
    """Write ``points`` lines to ``path``; return the file's size."""
    with path.open("w") as f:
        for step in range(1, points + 1):
            f.write(metric_line(step, pad))
    return path.stat().st_size


def make_job(data_dir: Path, points: int, pad: int) -> tuple[str, float, int, int]:
    """A succeeded job with ``points`` ingested points in a new data directory.

    Returns the job id, the ingest rate (points per second), the metrics file's size and
    the database's size after a WAL checkpoint.
    """
    from dmuon_server.schemas import JobCreate
    from dmuon_server.storage.store import Store
    from dmuon_server.streams.metrics import Hub, MetricsTailer

    data_dir.mkdir(parents=True)
    job_id = uuid.uuid4().hex  # as the server names jobs
    spec = JobCreate.model_validate(SPEC)
    store = Store(data_dir / "dmuon-server.sqlite3")
    store.create_job(
        job_id=job_id,
        name=f"views-{points}",
        nproc=1,
        spec=spec.model_dump_json(),
        spec_hash="bench",
        idempotency_key=None,
        argv=[],
    )
    store.transition(job_id, "starting", "benchmark")
    job_dir = data_dir / "jobs" / job_id
    job_dir.mkdir(parents=True)
    metrics = job_dir / "metrics.jsonl"
    file_bytes = write_metrics(metrics, points, pad)
    t0 = time.perf_counter()
    MetricsTailer(store, Hub()).poll(job_id, metrics, final=True)
    rate = points / (time.perf_counter() - t0)
    store.transition(job_id, "succeeded", "benchmark", exit_code=0)
    store.close()
    db = data_dir / "dmuon-server.sqlite3"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return job_id, rate, file_bytes, db.stat().st_size


def start_server(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``dmuon-server --port 0`` on ``data_dir``; return it and its URL."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "dmuon_server.cli", "--port", "0"),
            *("--data-dir", str(data_dir), "--allow-same-user-jobs", "--sandbox", "none"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            info = json.loads((data_dir / "server.json").read_text())
            ready = info.get("pid") == proc.pid
            if ready and httpx.get(info["url"] + "/healthz", timeout=2).status_code == 200:
                return proc, info["url"]
        except (FileNotFoundError, ValueError, KeyError, httpx.HTTPError):
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start within 120 s")


def timed(c: httpx.Client, path: str, n: int) -> list[float]:
    """Seconds of ``n`` GETs of ``path`` (after one warm-up)."""
    c.get(path).raise_for_status()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        c.get(path).raise_for_status()
        out.append(time.perf_counter() - t0)
    return out


def under_pollers(url: str, path: str, n: int, pollers: int = 3) -> list[float]:
    """Seconds of ``n`` GETs of ``path`` while ``pollers`` clients poll ``/v1/jobs``."""
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not stop.is_set():
                c.get("/v1/jobs")

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(pollers)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        with httpx.Client(base_url=url, timeout=60) as c:
            return timed(c, path, n)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def measure(root: Path, points: int, requests: int) -> dict[str, Any]:
    """Ingest ``points`` recipe-sized points and time the views."""
    data_dir = root / f"views-{points}"
    job_id, rate, file_bytes, db_bytes = make_job(data_dir, points, pad=0)
    proc, url = start_server(data_dir)
    try:
        one_row = f"/v1/jobs/{job_id}/metrics?after_step={points - 1}&limit=1"
        with httpx.Client(base_url=url, timeout=60) as c:
            views = {
                "GET /v1/jobs/{id}": timed(c, f"/v1/jobs/{job_id}", requests),
                "GET /v1/jobs": timed(c, "/v1/jobs", requests),
                "GET metrics?limit=1": timed(c, one_row, requests),
            }
        views["GET metrics?limit=1, 3 pollers"] = under_pollers(url, one_row, requests)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {
        "points": points,
        "ingest_points_per_s": rate,
        "metrics_file_bytes": file_bytes,
        "db_bytes": db_bytes,
        "views": {k: {"median_s": statistics.median(v), "max_s": max(v)} for k, v in views.items()},
    }


def size_ratio(root: Path, points: int, pad: int) -> dict[str, Any]:
    """Database bytes over metrics-file bytes for ``points`` lines of about ``pad`` bytes."""
    _, rate, file_bytes, db_bytes = make_job(root / f"size-{points}-{pad}", points, pad)
    return {
        "points": points,
        "line_bytes": round(file_bytes / points),
        "metrics_file_bytes": file_bytes,
        "db_bytes": db_bytes,
        "ratio": db_bytes / file_bytes,
        "ingest_points_per_s": rate,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print the report (and write it with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", type=positive_int, nargs="+", default=[1_000, 100_000, 500_000])
    p.add_argument("--requests", type=positive_int, default=30, help="timed requests per view")
    p.add_argument(
        "--size-points", type=positive_int, default=100_000, help="points of the size check"
    )
    p.add_argument("--wide-bytes", type=positive_int, default=1000, help="bytes of a wide point")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    results: dict[str, Any] = {"views": [], "sizes": []}
    with tempfile.TemporaryDirectory(prefix="dmuon-views-") as tmp:
        root = Path(tmp)
        for n in args.points:
            r = measure(root, n, args.requests)
            results["views"].append(r)
            base = results["views"][0]["views"]
            print(f"{n:>8} points (ingest {r['ingest_points_per_s']:,.0f} points/s)")
            for name, v in r["views"].items():
                ratio = v["median_s"] / base[name]["median_s"]
                print(
                    f"    {name:<32} median {v['median_s'] * 1e3:8.2f} ms  max "
                    f"{v['max_s'] * 1e3:8.2f} ms  ({ratio:.2f}x the {args.points[0]}-point view)"
                )
        for pad in (0, args.wide_bytes):
            s = size_ratio(root, args.size_points, pad)
            results["sizes"].append(s)
            print(
                f"size: {s['points']} points of {s['line_bytes']} B: metrics file "
                f"{s['metrics_file_bytes'] / 2**20:.1f} MiB, database "
                f"{s['db_bytes'] / 2**20:.1f} MiB, ratio {s['ratio']:.2f}x"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
