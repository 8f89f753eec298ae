"""The exit handler waits for gloo's worker threads, measured by the threads' own clocks.

A stand-in worker names itself as gloo's worker threads are named and stays runnable for a
known time; the handler must not return before that time, and must give up at its limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from dmuon._teardown import GLOO_WORKER_THREAD, gloo_workers_running, wait_for_idle_gloo_workers

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/task").is_dir(), reason="thread states come from Linux's /proc"
)


def _busy_worker(busy_s: float, started: threading.Event, finished: list[float]) -> None:
    """Name this thread as a gloo worker, stay runnable for ``busy_s``, then record the end.

    It spends its time in matrix products, which run without the GIL, so it stays runnable
    while the test's thread polls (a thread waiting for the GIL would show as sleeping).
    """
    Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(GLOO_WORKER_THREAD)
    matrix = torch.randn(192, 192)
    started.set()
    end = time.monotonic() + busy_s
    while time.monotonic() < end:
        torch.mm(matrix, matrix)
    finished.append(time.monotonic())


@pytest.fixture
def busy_worker() -> Iterator[Callable[[float], list[float]]]:
    threads: list[threading.Thread] = []

    def start(busy_s: float) -> list[float]:
        started, finished = threading.Event(), []
        thread = threading.Thread(target=_busy_worker, args=(busy_s, started, finished))
        thread.start()
        started.wait()
        threads.append(thread)
        return finished

    yield start
    for thread in threads:
        thread.join()


def test_a_runnable_worker_is_counted_and_an_idle_process_has_none(busy_worker) -> None:
    assert gloo_workers_running() == 0
    finished = busy_worker(2.0)
    counts = [gloo_workers_running() for _ in range(10)]
    assert not finished, "the stand-in ended before it was observed"
    # The stand-in, seen running (threads it starts for the products inherit its name).
    assert max(counts) >= 1


def test_the_wait_lasts_until_the_worker_is_idle(busy_worker) -> None:
    finished = busy_worker(0.3)
    assert wait_for_idle_gloo_workers(limit_s=5.0)
    returned = time.monotonic()
    assert finished and returned >= finished[0]


def test_the_wait_gives_up_at_its_limit(busy_worker) -> None:
    started = time.monotonic()
    finished = busy_worker(1.5)
    assert not wait_for_idle_gloo_workers(limit_s=0.2)
    assert time.monotonic() - started < 1.0 and not finished


EXITING_SCRIPT = """
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon import _teardown

waited = _teardown.wait_for_idle_gloo_workers


def reporting_wait(*args, **kwargs):
    workers = _teardown.gloo_workers_running()
    idle = waited(*args, **kwargs)
    print(f"at exit: workers counted {workers is not None}, idle {idle}", flush=True)
    return idle


_teardown.wait_for_idle_gloo_workers = reporting_wait
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
model = nn.Module()
model.layers = nn.ModuleList([nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8, bias=False))])
dmuon.dedicate_params(model, mesh)
fully_shard(model.layers[0], mesh=mesh)
model.layers[0](torch.randn(2, 8)).sum().backward()
names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
print("gloo workers named", names.count(_teardown.GLOO_WORKER_THREAD) > 0, flush=True)
dist.destroy_process_group()
"""


def test_a_dedicated_script_waits_for_gloo_at_exit(tmp_path: Path) -> None:
    """dedicate_params registers the handler; it runs at exit and finds gloo's workers."""
    script = tmp_path / "exiting.py"
    script.write_text(EXITING_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "gloo workers named True" in done.stdout
    assert "at exit: workers counted True, idle True" in done.stdout
