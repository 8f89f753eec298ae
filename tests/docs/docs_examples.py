"""The docs' runnable examples and how one runs: every Python code block of the docs runs on
CPU, or says visibly why it cannot.

Blocks are read from the English pages (the Chinese pages carry the same code, checked by
the parity test). See ``docs_md`` for the markers. A multi-process example shows readers
its file name and the ``torchrun`` command that launches it, and runs here as each command
the page shows for that file (with its arguments).

Each page's examples are the tests of a module of their own, ``test_docs_examples_<page>.py``
(made by :func:`page_example_tests`), so the pytest workers share the pages between them;
a page's single-process examples run together in one interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from accounts import folder_of
from conftest import NORMAL_ACCOUNT, account_env, docs_env, normal_account, run_shell_script
from docs_md import (
    DOCS,
    PYTHON_LANGS,
    SHELL_LANGS,
    CodeBlock,
    code_blocks,
    en_pages,
)

TIMEOUT_S = 240
ERROR_PREFIXES = ("ValueError: ", "RuntimeError: ", "TypeError: ")
LAUNCH = re.compile(
    r"^torchrun --standalone --nproc[_-]per[_-]node[ =](?P<nproc>\d+) (?P<script>\S+\.py)"
    r"(?P<args>(?: [^#]*?)?)\s*(?:#.*)?$"
)


@dataclass
class Example:
    """One script run by the tests: a block, plus the blocks that continue it."""

    blocks: list[CodeBlock] = field(default_factory=list)
    launcher: str = "python"  # "python", "torchrun N" or "bash"
    args: tuple[str, ...] = ()  # the script's arguments in the launch command it runs as

    @property
    def id(self) -> str:
        where = self.blocks[0].where
        return f"{where} {' '.join(self.args)}" if self.args else where

    @property
    def script(self) -> str:
        return "\n".join(b.code for b in self.blocks)


def collect() -> tuple[list[Example], list[CodeBlock], list[str]]:
    """Runnable examples, blocks marked norun, and marker errors."""
    examples: list[Example] = []
    skipped: list[CodeBlock] = []
    errors: list[str] = []
    for page in en_pages():
        # What "run: continue" extends: the latest single-process Python example, or the
        # latest shell example, of the page.
        last: dict[str, Example] = {}
        for block in code_blocks(page):
            kind, arg = block.marker_kind, block.marker_arg
            is_python = block.lang in PYTHON_LANGS
            if kind == "norun":
                skipped.append(block)
                continue
            if kind == "run" and arg == "continue":
                family = "bash" if block.lang in SHELL_LANGS else "python"
                if family not in last:
                    errors.append(f"{block.where}: 'run: continue' with nothing to continue")
                else:
                    last[family].blocks.append(block)
                continue
            if kind == "run" and arg == "bash":
                if block.lang not in SHELL_LANGS:
                    errors.append(f"{block.where}: 'run: bash' on a {block.lang} block")
                last["bash"] = Example([block], "bash")
                examples.append(last["bash"])
                continue
            if kind == "run" and arg.startswith("torchrun"):
                if not is_python:
                    errors.append(f"{block.where}: 'run: {arg}' on a {block.lang} block")
                commands = launch_commands(page).get(script_name(block), [])
                for args in dict.fromkeys(args for _, args in commands) or [()]:
                    examples.append(Example([block], arg, args))
                continue
            if kind == "run":
                errors.append(f"{block.where}: unknown marker 'run: {arg}'")
                continue
            if is_python:
                last["python"] = Example([block], "python")
                examples.append(last["python"])
    return examples, skipped, errors


def script_name(block: CodeBlock) -> str:
    """The file name a script block shows: its fence title, or a first line ``# name.py``."""
    if block.title:
        return block.title
    first = block.code.splitlines()[0] if block.code.strip() else ""
    match = re.fullmatch(r"#\s*(\S+\.py)\s*", first)
    return match.group(1) if match else ""


def launch_commands(page: Path) -> dict[str, list[tuple[int, tuple[str, ...]]]]:
    """Every ``torchrun --standalone --nproc_per_node N SCRIPT ARGS`` line of the page's shell
    blocks: script -> [(N, ARGS)]."""
    commands: dict[str, list[tuple[int, tuple[str, ...]]]] = {}
    for block in code_blocks(page):
        if block.lang not in SHELL_LANGS:
            continue
        for line in block.code.splitlines():
            match = LAUNCH.match(line.strip())
            if match:
                args = tuple(shlex.split(match.group("args")))
                commands.setdefault(match.group("script"), []).append(
                    (int(match.group("nproc")), args)
                )
    return commands


EXAMPLES, SKIPPED, MARKER_ERRORS = collect()


def _command(example: Example, script: Path) -> list[str]:
    if example.launcher == "python":
        return [sys.executable, str(script)]
    if example.launcher == "bash":
        return ["bash", "-euo", "pipefail", str(script)]
    nproc = example.launcher.split()[1] if len(example.launcher.split()) > 1 else "2"
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(script),
        *example.args,
    ]


@dataclass
class Outcome:
    ok: bool
    stdout: str
    stderr: str
    how: str


@functools.cache
def single_process_outcomes(page: str) -> dict[str, Outcome]:
    """Run every single-process Python example of ``page`` in one interpreter (see
    example_runner)."""
    with tempfile.TemporaryDirectory(prefix="dmuon-docs-examples-") as folder:
        root = Path(folder)
        jobs = []
        mine = [e for e in EXAMPLES if e.launcher == "python" and e.blocks[0].page == page]
        for i, example in enumerate(mine):
            workdir = root / f"ex{i}"
            workdir.mkdir()
            jobs.append({"id": example.id, "script": example.script, "dir": str(workdir)})
        jobs_file = root / "jobs.json"
        jobs_file.write_text(json.dumps(jobs), encoding="utf-8")
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("example_runner.py")), str(jobs_file)],
            cwd=root,
            env=docs_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S * 2,
        )
        out_file = Path(str(jobs_file) + ".out")
        results = json.loads(out_file.read_text(encoding="utf-8")) if out_file.exists() else {}
    outcomes = {}
    for job in jobs:
        r = results.get(job["id"])
        if r is None:  # the runner itself died before reaching this example
            outcomes[job["id"]] = Outcome(False, proc.stdout, proc.stderr, "example runner")
        else:
            outcomes[job["id"]] = Outcome(r["ok"], r["stdout"], r["stderr"], "python")
    return outcomes


def _starts_the_job_service(example: Example) -> bool:
    return example.launcher == "bash" and "dmuon-server " in example.script


def _run_as_a_normal_account(example: Example, tmp_path: Path) -> Outcome:
    """Run a shell session that starts the job service as a person on a workstation would.

    Under root, the tests' account, a server refuses to start until told which account
    runs its jobs (job-service.md#isolation): the page is written for a normal account,
    so it runs as one (and as the tests' own account when that is not root).
    """
    account = normal_account()
    if account is None:
        if os.geteuid() == 0:
            pytest.skip("the job service's examples need a normal account to run as (useradd)")
        return _run_shell_session(example, tmp_path, docs_env(), None)
    # pytest's own folders are the tests' account's alone: the session gets one in /tmp.
    with folder_of(account, "dmuon-page-") as folder:
        return _run_shell_session(example, folder, account_env(folder), account)


def _run_shell_session(
    example: Example, folder: Path, env: dict[str, str], account: tuple[int, int] | None
) -> Outcome:
    script = folder / "example.sh"
    script.write_text(example.script, encoding="utf-8")
    who = f"as {NORMAL_ACCOUNT}, " if account is not None else ""
    try:
        code, out, err = run_shell_script(script, env, TIMEOUT_S, account)
    except subprocess.TimeoutExpired:
        return Outcome(False, "", "", f"bash {who}timed out after {TIMEOUT_S} s")
    return Outcome(code == 0, out, err, f"bash {who}exit code {code}")


def _run_alone(example: Example, tmp_path: Path) -> Outcome:
    if _starts_the_job_service(example):
        return _run_as_a_normal_account(example, tmp_path)
    suffix = ".sh" if example.launcher == "bash" else ".py"
    script = tmp_path / f"example{suffix}"
    script.write_text(example.script, encoding="utf-8")
    # A session of its own, so that a timeout ends everything the example started (a
    # background server, torchrun and its workers), not only the shell or launcher.
    env = docs_env()
    env["TMPDIR"] = str(tmp_path)  # torchrun's log folder (one per launch, left) goes there
    proc = subprocess.Popen(
        _command(example, script),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                stdout, stderr = proc.communicate(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            stdout, stderr = "", ""
        return Outcome(False, stdout, stderr, f"{example.launcher}, timed out after {TIMEOUT_S} s")
    how = f"{example.launcher}, exit code {proc.returncode}"
    return Outcome(proc.returncode == 0, stdout, stderr, how)


def check_example(example: Example, tmp_path: Path) -> None:
    """Run ``example`` (or take its outcome from its page's interpreter) and check it."""
    if example.launcher == "python":
        outcome = single_process_outcomes(example.blocks[0].page)[example.id]
    else:
        outcome = _run_alone(example, tmp_path)
    if not outcome.ok:
        output = outcome.stdout + outcome.stderr
        # torchrun ends with its own summary; the ranks' errors come earlier in the output.
        errors = [line for line in output.splitlines() if "Error" in line][:20]
        pytest.fail(
            f"docs example {example.id} failed ({outcome.how})\n"
            f"--- script ---\n{textwrap.indent(example.script, '    ')}\n"
            f"--- error lines ---\n" + "\n".join(errors) + "\n"
            f"--- output (tail) ---\n{output[-4000:]}"
        )
    # An example that prints error messages shows real ones: each must be on its page.
    page = (DOCS / example.blocks[0].page).read_text(encoding="utf-8")
    printed = [line for line in outcome.stdout.splitlines() if line.startswith(ERROR_PREFIXES)]
    missing = [line for line in printed if line not in page]
    assert not missing, f"{example.id}: messages not shown on the page:\n" + "\n".join(missing)


def page_module(page: str) -> str:
    """The name of the test module of ``page``'s examples."""
    return "test_docs_examples_" + page.removesuffix(".md").replace("-", "_").replace("/", "_")


def page_example_tests(page: str) -> Callable[[Example, Path], None]:
    """The test of ``page``'s examples, for its module to hold as ``test_example_runs``."""
    mine = [e for e in EXAMPLES if e.blocks[0].page == page]
    assert mine, f"{page} has no runnable example: remove {page_module(page)}.py"

    @pytest.mark.parametrize("example", mine, ids=[e.id for e in mine])
    def test_example_runs(example: Example, tmp_path: Path) -> None:
        check_example(example, tmp_path)

    return test_example_runs
