"""A stand-in for ``python -m dmuon.train`` that starts in milliseconds (no torch).

Honours the recipe's flags and metrics-file contract (rank 0 appends one JSON object per
optimizer step, flushed per line; ``val_loss`` on eval steps and a step-0 eval line when
``--eval-every`` > 0; a final summary line). Behaviour knobs, from the environment:

* ``FAKE_STEP_SECONDS`` (default 0.02): sleep per step.
* ``FAKE_MAX_STEPS``: cap on the steps actually run (for fuzzing with huge ``--steps``).
* ``FAKE_CRASH_RANK`` / ``FAKE_CRASH_STEP`` / ``FAKE_CRASH_CODE``: that rank raises at that
  step (prints a traceback with ``FAKE_CRASH_MESSAGE``, records the exception in torchrun's
  error file as the recipe's ``@record`` entry point does) and exits with the code.
* ``FAKE_NAN_STEP``: the loss of that step is NaN (written as the JSON token ``NaN``).
* ``FAKE_IGNORE_SIGTERM=1``: ignore SIGTERM (the supervisor must escalate to SIGKILL).
* ``FAKE_PARTIAL_TAIL=1``: end the file with a line without newline (a summary).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fake_train")
    p.add_argument("--model", choices=["tiny", "small", "base"], required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--micro-batch-size", type=int, required=True)
    p.add_argument("--accum-steps", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--lr", type=float, required=True)
    p.add_argument("--adamw-lr", type=float, required=True)
    p.add_argument("--optimizer", choices=["dmuon", "adamw"], required=True)
    p.add_argument("--mode", choices=["z2", "z3"], required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--metrics-file", required=True)
    p.add_argument("--data", default=None)
    return p


def _record(exc: BaseException, stack: str) -> None:
    """Write torchrun's error file in the format of its ``ErrorHandler.record_exception``."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    message = {
        "message": f"{type(exc).__name__}: {exc}",
        "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))},
    }
    with open(path, "w") as f:
        json.dump({"message": message}, f)


def main() -> int:
    """Run the fake training loop."""
    args = _parser().parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if os.environ.get("FAKE_IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    step_s = float(os.environ.get("FAKE_STEP_SECONDS", "0.02"))
    steps = min(args.steps, int(os.environ.get("FAKE_MAX_STEPS", str(args.steps))))
    crash_rank = int(os.environ.get("FAKE_CRASH_RANK", "-1"))
    crash_step = int(os.environ.get("FAKE_CRASH_STEP", "1"))
    nan_step = int(os.environ.get("FAKE_NAN_STEP", "-1"))
    print(f"fake_train rank {rank}/{world} starting: {args}", flush=True)
    out = open(args.metrics_file, "a") if rank == 0 else None  # noqa: SIM115
    t0 = time.time()
    tokens = args.micro_batch_size * args.accum_steps * world * args.seq_len

    def write(obj: dict) -> None:
        if out is not None:
            out.write(json.dumps(obj) + "\n")
            out.flush()

    if args.eval_every > 0:
        write({"step": 0, "loss": None, "time": 0.0, "val_loss": 5.0})
    for step in range(1, steps + 1):
        time.sleep(step_s)
        if rank == crash_rank and step == crash_step:
            msg = os.environ.get("FAKE_CRASH_MESSAGE", "fake crash")
            print(f"rank {rank} about to crash at step {step}", flush=True)
            try:
                raise RuntimeError(msg)
            except RuntimeError as exc:
                import traceback

                traceback.print_exc()
                _record(exc, traceback.format_exc())
            sys.stderr.flush()
            return int(os.environ.get("FAKE_CRASH_CODE", "3"))
        loss = 5.0 * math.exp(-step / 20) + 0.1
        if step == nan_step:
            loss = float("nan")
        rec = {
            "step": step,
            "loss": loss,
            "lr": args.lr,
            "tokens_per_s": tokens / step_s if step_s else 1e9,
            "grad_norm": 1.0 / step,
            "time": time.time() - t0,
            "extra_key": "tolerated",
        }
        if args.eval_every > 0 and (step % args.eval_every == 0 or step == steps):
            rec["val_loss"] = loss + 0.05
        write(rec)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
    if out is not None:
        tail = json.dumps({"summary": {"steps": steps, "final_loss": loss}})
        if os.environ.get("FAKE_PARTIAL_TAIL") == "1":
            out.write(tail)  # no newline: the server must still take it at the end
        else:
            out.write(tail + "\n")
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
