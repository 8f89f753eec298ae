"""Rank pools: ``world`` processes joined in one gloo process group, kept for many cases.

`spawn_ranks` starts fresh processes for one call; a pool starts them once (forked from
the harness's fork server, which has imported torch, dmuon and transformers) and then runs
task after task on all of them: ``pool.run(fn, *args)`` runs ``fn(rank, world, *args)`` on
every rank and returns the per-rank results (an exception is ``{"error": traceback}`` on
its rank). A case costs its own work, not an interpreter start and a process-group setup.

After a task that raised on some rank the ranks may disagree about pending collectives,
and a rank stuck in one never answers: the pool is then torn down (its processes killed
by their handles) and started afresh for the next task. Pools also restart after
`RECYCLE_AFTER` tasks, so that process groups that cases create (DDP makes one per
model) do not pile up.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_harness import join_group

#: A collective may wait this long for its peers before the rank gives up.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
#: How long a task may take on the slowest rank before the pool is declared stuck.
TASK_TIMEOUT = 240.0
#: Once one rank reported an error, how long the others get to answer.
ERROR_GRACE = 15.0
RECYCLE_AFTER = 150


def _serve(
    rank: int,
    world: int,
    store_file: str,
    inbox: Any,
    outbox: Any,
    environ: dict[str, str],
) -> None:
    join_group(rank, world, store_file, environ, timeout=COLLECTIVE_TIMEOUT)
    import gc

    # What exists now (torch, transformers, the process group) lives as long as the rank:
    # kept out of the collections, so that collecting each case's garbage is quick.
    gc.collect()
    gc.freeze()
    while True:
        task = inbox.get()
        if task is None:
            break
        number, fn, args, out_path = task
        try:
            result: Any = fn(rank, world, *args)
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, out_path)
        outbox.put((number, rank, isinstance(result, dict) and "error" in result))
        del result
        gc.collect()  # the case's models and process groups, while the parent compares
    dist.destroy_process_group()


class RankPool:
    """``world`` ranks serving tasks (see the module docstring)."""

    def __init__(self, world: int) -> None:
        from dist_harness import FORKSERVER_PRELOAD

        mp.set_forkserver_preload(FORKSERVER_PRELOAD)
        self.world = world
        self._dir = tempfile.TemporaryDirectory(prefix=f"dmuon-pool{world}-")
        self._context: Any = None
        self._inboxes: list[Any] = []
        self._outbox: Any = None
        self._tasks = 0
        self._number = 0
        self.starts = 0

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        self._inboxes = [ctx.SimpleQueue() for _ in range(self.world)]
        self._outbox = ctx.Queue()
        store = os.path.join(self._dir.name, f"store{self.starts}")
        processes = []
        for rank in range(self.world):
            process = ctx.Process(
                target=_serve,
                args=(rank, self.world, store, self._inboxes[rank], self._outbox, dict(os.environ)),
                daemon=True,
            )
            process.start()
            processes.append(process)
        self._context = processes
        self._tasks = 0
        self.starts += 1

    def close(self) -> None:
        """Stop the ranks (politely, then by their handles)."""
        if self._context is None:
            return
        for inbox in self._inboxes:
            with contextlib.suppress(OSError, ValueError):
                inbox.put(None)
        deadline = time.monotonic() + 10
        for process in self._context:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for process in self._context or []:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        self._context = None

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(rank, world, *args)`` on every rank; the per-rank results."""
        if self._context is not None and self._tasks >= RECYCLE_AFTER:
            self.close()
        if self._context is None:
            self._start()
        self._number += 1
        self._tasks += 1
        number = self._number
        paths = [
            os.path.join(self._dir.name, f"task{number}-rank{r}.pt") for r in range(self.world)
        ]
        for rank, inbox in enumerate(self._inboxes):
            inbox.put((number, fn, args, paths[rank]))
        done: set[int] = set()
        deadline = time.monotonic() + TASK_TIMEOUT
        failed = False
        while len(done) < self.world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                got, rank, error = self._outbox.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                if any(not p.is_alive() for p in self._context):
                    break
                continue
            if got != number:
                continue
            done.add(rank)
            if not failed and error:
                failed = True
                deadline = min(deadline, time.monotonic() + ERROR_GRACE)
        results = []
        for rank in range(self.world):
            if rank in done:
                results.append(torch.load(paths[rank], weights_only=False))
                os.remove(paths[rank])
            else:
                results.append({"error": f"rank {rank} did not finish (stuck or dead)"})
        if failed or len(done) < self.world:
            self._kill()
        return results

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self._dir.cleanup()


class Pools:
    """One `RankPool` per world size, started on first use.

    Inside ``with Pools()`` this process computes with one thread (restored on exit): the
    ranks need the cores, and on a busy machine a second intra-op thread makes the
    one-process oracle several times slower, not faster.
    """

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}
        self._threads = torch.get_num_threads()

    def __getitem__(self, world: int) -> RankPool:
        if world not in self._pools:
            self._pools[world] = RankPool(world)
        return self._pools[world]

    def close(self) -> None:
        """Stop every pool."""
        for pool in self._pools.values():
            pool.__exit__()
        self._pools.clear()

    def __enter__(self) -> Pools:
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        torch.set_num_threads(self._threads)
