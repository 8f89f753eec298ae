"""Run many single-process docs examples in one interpreter, each as if on its own.

``python example_runner.py JOBS.json`` reads ``[{"id", "script", "dir"}, ...]``. Every script
runs as ``__main__`` in a fresh namespace, in its own working folder, with its stdout and
stderr captured, and a process group it leaves open is destroyed. The results (``ok``,
``stdout``, ``stderr`` with the traceback) are written to ``JOBS.json.out``. Importing torch
once instead of once per example is what makes the docs suite fit its time budget.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback


def run_one(script: str, workdir: str, name: str) -> dict[str, object]:
    out, err = io.StringIO(), io.StringIO()
    ok = True
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = compile(script, name, "exec")
                exec(code, {"__name__": "__main__", "__file__": name})
            except SystemExit as e:
                ok = e.code in (None, 0)
                if not ok:
                    traceback.print_exc()
            except BaseException:
                ok = False
                traceback.print_exc()
    finally:
        os.chdir(cwd)
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    return {"ok": ok, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    path = sys.argv[1]
    # Every page's examples import torch and dmuon, and their optimizers torch's compiler:
    # imported first, out of the garbage collector's reach, they cost less CPU time, and
    # the collections the examples cause skip them (see dmuon._startup).
    from dmuon._startup import imports_kept_for_life

    with imports_kept_for_life():
        import torch._dynamo  # noqa: F401

        import dmuon._ownership.runtime
        import dmuon.optim._muon  # noqa: F401
    with open(path, encoding="utf-8") as f:
        jobs = json.load(f)
    results = {}
    for job in jobs:
        results[job["id"]] = run_one(job["script"], job["dir"], job["id"])
        with open(path + ".out", "w", encoding="utf-8") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
