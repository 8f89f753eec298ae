"""Package attributes imported on first use (PEP 562).

``import dmuon`` and ``python -m dmuon.plan --help`` must not pay for importing torch: a
package's ``__init__`` names what it exports and where each lives, and the module holding
it is imported when the name is first read. Type checkers and the API reference read the
same names from the package's ``if TYPE_CHECKING:`` imports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(
    package: str, exports: Mapping[str, str], namespace: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``exports`` maps each exported name to
    the module defining it; any other name is tried as a submodule (``dmuon.optim`` after a
    bare ``import dmuon``). A name read once is stored in ``namespace``, so the lookup runs
    once per name."""

    def attribute(name: str) -> Any:
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif not name.startswith("__"):
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def names() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return attribute, names
