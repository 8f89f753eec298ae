"""Leave the interpreter only when gloo's worker threads no longer need it.

A gloo collective's work object is released twice: by Python after ``wait()``, and a moment
later by the process group's worker thread (``pt_gloo_runloop``). When the worker drops the
last reference to a tensor whose Python object Python has already released (FSDP2's
all-gather buffers are such tensors), it must take the GIL to free that object. If the
interpreter has started finalizing by then, taking the GIL ends the thread from inside a
destructor and the process aborts with "terminate called without an active exception",
after all of the script's work is done. With more ranks than cores the worker can lag by
milliseconds, long enough to lose that race.

`before_interpreter_exit` runs at ``atexit``, while the interpreter is still whole: it
collects reference cycles, then gives up the GIL in short sleeps until every gloo worker
thread is idle, so a lagging worker finishes before finalization begins.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

GLOO_WORKER_THREAD = "pt_gloo_runloop"
IDLE_POLLS_NEEDED = 3
"""Consecutive polls, each after a sleep, that must find every gloo worker idle."""
POLL_INTERVAL_S = 0.002
WAIT_LIMIT_S = 2.0
"""Longest the wait lasts: a worker stuck in a collective never goes idle."""

_TASKS = Path("/proc/self/task")


def gloo_workers_running() -> int | None:
    """How many gloo worker threads of this process are running or runnable now.

    Returns None where the thread list cannot be read (no ``/proc``: not Linux).
    A worker waiting for work, for a peer or for the GIL is sleeping and does not count.
    """
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return None
    running = 0
    for task in tasks:
        try:
            if (task / "comm").read_text().strip() != GLOO_WORKER_THREAD:
                continue
            # The state follows the parenthesized thread name, which may contain spaces.
            state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended while we looked
        running += state == "R"
    return running


def wait_for_idle_gloo_workers(limit_s: float = WAIT_LIMIT_S) -> bool:
    """Sleep in short steps, releasing the GIL, until every gloo worker thread is idle.

    A worker blocked on the GIL shows as sleeping, so one idle poll proves nothing; each of
    ``IDLE_POLLS_NEEDED`` consecutive idle polls follows a sleep in which such a worker
    could take the GIL and finish. Returns whether the workers went idle within
    ``limit_s`` (True after the first sleep where threads cannot be listed: there is
    nothing to wait on).
    """
    deadline = time.monotonic() + limit_s
    idle_polls = 0
    while idle_polls < IDLE_POLLS_NEEDED:
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_INTERVAL_S)
        running = gloo_workers_running()
        if running is None:
            return True
        idle_polls = idle_polls + 1 if running == 0 else 0
    return True


def before_interpreter_exit() -> None:
    """Collect reference cycles, then let gloo's worker threads finish (see the module)."""
    gc.collect()
    wait_for_idle_gloo_workers()
