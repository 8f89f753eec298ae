"""Where a job's data may come from, and how server paths are shown to clients.

Clients never see the server's absolute paths: the data directory is shown as
``<data-dir>``, a job's folder as ``<job-dir>``, a data root as ``<data-root>``
(``<data-root-2>`` and so on when there are several), a model root as ``<model-root>`` and a
code root as ``<code-root>`` (likewise), the interpreter as ``python`` in a command line and
``<python>`` in text, its virtual environment as ``<venv>`` and the Python installation as
``<python-home>`` (the folders tracebacks of a job name).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from dmuon_server.config import Settings


class DataPathError(ValueError):
    """A path of a job spec that does not exist or lies outside its roots."""


def root_label(index: int, count: int, kind: str = "data") -> str:
    """The placeholder of root number ``index`` (0-based) out of ``count`` (``kind``:
    ``data``, ``model`` or ``code``): ``<data-root>``, or ``<data-root-2>``, ... when there
    are several."""
    return f"<{kind}-root>" if count == 1 else f"<{kind}-root-{index + 1}>"


def resolve_data_path(settings: Settings, data: str) -> Path:
    """Resolve ``data`` against the data roots and check that it stays inside one.

    A relative path is looked up in each root in turn; an absolute one must lie in a
    root once symlinks and ``..`` are resolved. Messages name the path as the client
    wrote it, never the resolved server path.
    """
    if not settings.data_roots:
        raise DataPathError(
            "this server accepts no data paths (it was started without --data-root); omit "
            "train.data to train on the recipe's built-in corpus"
        )
    return resolve_in_roots(settings.data_roots, data, "data")


def resolve_model_path(settings: Settings, path: str, what: str) -> Path:
    """Resolve a model directory or tokenizer path (``what``) against the model roots."""
    if not settings.model_roots:
        raise DataPathError(
            f"this server accepts no {what} paths (it was started without --model-root); "
            'train a preset (train.model: "tiny", ...) or ask for a server with '
            "--model-root"
        )
    return resolve_in_roots(settings.model_roots, path, "model")


def resolve_code_path(settings: Settings, script: str) -> Path:
    """Resolve a script's path against the code roots, as :func:`resolve_data_path` does
    with data: it must be a Python file (``.py``) inside a root once resolved."""
    if not settings.code_roots:
        raise DataPathError(
            "this server runs no scripts of its users (it was started without --code-root); "
            "use train to run the recipe, or ask for a server with --code-root"
        )
    path = resolve_in_roots(settings.code_roots, script, "code")
    if not path.is_file():
        raise DataPathError(f"{script!r} is a folder, not a Python file; give the script's file")
    if path.suffix != ".py":
        raise DataPathError(f"{script!r} is not a Python file (.py); give the script's file")
    return path


def resolve_in_roots(roots: tuple[Path, ...], data: str, kind: str) -> Path:
    """Resolve ``data`` inside one of ``roots`` (of ``kind`` ``data``, ``model`` or
    ``code``; see `resolve_data_path`)."""
    if "\x00" in data:
        raise DataPathError("the path contains a NUL character")
    candidates = (
        [Path(os.path.realpath(data))]
        if os.path.isabs(data)
        else [Path(os.path.realpath(root / data)) for root in roots]
    )
    labels = ", ".join(root_label(i, len(roots), kind) for i in range(len(roots)))
    inside = [c for c in candidates if any(c == r or c.is_relative_to(r) for r in roots)]
    if not inside:
        raise DataPathError(
            f"{data!r} lies outside the {kind} roots ({labels}); give a path inside one of "
            "them (relative paths are taken from the roots)"
        )
    for c in inside:
        try:
            if c.exists():
                return c
        except OSError as e:  # a name too long, a loop of symlinks...
            raise DataPathError(f"{data!r} cannot be read: {e.strerror or e}") from None
    raise DataPathError(f"{data!r} does not exist in the {kind} roots ({labels})")


def _installation(python: str) -> list[tuple[str, str]]:
    """The interpreter, its virtual environment and the Python installation, with their
    placeholders (each also under its real path, when a symbolic link leads to it)."""
    pairs = [(python, "<python>")]
    if sys.prefix != sys.base_prefix:
        pairs.append((sys.prefix, "<venv>"))
    pairs.append((sys.base_prefix, "<python-home>"))
    real = [(os.path.realpath(p), label) for p, label in pairs]
    return [(p, label) for p, label in pairs + real if p not in ("", "/")]


class PublicPaths:
    """Rewrites server paths in text shown to clients (see the module docstring)."""

    def __init__(self, settings: Settings, job_dir: Path | None = None) -> None:
        """Rewrite the paths of ``settings`` and, when given, ``job_dir``."""
        roots = settings.data_roots
        pairs: list[tuple[str, str]] = []
        if job_dir is not None:
            pairs.append((str(job_dir), "<job-dir>"))
        pairs.append((str(settings.data_dir), "<data-dir>"))
        pairs += [(str(r), root_label(i, len(roots))) for i, r in enumerate(roots)]
        models = settings.model_roots
        pairs += [(str(r), root_label(i, len(models), "model")) for i, r in enumerate(models)]
        code = settings.code_roots
        pairs += [(str(r), root_label(i, len(code), "code")) for i, r in enumerate(code)]
        pairs += _installation(settings.python)
        # Longest first, so a job folder wins over the data directory it lies in; a path
        # is replaced only where it ends (so /data does not match /database).
        pairs = sorted(dict(pairs).items(), key=lambda p: len(p[0]), reverse=True)
        self._pattern = re.compile(
            "|".join(f"({re.escape(path)})(?![^/\\s'\"`:;,)\\]}}>])" for path, _ in pairs)
        )
        self._labels = [label for _, label in pairs]
        self._python = settings.python

    def text(self, value: str) -> str:
        """``value`` with every known server path replaced by its placeholder."""
        return self._pattern.sub(lambda m: self._labels[m.lastindex - 1], value)  # type: ignore[operator]

    def argv(self, argv: list[str]) -> list[str]:
        """A command line as clients see it."""
        return ["python" if a == self._python else self.text(a) for a in argv]

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """Environment variables as clients see them."""
        return {k: self.text(v) for k, v in env.items()}
