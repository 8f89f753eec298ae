"""``--profile-steps A:B``: a torch.profiler trace of optimizer steps A to B.

Every rank records CPU activity (and CUDA's, on a GPU), memory and input shapes from the
start of step A to the end of step B, then writes a Chrome trace,
``<tracking dir>/tensorboard/profile/step_A-B/rank<r>.pt.trace.json``: TensorBoard's
profiler plugin lists it under the ``profile`` run, and Perfetto (ui.perfetto.dev) opens
the file. A job of the service serves it as a ``tracking`` artifact.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


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


class StepProfiler:
    """Starts the profiler before step A and writes its trace after step B."""

    def __init__(self, text: str | None, tracking_dir: Path, rank: int, device: torch.device):
        """``text`` is ``--profile-steps`` (None: nothing is recorded)."""
        self.steps = parse_steps(text) if text else None
        self.rank = rank
        self.device = device
        self.folder = tracking_dir / "tensorboard" / "profile"
        self._profile: profile | None = None
        #: Where the trace was written, once it was.
        self.trace: Path | None = None

    def before(self, step: int) -> None:
        """Start recording when ``step`` is the first profiled one."""
        if self.steps is None or step != self.steps[0]:
            return
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profile.__enter__()

    def after(self, step: int) -> None:
        """Stop and write the trace when ``step`` is the last profiled one."""
        if self._profile is None or self.steps is None or step != self.steps[1]:
            return
        recorded, self._profile = self._profile, None
        recorded.__exit__(None, None, None)
        folder = self.folder / f"step_{self.steps[0]}-{self.steps[1]}"
        folder.mkdir(parents=True, exist_ok=True)
        self.trace = folder / f"rank{self.rank}.pt.trace.json"
        recorded.export_chrome_trace(str(self.trace))

    def close(self) -> None:
        """Stop a recording the run ended inside (its trace is not written)."""
        if self._profile is not None:
            self._profile.__exit__(None, None, None)
            self._profile = None
