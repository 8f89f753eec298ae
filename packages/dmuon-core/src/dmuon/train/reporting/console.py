"""The recipe's console output (rank 0 only): a tqdm bar on a terminal or plain progress
lines, and the final summary."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import dmuon_recipe_contract as contract

from dmuon.train.reporting.metrics_file import point_step

__all__ = ["ProgressReporter", "format_summary"]


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
