"""``python help_runner.py SCRIPT...``: run ``SCRIPT --help`` for each script in this one
interpreter (so torch is imported once), as ``__main__`` with its folder on ``sys.path``,
and print one JSON object: ``{script: [exit status, output]}``."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path


def help_of(script: str) -> tuple[int | str, str]:
    """The exit status of ``script --help`` (or the exception it raised) and its output."""
    out = io.StringIO()
    sys.argv = [script, "--help"]
    sys.path.insert(0, str(Path(script).parent))
    status: int | str = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else str(e.code))
    except BaseException as e:  # reported; the next script runs
        status = f"{type(e).__name__}: {e}"
    finally:
        sys.path.pop(0)
    return status, out.getvalue()


if __name__ == "__main__":
    results = {script: help_of(script) for script in sys.argv[1:]}
    sys.stdout = sys.__stdout__
    print(json.dumps(results))
