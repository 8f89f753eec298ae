"""``make demo``: the main training job, submitted through the service.

Starts ``dmuon-server`` on a free loopback port with a temporary data directory, submits
a 2-process ``small`` job with gradient accumulation 4, prints the live loss from the
event stream with a progress bar, prints the final summary (start and end validation
loss), and stops the server. Exits 1 if the job did not succeed.

The job settings mirror ``dmuon.train.demo.DEMO_ARGS`` (the recipe's tuned demo: under five
minutes on two CPU cores, end validation loss at least 35% below the start); this module
does not import ``dmuon`` (no torch in the client either), and a test keeps the two equal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from dmuon_server.http.auth import GENERATED_TOKEN_FILE

#: Processes of the demo job (``dmuon.train.demo.DEMO_NPROC``).
DEMO_NPROC = 2
#: The demo job's recipe settings (``dmuon.train.demo.DEMO_ARGS``, its rates included).
DEMO_TRAIN: dict[str, Any] = {
    "model": "small",
    "optimizer": "dmuon",
    "mode": "z2",
    "steps": 60,
    "accum_steps": 4,
    "micro_batch_size": 4,
    "seq_len": 128,
    "warmup_steps": 10,
    "eval_every": 20,
    "seed": 0,
    "lr": 0.02,
    "adamw_lr": 0.003,
}
#: The bar the demo is held to: end validation loss this much below the start
#: (``dmuon.train.demo.DEMO_MIN_VAL_DROP``).
TARGET_DROP = 0.35


def _sse(response: httpx.Response) -> Iterator[tuple[str, str | None, str]]:
    """Yield ``(event, id, data)`` from an event stream (comments skipped)."""
    event, eid, data = "message", None, []
    for line in response.iter_lines():
        if not line:
            if data:
                yield event, eid, "\n".join(data)
            event, eid, data = "message", None, []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "event":
                event = value
            elif name == "id":
                eid = value
            elif name == "data":
                data.append(value)


def start_server(data_dir: Path, timeout: float = 60.0) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``dmuon-server --port 0`` and return the process and its URL."""
    log = (data_dir / "server.log").open("ab")
    proc = subprocess.Popen(
        # The demo runs the recipe only, as whoever runs the demo (root included).
        [
            *(sys.executable, "-m", "dmuon_server.cli", "--port", "0"),
            *("--data-dir", str(data_dir), "--allow-same-user-jobs"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    info = data_dir / "server.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited; see {data_dir / 'server.log'}")
        try:
            meta = json.loads(info.read_text())
            if meta.get("pid") == proc.pid:
                url = str(meta["url"])
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    return proc, url
        except (FileNotFoundError, ValueError, httpx.HTTPError):
            pass
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError("the server did not come up in time")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server and wait for it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _fmt(x: Any) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x)


def run_demo(url: str, body: dict[str, Any], token: str | None = None) -> dict[str, Any]:
    """Submit ``body``, follow its event stream with a bar, return the finished job.

    ``token`` is the server's (the one it keeps in ``<data-dir>/token``)."""
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    timeout = httpx.Timeout(30, read=120)
    with httpx.Client(base_url=url, timeout=timeout, headers=auth) as c:
        plan = c.post("/v1/jobs:validate", json=body)
        plan.raise_for_status()
        p = plan.json()
        print("torchrun command: torchrun " + " ".join(p["torchrun_argv"][3:]))
        print(
            f"world size {p['world_size']}, global batch {p['global_batch_sequences']} "
            f"sequences = {p['global_batch_tokens']:,} tokens per optimizer step"
        )
        r = c.post("/v1/jobs", json=body, headers={"Idempotency-Key": f"demo-{os.getpid()}"})
        r.raise_for_status()
        job = r.json()
        print(f"job {job['id']} submitted: {url}{r.headers['location']}")
        steps = body["train"]["steps"]
        bar = tqdm(total=steps, desc="train", unit="step", dynamic_ncols=True)
        done = 0
        last_id: str | None = None
        try:
            while True:  # reconnect (with Last-Event-ID) if the stream ever breaks
                headers = {"Last-Event-ID": last_id} if last_id else {}
                try:
                    with c.stream("GET", f"/v1/jobs/{job['id']}/events", headers=headers) as s:
                        if s.status_code == 204:
                            break
                        s.raise_for_status()
                        for event, eid, data in _sse(s):
                            obj = json.loads(data)
                            if event == "metric":
                                last_id = eid
                                step = obj["step"]
                                if obj.get("val_loss") is not None:
                                    bar.write(f"step {step:>4}  val_loss {_fmt(obj['val_loss'])}")
                                if obj.get("loss") is not None:
                                    tok = obj.get("tokens_per_s")
                                    bar.set_postfix(
                                        loss=_fmt(obj["loss"]),
                                        tok_s=f"{tok:,.0f}" if isinstance(tok, float) else tok,
                                        refresh=False,
                                    )
                                if step > done:
                                    bar.update(step - done)
                                    done = step
                            elif event == "state":
                                bar.write(f"state: {obj['state']} ({obj['reason']})")
                            elif event == "end":
                                break
                    break
                except httpx.TransportError:
                    time.sleep(1)
        finally:
            bar.close()
        return c.get(f"/v1/jobs/{job['id']}").json()


def print_summary(job: dict[str, Any], wall_s: float) -> bool:
    """Print the final summary; return whether the demo met its bar."""
    s = job["summary"]
    print(f"\nresult: {job['state']} (exit code {job['exit_code']}, {job['reason']})")
    if job.get("failure"):
        f = job["failure"]
        print(f"failing rank {f['rank']}, last log lines:")
        for line in f["log_tail"][-15:]:
            print("  " + line)
    tok = s["tokens_per_s"]
    tok_text = f"{tok:,.0f}" if isinstance(tok, float) else str(tok)
    print(
        f"steps {s['last_step']}/{s['steps']}, final train loss {_fmt(s['last_loss'])}, "
        f"{tok_text} tokens/s at the last step, wall time {wall_s:.0f} s"
    )
    start, end = s.get("first_val_loss"), s.get("last_val_loss")
    ok = job["state"] == "succeeded"
    if isinstance(start, float) and isinstance(end, float) and start > 0:
        drop = (start - end) / start
        mark = "meets" if drop >= TARGET_DROP else "MISSES"
        print(
            f"validation loss: start {start:.4f} -> end {end:.4f} ({drop:.1%} lower; "
            f"{mark} the {TARGET_DROP:.0%} target)"
        )
    return ok


def _contents(folder: Path) -> str:
    """What ``folder`` holds, as a person would list it (folders with a slash)."""
    try:
        entries = sorted(e for e in folder.iterdir() if not e.name.startswith("."))
    except OSError:
        return "nothing"
    return ", ".join(e.name + ("/" if e.is_dir() else "") for e in entries) or "nothing"


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m dmuon_server.demo", description=__doc__)
    ap.add_argument("--nproc", type=int, default=DEMO_NPROC, help="processes (world size)")
    ap.add_argument("--steps", type=int, default=DEMO_TRAIN["steps"], help="optimizer steps")
    ap.add_argument("--data-dir", type=Path, default=None, help="keep server state here")
    args = ap.parse_args(argv)
    body = {
        "name": "demo",
        "nproc_per_node": args.nproc,
        "train": {**DEMO_TRAIN, "steps": args.steps},
    }
    tmp = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="dmuon-demo-")) if tmp else args.data_dir
    data_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    proc, url = start_server(data_dir)
    print(f"dmuon-server is up at {url} (data dir {data_dir})")
    ok = False
    job: dict[str, Any] = {}
    # The server made a token for itself; the demo runs as the same account.
    token = (data_dir / GENERATED_TOKEN_FILE).read_text().strip()
    try:
        job = run_demo(url, body, token)
        ok = print_summary(job, time.monotonic() - t0)
    except KeyboardInterrupt:
        print("\ninterrupted: cancelling the job")
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, timeout=30, headers=auth) as c:
            for j in c.get("/v1/jobs", params={"state": ["queued", "starting", "running"]}).json()[
                "items"
            ]:
                c.post(f"/v1/jobs/{j['id']}/cancel")
            deadline = time.monotonic() + 30
            while (
                time.monotonic() < deadline
                and c.get("/v1/jobs", params={"state": ["starting", "running"]}).json()["items"]
            ):
                time.sleep(0.5)
    finally:
        stop_server(proc)
        print("server stopped")
        where = data_dir / "jobs" / job["id"] if job.get("id") else data_dir
        print(
            f"the run's folder is kept: {where} ({_contents(where)})\n"
            f"  again with its dashboard: dmuon-server --data-dir {data_dir} "
            "--allow-same-user-jobs"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
