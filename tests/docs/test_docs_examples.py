"""The docs' code-block markers and launch commands, and that every page with runnable
examples has its test module (the examples themselves run in ``test_docs_examples_<page>``
modules; see ``docs_examples``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_examples import (
    EXAMPLES,
    LAUNCH,
    MARKER_ERRORS,
    page_module,
    script_name,
)
from docs_md import DOCS, SHELL_LANGS, CodeBlock, code_blocks, en_pages, rel, zh_pages


def test_markers_are_valid() -> None:
    assert not MARKER_ERRORS, "\n".join(MARKER_ERRORS)


def test_norun_blocks_show_their_reason() -> None:
    """A block that is not run must tell readers why, in the admonition right above it."""
    problems: list[str] = []
    for page in [*en_pages(), *zh_pages()]:
        for block in code_blocks(page):
            if block.marker_kind != "norun":
                continue
            where = ("zh/" if page in zh_pages() else "") + block.where
            if not block.marker_arg:
                problems.append(f"{where}: norun without a reason")
            elif block.marker_arg not in block.text_above:
                problems.append(
                    f"{where}: reason {block.marker_arg!r} is not in an admonition directly "
                    f"above the block (found {block.text_above!r})"
                )
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [*en_pages(), *zh_pages()], ids=lambda p: str(p.relative_to(DOCS)))
def test_multiprocess_examples_show_how_to_launch_them(page: Path) -> None:
    """A ``run: torchrun N`` script shows its file name, and the next block on the page is
    the command that launches it on N processes (run with ``python``, it would stop with
    "environment variable RANK expected")."""
    blocks = code_blocks(page)
    problems = []
    for i, block in enumerate(blocks):
        if block.marker_kind != "run" or not block.marker_arg.startswith("torchrun"):
            continue
        nproc = int(block.marker_arg.split()[1]) if len(block.marker_arg.split()) > 1 else 2
        name = script_name(block)
        if not name:
            problems.append(f'{block.where}: no file name (give the fence title="NAME.py")')
            continue
        following = blocks[i + 1] if i + 1 < len(blocks) else None
        shown = [] if following is None else launch_commands_of(following)
        if (nproc, name) not in shown:
            problems.append(
                f"{block.where}: the next block must launch it: "
                f"torchrun --standalone --nproc_per_node {nproc} {name}"
            )
    assert not problems, "\n".join(problems)


def launch_commands_of(block: CodeBlock) -> list[tuple[int, str]]:
    """(N, script) of every torchrun line of one shell block."""
    if block.lang not in SHELL_LANGS:
        return []
    found = []
    for line in block.code.splitlines():
        match = LAUNCH.match(line.strip())
        if match:
            found.append((int(match.group("nproc")), match.group("script")))
    return found


def test_docs_have_examples() -> None:
    assert len(EXAMPLES) >= 10, [e.id for e in EXAMPLES]
    assert any(e.launcher.startswith("torchrun") for e in EXAMPLES)
    pages = {rel(p) for p in en_pages()}
    assert "gradient-accumulation.md" in pages


def test_every_page_with_examples_has_its_test_module() -> None:
    """A page's examples run only from its module: a page without one would go untested."""
    here = Path(__file__).parent
    pages = sorted({e.blocks[0].page for e in EXAMPLES})
    missing = [
        f"{page_module(p)}.py ({p})" for p in pages if not (here / f"{page_module(p)}.py").exists()
    ]
    assert not missing, "add these modules:\n" + "\n".join(missing)
    stale = {p.stem for p in here.glob("test_docs_examples_*.py")} - {page_module(p) for p in pages}
    assert not stale, f"modules of pages without examples: {sorted(stale)}"
