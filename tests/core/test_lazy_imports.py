"""``import dmuon`` and the command lines' ``--help`` do not import torch.

The packages ``dmuon``, ``dmuon.checkpoint``, ``dmuon.optim``, ``dmuon.plan`` and
``dmuon.train`` import what they export on first
use (`dmuon._lazy`). The oracle for "fast" is which modules a fresh interpreter holds, not a
clock: after ``--help`` of ``python -m dmuon.plan`` and ``python -m dmuon.train`` (the
``dmuon-train`` script's entry point), ``torch`` is not among them. Each exported name is
the object its defining module holds, and the ``if TYPE_CHECKING:`` imports the API
reference and type checkers read name the same objects as the lazy table. A recipe run
refused for its input does not load DCP, DTensor or torch's compiler either.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[2] / "packages" / "dmuon-core" / "src"
PACKAGES = ("dmuon", "dmuon.checkpoint", "dmuon.optim", "dmuon.plan", "dmuon.train")

_HELP_THEN_MODULES = """
import runpy, sys
sys.argv = [{module!r}, "--help"]
try:
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
except SystemExit as exit_:
    assert exit_.code in (0, None), exit_.code
print(sorted(name for name in sys.modules if name == "torch" or name.startswith("torch.")))
"""


@pytest.mark.parametrize("module", ["dmuon.plan", "dmuon.train"])
def test_help_answers_without_importing_torch(module: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _HELP_THEN_MODULES.format(module=module)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    *help_text, loaded = done.stdout.strip().splitlines()
    assert any("usage:" in line for line in help_text), done.stdout[:500]
    assert loaded == "[]", f"--help of {module} imported {loaded}"


_REFUSED_THEN_MODULES = """
import sys
from dmuon.train.__main__ import main
code = main(["--model", "tiny", "--data", {data!r}])
heavy = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo")
print(code, sorted(name for name in heavy if name in sys.modules))
"""


def test_a_refused_run_loads_neither_checkpointing_nor_the_compiler(tmp_path: Path) -> None:
    """A recipe run refused for its input (here a data path that is not there) answers
    without DCP, DTensor or torch's compiler: those come with the first checkpoint and the
    first optimizer (torch's own ``add_param_group`` loads the compiler), not at import."""
    missing = tmp_path / "no-such-corpus"
    done = subprocess.run(
        [sys.executable, "-c", _REFUSED_THEN_MODULES.format(data=str(missing))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert str(missing) in done.stderr, done.stderr[-2000:]
    code, loaded = done.stdout.strip().splitlines()[-1].split(" ", 1)
    assert code == "2", done.stdout
    assert loaded == "[]", f"a refused run imported {loaded}"


def test_a_bare_import_of_dmuon_holds_no_torch_and_reaches_subpackages() -> None:
    probe = (
        "import sys, dmuon; before = 'torch' in sys.modules; "
        "optim = dmuon.optim; print(before, optim.__name__, dmuon.Muon.__module__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.split() == ["False", "dmuon.optim", "dmuon.optim._muon"]


def _type_checking_imports(package: str) -> dict[str, str]:
    path = SOURCE / Path(*package.split(".")) / "__init__.py"
    tree = ast.parse(path.read_text())
    guard = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
    )
    return {
        alias.asname or alias.name: node.module
        for node in guard.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


@pytest.mark.parametrize("package", PACKAGES)
def test_every_export_is_its_modules_object(package: str) -> None:
    module = importlib.import_module(package)
    table = module._EXPORTS
    assert sorted(table) == sorted(module.__all__)
    assert _type_checking_imports(package) == table
    for name, home in table.items():
        assert getattr(module, name) is getattr(importlib.import_module(home), name), name
    assert set(module.__all__) <= set(dir(module))


@pytest.mark.parametrize("package", PACKAGES)
def test_an_unknown_name_is_an_attribute_error(package: str) -> None:
    module = importlib.import_module(package)
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018
    assert not hasattr(module, "no_such_name")
