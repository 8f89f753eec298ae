"""The GPUs of the host and who holds which: ``--gpus auto|none|LIST`` and the allocator.

A job of ``k`` processes on a server with GPUs takes ``k`` free devices, one per process,
and its processes see only those (``CUDA_VISIBLE_DEVICES``). Which devices are free is not
kept anywhere: it is what the active jobs' records do not hold, so a restart, a crash or a
``kill -9`` of the server can leak none.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from collections.abc import Iterable

log = logging.getLogger("dmuon_server.scheduling.gpus")

_NVIDIA_SMI_TIMEOUT_S = 20.0


class GpuSpecError(ValueError):
    """A ``--gpus`` value that names no devices the server can use."""


def detect() -> tuple[int, ...]:
    """The devices NVML reports (``pynvml``, when installed), else ``nvidia-smi``; none on
    a host without either."""
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        try:
            return tuple(range(int(pynvml.nvmlDeviceGetCount())))
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # not installed, or no driver: ask nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ()
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("nvidia-smi did not answer (%s): no GPUs", e)
        return ()
    if out.returncode != 0:
        log.warning("nvidia-smi failed (%s): no GPUs", out.stderr.strip())
        return ()
    return tuple(sorted(int(x) for x in out.stdout.split() if x.strip().isdigit()))


def parse(value: str) -> tuple[int, ...]:
    """The devices ``--gpus`` names: ``auto`` (:func:`detect`), ``none``, or a list of
    distinct indices such as ``0,1,2,3``."""
    text = value.strip().lower()
    if text == "auto":
        return detect()
    if text == "none":
        return ()
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        raise GpuSpecError(
            f"--gpus {value!r}: give auto, none, or device indices separated by commas (0,1,2,3)"
        )
    devices = [int(p) for p in parts]
    if len(set(devices)) != len(devices):
        raise GpuSpecError(f"--gpus {value!r} names a device twice")
    return tuple(devices)


def allocate(devices: Iterable[int], busy: Iterable[int], count: int) -> list[int] | None:
    """The ``count`` lowest free devices, or None when fewer are free (0: an empty list)."""
    taken = set(busy)
    free = [d for d in devices if d not in taken]
    return free[:count] if len(free) >= count else None
