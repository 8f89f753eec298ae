"""The time model of a cluster plan: what one accelerator computes and sends per second."""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Share of the dense bfloat16 peak a well-shaped Newton-Schulz product reaches
#: (600 of H100's 989 TFLOP/s), used to derive the Newton-Schulz rate of other hardware.
NS_EFFICIENCY = 600 / 989

#: Share of the peak that forward and backward reach (model FLOPs utilisation), as
#: measured: see `MFU_SOURCE`. ``python -m dmuon.plan --mfu`` sets another.
DEFAULT_MFU = 0.34

MFU_SOURCE = (
    "34% measured for a 1.24B Hugging Face Llama on one H200 (sdpa, bfloat16 autocast, no "
    "compile); torchtitan publishes 33-39% for Llama-3.1-8B on 8 to 128 H100s without Float8"
)
"""Where `DEFAULT_MFU` comes from, printed with every plan that uses it."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator of the cluster, as the plan's time model sees it.

    Attributes:
        name: What the plan prints.
        peak_tflops: Dense bfloat16 peak, TFLOP/s.
        ns_tflops: The rate Newton-Schulz's batched products run at, TFLOP/s.
        network_gbps: Bytes per second one accelerator sends between nodes, GB/s.
        memory_gib: Accelerator memory, GiB.
        mfu: Share of the peak that forward and backward reach.
        latency_us: What every collective call costs on top of its bytes, microseconds.
        node_gbps: Bytes per second one accelerator sends inside its node (tensor
            parallelism's gathers and scatters, a shard group that fits in a node), GB/s.
        node_size: Accelerators per node: a group of more consecutive ranks crosses nodes.
    """

    name: str
    peak_tflops: float
    ns_tflops: float
    network_gbps: float
    memory_gib: float
    mfu: float = DEFAULT_MFU
    latency_us: float = 20.0
    node_gbps: float = 450.0
    node_size: int = 8

    def describe(self) -> str:
        """One line with every number of the time model."""
        measured = f" ({MFU_SOURCE})" if self.mfu == DEFAULT_MFU else " (--mfu)"
        return (
            f"{self.name}: Newton-Schulz at {self.ns_tflops:g} TFLOP/s, forward+backward at "
            f"{self.mfu:.0%} of {self.peak_tflops:g} TFLOP/s{measured}, "
            f"{self.network_gbps:g} GB/s between nodes and {self.node_gbps:g} GB/s inside a "
            f"node of {self.node_size} per accelerator, {self.latency_us:g} us per collective "
            f"call, {self.memory_gib:g} GiB of memory"
        )


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", 989.0, 600.0, 50.0, 80.0),
    "h200": Hardware("h200", 989.0, 600.0, 50.0, 141.0),
    "b200": Hardware("b200", 2250.0, round(2250.0 * NS_EFFICIENCY), 100.0, 180.0, node_gbps=900.0),
}
"""The presets of ``--hardware``: H100 and H200 (SXM, 989 TFLOP/s dense bfloat16,
Newton-Schulz at 600, 400 Gb/s per GPU between nodes, NVLink at 450 GB/s per direction
inside a node, 80 and 141 GiB), B200 (2,250 TFLOP/s, Newton-Schulz at the same share of
the peak, 800 Gb/s, NVLink at 900 GB/s, 180 GiB); every collective call costs 20 us
besides its bytes."""

_CUSTOM = re.compile(r"^\s*(?P<tflops>\d+(\.\d+)?)\s*,\s*(?P<gbps>\d+(\.\d+)?)\s*$")


def parse_hardware(text: str) -> Hardware:
    """``h100``, ``h200``, ``b200``, or ``TFLOPS,GBPS`` (peak and network of another
    accelerator; Newton-Schulz is then taken at `NS_EFFICIENCY` of the peak, with H100's
    80 GiB of memory).

    Raises:
        ValueError: Neither a preset nor two positive numbers.
    """
    key = text.strip().lower()
    if key in HARDWARE:
        return HARDWARE[key]
    match = _CUSTOM.match(key)
    if match is None or float(match["tflops"]) <= 0 or float(match["gbps"]) <= 0:
        raise ValueError(
            f"hardware {text!r} is neither one of {sorted(HARDWARE)} nor TFLOPS,GBPS (the dense "
            "bfloat16 peak in TFLOP/s and the network in GB/s per accelerator, such as 989,50)"
        )
    peak = float(match["tflops"])
    return Hardware(
        f"{peak:g} TFLOP/s", peak, round(peak * NS_EFFICIENCY, 1), float(match["gbps"]), 80.0
    )


_TOKENS = re.compile(r"^\s*(?P<number>\d+(\.\d+)?)\s*(?P<unit>[kKmMgGbB]?)\s*$")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}


def parse_tokens(text: str) -> int:
    """A token count such as ``4M`` (4,000,000), ``512k`` or ``1048576``.

    Raises:
        ValueError: Not a positive count.
    """
    match = _TOKENS.match(str(text))
    value = float(match["number"]) * _UNITS[match["unit"].lower()] if match else 0
    if value < 1:
        raise ValueError(
            f"tokens per step {text!r} is not a positive count such as 4M, 512k or 1048576"
        )
    return int(value)
