"""``python help_runner.py TARGET...``: run ``TARGET --help`` for each target in this one
interpreter (so torch is imported once) and print one JSON object: ``{target: [exit
status, output]}``. A target ending in ``.py`` is a script, run as ``__main__`` with its
folder on ``sys.path``; any other is a module, run as ``python -m`` runs it."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path


def help_of(target: str) -> tuple[int | str, str]:
    """The exit status of ``target --help`` (or the exception it raised) and its output."""
    out = io.StringIO()
    script = target.endswith(".py")
    sys.argv = [target, "--help"]
    sys.path.insert(0, str(Path(target).parent) if script else "")
    status: int | str = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            if script:
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
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
