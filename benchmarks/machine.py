"""Where a benchmark ran: recorded next to every result."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from dmuon.optim import cpu_bf16_unit, cpu_has_native_bf16


def machine_info() -> dict[str, Any]:
    """The CPU (and GPU, where CUDA sees one), torch version and load average of a run."""
    first_cpu = _first_cpu_fields()
    info: dict[str, Any] = {
        "cpu": first_cpu.get("model name") or platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(),
        "bf16_unit": cpu_bf16_unit(),
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()),
    }
    # Family and model tell CPUs apart that report the same name (two EPYCs, both "AMD
    # EPYC", ran the same bfloat16 products 1.6 to 2.4 times as fast as each other).
    for field, key in (("cpu family", "cpu_family"), ("model", "cpu_model")):
        if first_cpu.get(field, "").isdigit():
            info[key] = int(first_cpu[field])
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def _first_cpu_fields(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The fields of the first processor in ``path`` (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields
