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
* ``FAKE_CRASH_ONCE=1``: crash only in a run that did not resume from a checkpoint.
* ``FAKE_CRASH_SEED``: crash only in a run with that ``--seed``.
* ``FAKE_CRASH_SIGNAL``: instead of raising, the crashing rank kills itself with that
  signal number (9: as the out-of-memory killer would).
* ``FAKE_FINAL_SECONDS``: after the last step and its checkpoint, spend that long in a
  final phase (the recipe's last evaluation and exit) in which SIGTERM kills at once
  (exit status 143 through torchrun), as the recipe's does.
* ``FAKE_EVENT_STEP``: after that step, write a ``checkpoint_skipped`` and a
  ``checkpoint_failed`` event line as the recipe does (naming the checkpoint folder).
* ``--sample-every N``: after every N-th step and the last, a ``sample`` event line whose
  text names the step (two lines).
* ``FAKE_POISON_SEED``: a run with that ``--seed`` writes, after step 2, the lines that
  once froze supervision (:data:`POISON_LINES`), then goes on.

Checkpoints follow the recipe's contract with ``--checkpoint-dir``: rank 0 writes
``.tmp_step_XXXXXXXX/state.json`` (step and a "weight" that each step updates
deterministically) and renames it to ``step_XXXXXXXX`` every ``--checkpoint-every`` steps
and at the end, keeping the newest ``--keep-checkpoints``; ``--resume auto`` continues
after the latest one (dropping the metrics lines of later steps first), ``--init-from``
takes its weight and starts at step 1. SIGTERM: finish the step, save, write
``{"event": "stopped", ...}`` and exit 0; a second SIGTERM exits at once. Every point
carries ``metrics_file`` (the file's name) and ``weight`` so tests can tell runs apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import dmuon_recipe_contract as contract

#: Lines no server may store: nested 5,000 deep, a 400-digit loss, a lone surrogate escape
#: in a point and in a summary line.
POISON_LINES = (
    '{"step": 3, "x": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"step": 100, "loss": ' + "9" * 400 + "}",
    '{"step": 101, "loss": 1.0, "note": "\\ud800"}',
    '{"summary": {"name": "\\udfff"}}',
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fake_train")
    p.add_argument("--model", choices=["tiny", "small", "base", "moe"], required=True)
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
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--on-checkpoint-error", choices=["stop", "warn"], default="stop")
    p.add_argument("--collective-timeout", type=int, default=600)
    p.add_argument("--resume", default="auto")
    p.add_argument("--init-from", default=None)
    p.add_argument("--tracking-dir", default=None)
    p.add_argument("--report-to", default="none")
    p.add_argument("--run-name", default=None)
    p.add_argument("--sample-every", type=int, default=0)
    p.add_argument("--sample-prompt", default="The")
    p.add_argument("--sample-tokens", type=int, default=32)
    return p


def _checkpoints(folder: str | None) -> list[Path]:
    if folder is None or not os.path.isdir(folder):
        return []
    found = [
        p
        for p in Path(folder).iterdir()
        if re.fullmatch(r"step_[0-9]{8}", p.name)
        and contract.is_complete_checkpoint(p)
        and not contract.checkpoint_problems(p, checksums=True)
    ]
    return sorted(found, key=lambda p: p.name)


def _load(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())


def _save(folder: str, step: int, weight: float, keep: int) -> Path:
    final = Path(folder) / f"step_{step:08d}"
    if final.exists():
        return final
    tmp = Path(folder) / f".tmp_step_{step:08d}"
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "state.json").write_text(json.dumps({"step": step, "weight": weight}))
    # What makes a recipe checkpoint complete (the contract): DCP's metadata, rank 0's
    # trainer state, and the manifest of every file's size and checksum, written last.
    (tmp / contract.DCP_METADATA_FILE).write_bytes(b"fake dcp metadata")
    (tmp / contract.TRAINER_STATE_FILE).write_bytes(json.dumps({"step": step}).encode())
    files = {
        f.name: {"bytes": f.stat().st_size, "sha256": contract.file_sha256(f)}
        for f in sorted(tmp.iterdir())
    }
    (tmp / contract.MANIFEST_FILE).write_text(json.dumps({"format": 1, "files": files}))
    os.replace(tmp, final)
    if keep > 0:
        for old in _checkpoints(folder)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _truncate_after(path: str, step: int) -> None:
    """Drop the metrics lines of steps after ``step`` (rewrite and replace)."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("step"), int) and obj["step"] > step:
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


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
    # Server paths a log may hold (the interpreter, the standard library), on both streams.
    where = f"fake_train runs {sys.executable} with {os.__file__}"
    print(where, flush=True)
    print(where, file=sys.stderr, flush=True)
    weight = float(args.seed)
    first = 1
    resume_from = None
    if args.resume == "auto":
        found = _checkpoints(args.checkpoint_dir)
        resume_from = found[-1] if found else None
    elif args.resume != "never":
        resume_from = Path(args.resume)
    if resume_from is not None and args.init_from is not None:
        print("error: --init-from and a checkpoint to resume from", file=sys.stderr)
        return 2
    if resume_from is not None:
        state = _load(resume_from)
        weight, first = state["weight"], state["step"] + 1
        print(f"resuming from {resume_from} at step {first}", flush=True)
        if rank == 0:
            _truncate_after(args.metrics_file, state["step"])
    elif args.init_from is not None:
        weight = _load(Path(args.init_from))["weight"]
    if os.environ.get("FAKE_CRASH_ONCE") == "1" and resume_from is not None:
        crash_rank = -1
    if os.environ.get("FAKE_CRASH_SEED", str(args.seed)) != str(args.seed):
        crash_rank = -1
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_signal.append(signum)
        signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once

    if os.environ.get("FAKE_IGNORE_SIGTERM") != "1":
        signal.signal(signal.SIGTERM, on_signal)
    out = open(args.metrics_file, "a") if rank == 0 else None  # noqa: SIM115
    t0 = time.time()
    tokens = args.micro_batch_size * args.accum_steps * world * args.seq_len

    def write(obj: dict) -> None:
        if out is not None:
            out.write(json.dumps(obj) + "\n")
            out.flush()

    if args.eval_every > 0 and first == 1:
        write({"step": 0, "loss": None, "time": 0.0, "val_loss": 5.0})
    name = os.path.basename(args.metrics_file)
    loss = math.nan
    for step in range(first, steps + 1):
        time.sleep(step_s)
        if rank == crash_rank and step == crash_step:
            msg = os.environ.get("FAKE_CRASH_MESSAGE", "fake crash")
            print(f"rank {rank} about to crash at step {step}", flush=True)
            if os.environ.get("FAKE_CRASH_SIGNAL"):
                os.kill(os.getpid(), int(os.environ["FAKE_CRASH_SIGNAL"]))
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
        weight = weight * 0.9 + step * 0.01
        rec["weight"] = weight
        rec["metrics_file"] = name
        if args.eval_every > 0 and (step % args.eval_every == 0 or step == steps):
            rec["val_loss"] = loss + 0.05
        write(rec)
        if args.sample_every > 0 and (step % args.sample_every == 0 or step == steps):
            text = f" sample of step {step}\n  second line"
            write({"event": "sample", "step": step, "prompt": args.sample_prompt, "text": text})
        if step == int(os.environ.get("FAKE_EVENT_STEP", "-1")):
            folder = Path(args.checkpoint_dir or ".")
            write(
                {
                    "event": "checkpoint_skipped",
                    "checkpoint": str(folder / "step_00000004"),
                    "problems": ["__0_0.distcp has 10 bytes, 20 were written"],
                    "step": step,
                }
            )
            write(
                {
                    "event": "checkpoint_failed",
                    "step": step,
                    "message": "the checkpoint of "
                    f"step {step} could not be written to {folder} (No space left on device)",
                }
            )
        if step == 2 and os.environ.get("FAKE_POISON_SEED") == str(args.seed) and out:
            out.write("\n".join(POISON_LINES) + "\n")
            out.flush()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss:.4f}", flush=True)
        every = args.checkpoint_every
        if rank == 0 and args.checkpoint_dir and every > 0 and step % every == 0:
            _save(args.checkpoint_dir, step, weight, args.keep_checkpoints)
        if stop_signal:
            saved = None
            if rank == 0 and args.checkpoint_dir:
                saved = _save(args.checkpoint_dir, step, weight, args.keep_checkpoints)
            event = {"event": "stopped", "step": step, "signal": "SIGTERM"}
            write({**event, "checkpoint": str(saved) if saved else None, "loss": None})
            if out is not None:
                out.close()
            return 0
    if rank == 0 and args.checkpoint_dir and steps >= first:
        _save(args.checkpoint_dir, steps, weight, args.keep_checkpoints)
    if os.environ.get("FAKE_FINAL_SECONDS"):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(float(os.environ["FAKE_FINAL_SECONDS"]))
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
