"""What every launcher does so that a job on a full data directory still gets its end recorded.

A job that fills the data directory's disk (checkpoints, logs, metrics) also leaves the
server's database no room: the job's last points cannot be stored, and neither can its
outcome. Each launcher therefore

* keeps following a job whose points cannot be stored (:meth:`FullDisk.poll`): they wait
  in the job's file, read again later, and whether the job ended must still be seen;
* judges, once per ended attempt and before writing anything, whether the disk was full
  (:meth:`FullDisk.full_at_end`): the failure's reason then names the full disk and the
  attempt is not retried;
* records the outcome through :meth:`FullDisk.record`, which gives back the server's
  reserve (:class:`~dmuon_server.storage.datadir.SpaceReserve`) when the write fails on a full
  disk and writes once more, at once, before anything else takes the space.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from dmuon_server.config import Settings
from dmuon_server.storage.datadir import SpaceReserve, disk_full
from dmuon_server.storage.store import StoreFull

log = logging.getLogger("dmuon_server.launching.factory")

T = TypeVar("T")


class FullDisk:
    """The reserve of one launcher and what it knows about its jobs on a full disk."""

    def __init__(self, settings: Settings) -> None:
        """A reserve of ``settings.disk_reserve_bytes`` in ``settings.data_dir``."""
        self.reserve = SpaceReserve(settings.data_dir, settings.disk_reserve_bytes)
        #: Whether the disk was full when a job's attempt was seen to end (kept until the
        #: attempt is recorded, over rounds whose writes fail).
        self._full_at_end: dict[str, bool] = {}
        self._logged: set[str] = set()

    def replenish(self) -> None:
        """Take the reserve's space again where there is room (once per round)."""
        self.reserve.replenish()

    def poll(self, job_id: str, poll: Callable[[], int]) -> int:
        """``poll()`` (a metrics read that stores points), or 0 when the database is full."""
        try:
            polled = poll()
        except StoreFull:
            if job_id not in self._logged:
                self._logged.add(job_id)
                log.warning("job %s: its metrics wait in its file: the disk is full", job_id)
            return 0
        self._logged.discard(job_id)
        return polled

    def full_at_end(self, job_id: str, job_dir: Path) -> bool:
        """Whether the disk was full when the job's attempt ended (judged once, the reserve's
        bytes set apart once it was given back)."""
        return self._full_at_end.setdefault(job_id, disk_full(job_dir, self.reserve))

    def record(self, job_id: str, write: Callable[[], T]) -> T:
        """``write()``; on a full database, give the reserve back and ``write()`` again."""
        try:
            return write()
        except StoreFull as e:
            if not self.reserve.release():
                raise
            log.warning("job %s: %s; gave back the %d-byte reserve to record how it ended",
                        job_id, e, self.reserve.size)  # fmt: skip
            return write()

    def forget(self, job_id: str) -> None:
        """The job's attempt is recorded: drop what was kept for it."""
        self._full_at_end.pop(job_id, None)
        self._logged.discard(job_id)
