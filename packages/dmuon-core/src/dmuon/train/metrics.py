"""Metrics file and console progress of the recipe (rank 0 only).

Metrics file format (``--metrics-file``, the only channel the job server reads): one JSON
object per line, appended and flushed line by line.

* One line per optimizer step ``s >= 1`` with the keys ``step`` (int), ``loss`` (mean
  training loss over the global batch), ``lr`` (the scheduled rate used for this step:
  the Muon rate ``--lr`` under dmuon, ``--adamw-lr`` under the adamw baseline),
  ``adamw_lr`` (under dmuon only: AdamW's scheduled rate, for the embeddings, norms and
  head),
  ``tokens_per_s`` (global tokens of the step / its wall time), ``grad_norm`` (global L2
  norm of the gradient before the update), ``time`` (seconds since training started,
  after setup), ``peak_memory_bytes`` (a list: each rank's peak memory so far, index =
  rank; CUDA's allocator peak, or the process's peak resident set on CPU), ``mfu``
  (model FLOPs utilization, only where a peak is known: ``--peak-tflops``, or a known
  CUDA device in bfloat16), and on evaluation steps also ``val_loss``.
* When evaluation is on (``--eval-every`` > 0), one extra line **before** the first step:
  ``{"step": 0, "loss": null, "lr": null, "tokens_per_s": null, "grad_norm": null,
  "time": ..., "val_loss": ...}`` carrying the validation loss of the initial weights.
  Every line therefore has all the keys; only the step-0 line has nulls.

* On a graceful stop (SIGTERM or SIGINT), one last line
  ``{"event": "stopped", "step": k, "signal": "SIGTERM", "checkpoint": "<path or null>"}``
  with the other required keys null. Lines with an ``event`` key are not metric points.
* A run resumed from the checkpoint of step ``k`` first drops the lines with a step above
  ``k`` (`truncate_after`), then appends from step ``k + 1``: the file never holds a step
  twice.

Non-finite floats (a diverged run) are written as the strings ``"NaN"``, ``"Infinity"``
and ``"-Infinity"``, so every line stays strict JSON and a diverged value is told apart
from a missing one (``null``). The job server uses the same strings in its API.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import dmuon_recipe_contract as contract

__all__ = [
    "REQUIRED_KEYS",
    "MetricsWriter",
    "ProgressReporter",
    "format_summary",
    "point_step",
    "truncate_after",
]

REQUIRED_KEYS = contract.METRIC_KEYS
"""Keys present on every line of the metrics file (`dmuon_recipe_contract.METRIC_KEYS`)."""


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        if math.isnan(value):
            return "NaN"
        return "Infinity" if value > 0 else "-Infinity"
    return value


def truncate_after(path: str | os.PathLike[str], step: int) -> int:
    """Drop the lines of metrics file ``path`` whose step is above ``step``; return the count.

    Lines that are not JSON objects with an integer ``step`` (a line cut short by a killed
    process) are dropped too. The file is rewritten to a temporary file and swapped in with
    ``os.replace``, so a crash leaves the old or the new file, never a mix. A missing file
    is left missing.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            keep = isinstance(record, dict) and isinstance(record.get("step"), int)
            keep = keep and record["step"] <= step
        except json.JSONDecodeError:
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)
    return dropped


class MetricsWriter:
    """Append one JSON object per call to a file, flushing each line.

    A writer created with ``path=None`` (non-zero ranks, or no ``--metrics-file``) does
    nothing.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        """Open ``path`` for appending (creating parent folders), or do nothing if None."""
        self.path = Path(path) if path is not None else None
        self._handle: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Write ``record`` as one line; missing required keys are filled with null."""
        if self._handle is None:
            return
        line = {key: None for key in REQUIRED_KEYS}
        line.update({key: _clean(value) for key, value in record.items()})
        self._handle.write(json.dumps(line, allow_nan=False) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def point_step(record: Mapping[str, Any]) -> int | None:
    """The step of a metrics line that is a metric point; ``None`` for an event line."""
    step = record.get("step")
    if contract.EVENT_KEY in record or isinstance(step, bool) or not isinstance(step, int):
        return None
    return step


class ProgressReporter:
    """A tqdm bar on a terminal, plain lines otherwise; silent when disabled.

    Args:
        total_steps: optimizer steps of the run.
        enabled: False on non-zero ranks.
        use_bar: force the bar on or off; by default on iff stderr is a terminal.
        log_every: in plain mode, print every ``log_every`` steps (and the last one).
        initial: steps already done (a resumed run starts its bar there).
        clock: seconds from a fixed point (``time.monotonic``); plain lines give the time
            since this reporter was made and the remaining time at the rate so far.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        enabled: bool = True,
        use_bar: bool | None = None,
        log_every: int = 1,
        initial: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Create the bar (if any) for ``total_steps`` steps."""
        self.total_steps = total_steps
        self._clock = clock
        self._started = clock()
        self._initial = initial
        self.enabled = enabled
        self.log_every = max(1, log_every)
        self._bar: Any = None
        if enabled and (sys.stderr.isatty() if use_bar is None else use_bar):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=initial,
                desc="train",
                unit="step",
                dynamic_ncols=True,
            )

    def message(self, text: str) -> None:
        """Print a line without breaking the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def warning(self, text: str) -> None:
        """Print ``dmuon-train: warning: text`` on stderr without breaking the bar."""
        if not self.enabled:
            return
        line = f"dmuon-train: warning: {text}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def write(self, record: Mapping[str, Any]) -> None:
        """Show one metrics line, as `dmuon.train.reporting.Reporting` hands it to every
        reporter: a step's progress, a validation loss, a sample (other events are the
        trainer's to word)."""
        if record.get(contract.EVENT_KEY) == contract.SAMPLE_EVENT:
            text = f"{record.get('prompt') or ''}{record.get('text') or ''}"
            self.message(f"step {record.get('step')} sample: {text!r}")
            return
        step = point_step(record)
        if step is None:
            return
        if isinstance(record.get("val_loss"), float):
            self.message(f"step {step} val_loss {record['val_loss']:.4f}")
        if record.get("loss") is not None:
            self.step(
                step, record["loss"], record["tokens_per_s"], record["lr"], record.get("adamw_lr")
            )

    def step(
        self,
        step: int,
        loss: float,
        tokens_per_s: float,
        lr: float,
        adamw_lr: float | None = None,
    ) -> None:
        """Report a finished optimizer step (``adamw_lr``: AdamW's rate for the parameters
        Muon does not update, under dmuon)."""
        if not self.enabled:
            return
        if self._bar is not None:
            rates = {"lr": f"{lr:.3g}"}
            if adamw_lr is not None:
                rates["adamw_lr"] = f"{adamw_lr:.3g}"
            self._bar.set_postfix(
                loss=f"{loss:.4f}", **rates, tok_s=f"{tokens_per_s:,.0f}", refresh=False
            )
            self._bar.update(1)
        elif step % self.log_every == 0 or step == self.total_steps:
            print(self.plain_line(step, loss, tokens_per_s, lr, adamw_lr), flush=True)

    def plain_line(
        self,
        step: int,
        loss: float,
        tokens_per_s: float,
        lr: float,
        adamw_lr: float | None = None,
    ) -> str:
        """The line a plain log gets for ``step``: progress, loss, both learning rates,
        rate, elapsed and ETA (at the rate of the steps this process ran, not counting
        those a resume skipped)."""
        from tqdm import tqdm

        elapsed = self._clock() - self._started
        done = step - self._initial
        remaining = (self.total_steps - step) * elapsed / done if done > 0 else None
        percent = 100 * step / self.total_steps if self.total_steps else 100.0
        eta = tqdm.format_interval(remaining) if remaining is not None else "?"
        return (
            f"step {step}/{self.total_steps} ({percent:.0f}%) loss {loss:.4f} lr {lr:.3g} "
            + (f"adamw_lr {adamw_lr:.3g} " if adamw_lr is not None else "")
            + f"tokens/s {tokens_per_s:,.0f} elapsed {tqdm.format_interval(elapsed)} eta {eta}"
        )

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable final summary of `dmuon.train.run`'s result."""
    lines = [
        f"done: {summary['steps']} steps, {summary['train_time_s']:.1f} s training "
        f"({summary['wall_time_s']:.1f} s with evaluation), "
        f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['world_size']} process(es), "
        f"optimizer {summary['optimizer']}, model {summary['model']} "
        f"({summary['params'] / 1e6:.2f} M params)",
        f"final train loss {summary['final_loss']:.4f}",
    ]
    if summary.get("resumed_from"):
        lines.append(f"resumed from {summary['resumed_from']}")
    if summary.get("stopped_by"):
        lines.append(
            f"stopped by {summary['stopped_by']} after step {summary['steps']}; "
            f"checkpoint {summary.get('checkpoint') or 'none (no --checkpoint-dir)'}"
        )
    elif summary.get("checkpoint"):
        lines.append(f"checkpoint {summary['checkpoint']}")
    if summary.get("export"):
        lines.append(f"export {summary['export']}")
    start, end = summary.get("start_val_loss"), summary.get("end_val_loss")
    if start is not None and end is not None:
        drop = (start - end) / start * 100 if start else float("nan")
        lines.append(f"validation loss: start {start:.4f} -> end {end:.4f} ({drop:.1f}% lower)")
    return "\n".join(lines)
