"""Every collective of the library goes through ``dmuon/_comm.py``, where the audit counts
it and the collective-order check sees it.

The scan reads every module of ``packages/dmuon-core/src/dmuon`` except ``_comm.py`` and
its ``_comm_*.py`` pieces, resolves how each one names ``torch.distributed`` (``import
torch.distributed as dist``, ``from torch import distributed``, ``import torch`` then
``torch.distributed.x``, ``from torch.distributed import all_reduce``, the functional
collectives) and fails on any call of a collective. The recipe under ``dmuon/train/`` may
issue its own world-wide agreements (a loss average, a checkpoint's existence), which are
not dedicated-matrix traffic, only on a line that says so: ``# not audited: <why>`` on the
call's line or the line above it. So may ``dmuon/reference.py``, the algorithm written for
reading, which moves its own bytes with plain calls.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "packages" / "dmuon-core" / "src" / "dmuon"
EXEMPT_MARK = "# not audited:"

#: ``torch.distributed`` functions that communicate (data, objects, or a rendezvous).
COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_coalesced",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
        "all_gather_tensor",
        "reduce_scatter_tensor_coalesced",
        "permute_tensor",
    }
)
#: Modules whose attributes named as above are collectives.
DISTRIBUTED_MODULES = frozenset(
    {
        "torch.distributed",
        "torch.distributed.distributed_c10d",
        "torch.distributed._functional_collectives",
    }
)


def _module_aliases(tree: ast.Module) -> tuple[dict[str, str], dict[str, str]]:
    """``({local name: distributed module}, {local name: collective})`` a module binds."""
    modules: dict[str, str] = {}
    functions: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in DISTRIBUTED_MODULES and alias.asname:
                    modules[alias.asname] = alias.name
                elif alias.asname is None:
                    root = alias.name.split(".")[0]
                    modules.setdefault(root, root)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                local = alias.asname or alias.name
                if full in DISTRIBUTED_MODULES:
                    modules[local] = full
                elif node.module in DISTRIBUTED_MODULES and alias.name in COLLECTIVES:
                    functions[local] = alias.name
    return modules, functions


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` of every ``torch.distributed`` collective ``source`` calls."""
    tree = ast.parse(source)
    modules, functions = _module_aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in functions:
            found.append((node.lineno, func.id))
        elif isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
            owner = _dotted(func.value)
            if owner is None:
                continue
            head, _, rest = owner.partition(".")
            resolved = modules.get(head)
            if resolved is None:
                continue
            full = f"{resolved}.{rest}" if rest else resolved
            if full in DISTRIBUTED_MODULES:
                found.append((node.lineno, ast.unparse(func)))
    return sorted(found)


def _exempt(lines: list[str], line: int) -> bool:
    here = lines[line - 1]
    above = lines[line - 2] if line >= 2 else ""
    return EXEMPT_MARK in here or above.strip().startswith(EXEMPT_MARK)


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if not p.name.startswith("_comm"))


def test_the_scan_sees_every_way_of_naming_a_collective() -> None:
    source = "\n".join(
        [
            "import torch",
            "import torch.distributed as dist",
            "import torch.distributed as d2",
            "from torch import distributed",
            "from torch.distributed import all_reduce as ar, get_rank",
            "import torch.distributed._functional_collectives as funcol",
            "dist.all_reduce(x)",
            "d2.broadcast(x, 0)",
            "distributed.barrier()",
            "torch.distributed.gather(x)",
            "ar(x)",
            "funcol.all_reduce(x, 'sum', g)",
            "get_rank()",
            "dist.get_world_size()",
            "x.scatter(0, i, v)",
            "comm.all_reduce_control(x)",
        ]
    )
    assert [line for line, _ in direct_collectives(source)] == [7, 8, 9, 10, 11, 12]


def test_the_scan_reads_the_whole_package() -> None:
    modules = _modules()
    assert len(modules) > 90
    assert PACKAGE / "optim" / "_split_iteration.py" in modules
    assert direct_collectives((PACKAGE / "_comm.py").read_text()), "the scan finds _comm's calls"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_outside_comm_calls_a_collective(path: Path) -> None:
    text = path.read_text()
    lines = text.splitlines()
    may_exempt = path.is_relative_to(PACKAGE / "train") or path == PACKAGE / "reference.py"
    offending = [
        f"{path.relative_to(PACKAGE)}:{line}: {call}"
        for line, call in direct_collectives(text)
        if not (may_exempt and _exempt(lines, line))
    ]
    assert not offending, (
        "collectives outside dmuon/_comm.py bypass the audit and the collective-order check; "
        "add a Communicator method (or, in the recipe, say why on the line: "
        f"'{EXEMPT_MARK} ...'): {offending}"
    )
