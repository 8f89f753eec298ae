"""``--profile-steps A:B`` and ``--memory-snapshot``: what optimizer steps A to B did.

``--profile-steps``: every rank records CPU activity (and CUDA's, on a GPU), memory and
input shapes from the start of step A to the end of step B, then writes a Chrome trace,
``<tracking dir>/tensorboard/profile/step_A-B/rank<r>.pt.trace.json``: TensorBoard's
profiler plugin lists it under the ``profile`` run, and Perfetto (ui.perfetto.dev) opens
the file.

``--memory-snapshot`` (steps A to B, or 1 to 1 without ``--profile-steps``), per rank
under ``<tracking dir>/memory/step_A-B/``: on a GPU, ``rank<r>.pickle``, the CUDA caching
allocator's snapshot with the stack of every allocation (pytorch.org/memory_viz opens
it); on CPU, ``rank<r>.json``, the peak tensor bytes of each phase of the steps
(forward and backward, the optimizer step), counted from torch.profiler's memory events
since the recording began. A job of the service serves both as ``tracking`` artifacts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

#: The phases of a step whose peak memory ``--memory-snapshot`` reports on CPU, as marked
#: around them in the training step (`phase`).
PHASES = ("forward_backward", "optimizer_step")
_PREFIX = "dmuon.phase."


def phase(name: str) -> Any:
    """Mark a phase of the step (a no-op unless a profiler records)."""
    return record_function(_PREFIX + name)


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` as ``(A, B)`` with ``1 <= A <= B``; raises ``ValueError`` saying how."""
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = 0
    if not sep or not 1 <= a <= b:
        raise ValueError(f"{text!r} is not a range of steps: give A:B with 1 <= A <= B, e.g. 10:12")
    return a, b


def phase_peaks(events: Any) -> dict[str, int]:
    """Per phase, the largest running sum of the CPU allocator's events inside its spans
    (bytes allocated since the recording began and not yet freed). The phases run one
    after the other, so one pass over the events in time order follows the spans."""
    spans = sorted(
        (e.start_ns(), e.end_ns(), e.name()[len(_PREFIX) :])
        for e in events
        if e.name().startswith(_PREFIX)
    )
    memory = sorted(
        (e.start_ns(), e.nbytes())
        for e in events
        if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    )
    peaks = dict.fromkeys(PHASES, 0)
    live = 0
    span = 0
    for when, nbytes in memory:
        live += nbytes
        while span < len(spans) and spans[span][1] < when:
            span += 1
        if span < len(spans) and spans[span][0] <= when:
            name = spans[span][2]
            peaks[name] = max(peaks.get(name, 0), live)
    return peaks


class StepProfiler:
    """Starts recording before step A; writes the trace and the memory snapshot after B."""

    def __init__(
        self,
        text: str | None,
        tracking_dir: Path,
        rank: int,
        device: torch.device,
        memory_snapshot: bool = False,
    ):
        """``text`` is ``--profile-steps`` (None: no trace); ``memory_snapshot``,
        ``--memory-snapshot``."""
        self.trace_steps = text is not None
        self.memory_snapshot = memory_snapshot
        self.steps = parse_steps(text) if text else (1, 1) if memory_snapshot else None
        self.rank = rank
        self.device = device
        self.folder = tracking_dir / "tensorboard" / "profile"
        self.memory_folder = tracking_dir / "memory"
        self._profile: profile | None = None
        self._cuda_history = False
        #: Where the trace was written, once it was.
        self.trace: Path | None = None
        #: Where the memory snapshot was written, once it was.
        self.snapshot: Path | None = None

    @property
    def _cuda_snapshot(self) -> bool:
        return self.memory_snapshot and self.device.type == "cuda"

    def before(self, step: int) -> None:
        """Start recording when ``step`` is the first profiled one."""
        if self.steps is None or step != self.steps[0]:
            return
        if self._cuda_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            self._cuda_history = True
        if self.trace_steps or (self.memory_snapshot and not self._cuda_snapshot):
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profile = profile(
                activities=activities, record_shapes=self.trace_steps, profile_memory=True
            )
            self._profile.__enter__()

    def after(self, step: int) -> str | None:
        """Stop and write what was asked for when ``step`` is the last profiled one; then
        a line saying where it went and how to open it (None otherwise)."""
        if self.steps is None or step != self.steps[1]:
            return None
        name = f"step_{self.steps[0]}-{self.steps[1]}"
        if self._cuda_history:
            self.snapshot = self._place(self.memory_folder / name, "pickle")
            torch.cuda.memory._dump_snapshot(str(self.snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self._cuda_history = False
        if self._profile is not None:
            recorded, self._profile = self._profile, None
            self._write(recorded, name)
        return self._where()

    def _write(self, recorded: profile, name: str) -> None:
        recorded.__exit__(None, None, None)
        assert self.steps is not None
        if self.memory_snapshot and not self._cuda_snapshot:
            self.snapshot = self._place(self.memory_folder / name, "json")
            peaks = phase_peaks(recorded.profiler.kineto_results.events())
            record = {"steps": list(self.steps), "rank": self.rank, "peak_bytes": peaks}
            self.snapshot.write_text(json.dumps(record, indent=2) + "\n")
        if self.trace_steps:
            self.trace = self._place(self.folder / name, "pt.trace.json")
            recorded.export_chrome_trace(str(self.trace))

    def _where(self) -> str:
        """Where this rank's files went, their sizes, and what opens them."""
        assert self.steps is not None
        lines = []
        if self.trace is not None:
            size = self.trace.stat().st_size / 2**20
            lines.append(
                f"profiler: steps {self.steps[0]}-{self.steps[1]} traced to {self.trace} "
                f"({size:.1f} MiB on this rank; every rank writes its own): open it in "
                "ui.perfetto.dev, or run tensorboard --logdir "
                f"{self.folder.parent} and choose the profile run"
            )
        if self.snapshot is not None:
            what = (
                "open it in pytorch.org/memory_viz"
                if self.snapshot.suffix == ".pickle"
                else "JSON: the peak bytes of each phase"
            )
            lines.append(f"memory snapshot written to {self.snapshot} ({what})")
        return "\n".join(lines)

    def _place(self, folder: Path, suffix: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"rank{self.rank}.{suffix}"

    def close(self) -> None:
        """Stop a recording the run ended inside (nothing is written)."""
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None
        if self._cuda_history:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._cuda_history = False
