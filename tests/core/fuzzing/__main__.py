"""``make fuzz``: generate and check cases for ``FUZZ_MINUTES`` minutes (default 5).

Prints every case it runs (one line: number, seconds, result, the case), and for each
failure the shrunk counterexample hypothesis found. ``FUZZ_SEED`` picks the first seed
(default: from the clock, printed); each round of `ROUND` examples takes the next one.
Exits 1 if any case failed.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from fuzzing.cases import Case
from fuzzing.pool import Pools
from fuzzing.property import check_cases

ROUND = 50


def _print_case(number: int, case: Case, seconds: float, ok: bool) -> None:
    print(f"case {number:5d} {seconds:6.2f}s {'ok  ' if ok else 'FAIL'} {case!r}", flush=True)


def main() -> int:
    minutes = float(os.environ.get("FUZZ_MINUTES", "5"))
    seed = int(os.environ.get("FUZZ_SEED", str(int(time.time()) % 100_000)))
    stop_at = time.monotonic() + 60 * minutes
    print(f"fuzzing for {minutes:g} minutes from seed {seed}", flush=True)
    ran = failed = 0
    counterexamples: list[str] = []
    with Pools() as pools:
        while time.monotonic() < stop_at:
            print(f"-- round seed {seed}", flush=True)
            try:
                tally = check_cases(
                    pools, max_examples=ROUND, seed=seed, stop_at=stop_at, on_case=_print_case
                )
                ran += tally.ran
            except Exception as exc:  # hypothesis's shrunk failure (or several)
                failed += 1
                text = "".join(traceback.format_exception(exc))
                counterexamples.append(text)
                print(f"== counterexample (round seed {seed}, shrunk):\n{text}", flush=True)
            seed += 1
    print(f"fuzzing done: {ran} cases in finished rounds, {failed} failing rounds", flush=True)
    for text in counterexamples:
        print(f"== counterexample:\n{text}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
