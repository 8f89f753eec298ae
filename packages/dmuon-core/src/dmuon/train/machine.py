"""What the recipe reads from and sets on the machine it runs on: CPU threads, the
dtype names of its flags, known peak FLOP/s (for ``mfu``) and the peak memory so far."""

from __future__ import annotations

import os
import resource
import sys

import torch

__all__ = ["DTYPES", "KNOWN_PEAK_TFLOPS", "configure_threads", "peak_memory_bytes"]

#: Dense bfloat16 peak TFLOP/s of one device, by a part of its CUDA name, for ``mfu``.
KNOWN_PEAK_TFLOPS: dict[str, float] = {"H100": 989.0, "H200": 989.0, "B200": 2250.0,
                                       "A100": 312.0}  # fmt: skip

#: The recipe's dtype names (``auto`` is absent: the library's default).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def configure_threads(local_world_size: int, threads: int | None = None) -> int:
    """Set the intra-op thread count of this process and return it.

    ``threads`` wins when given. Otherwise, unless ``OMP_NUM_THREADS`` is set, the CPU
    cores available to the process are split evenly among the local processes.
    (``torchrun`` sets ``OMP_NUM_THREADS=1`` itself when it starts several processes.)
    """
    if threads is not None:
        torch.set_num_threads(threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not available on macOS
            cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // max(1, local_world_size)))
    return torch.get_num_threads()


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA's allocator peak, else the peak resident set."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
