"""Where a benchmark ran: recorded next to every result."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from dmuon.optim import cpu_bf16_unit, cpu_has_native_bf16


def machine_info() -> dict[str, Any]:
    """The CPU (and GPU, where CUDA sees one), torch version and load average of a run."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(),
        "bf16_unit": cpu_bf16_unit(),
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info
