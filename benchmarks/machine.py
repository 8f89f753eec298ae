"""Where a benchmark ran: recorded next to every result."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from dmuon.optim import cpu_has_native_bf16


def bf16_unit() -> str | None:
    """The CPU unit that multiplies bfloat16 natively: ``"AMX-BF16"`` (preferred by oneDNN
    where both exist), ``"AVX512-BF16"``, or ``None`` where bfloat16 products are emulated."""
    probes = (("AMX-BF16", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    for unit, name in probes:
        probe = getattr(torch.cpu, name, None)
        if probe is not None and probe():
            return unit
    return None


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
        "bf16_unit": bf16_unit(),
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info
