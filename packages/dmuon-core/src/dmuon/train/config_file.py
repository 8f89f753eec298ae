"""``--config run.toml``: the recipe's flags from a TOML file.

Every flag is a key, spelled as its field (``micro_batch_size``) or as its option without
the dashes (``micro-batch-size``); tables group keys for people and are read as if their
keys stood at the top (``[training] steps = 100`` is ``steps = 100``). A switch is
``true`` or ``false``. The file's values go through the same parser as the command
line's, which comes after them: a flag given on the command line overrides the file.

The run writes the resolved settings back as TOML (`dump`): beside the metrics file
(``<metrics stem>.config.toml``) and into every checkpoint (``config.toml``), so a run
can be repeated from either with ``--config``. The job service takes the same keys as a
job's ``train`` spec.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import tomllib
from dmuon_recipe_contract import FLAGS

#: The checkpoint's copy of the resolved settings.
CHECKPOINT_CONFIG_FILE = "config.toml"
_SPECS = {spec.dest: spec for spec in FLAGS}


class ConfigFileError(ValueError):
    """A config file the recipe cannot use; the message names the file and the key."""


def _flatten(table: Mapping[str, Any], path: Path) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        items = value.items() if isinstance(value, dict) else [(key, value)]
        for name, item in items:
            if isinstance(item, dict):
                raise ConfigFileError(
                    f"{path}: [{key}.{name}] nests tables two deep; keep flags at the top or "
                    "in one level of tables"
                )
            dest = name.replace("-", "_")
            if dest in flat:
                raise ConfigFileError(f"{path}: {name!r} is given twice")
            flat[dest] = item
    return flat


def _closest(key: str) -> str | None:
    """The flag a mistyped ``key`` most likely meant, or None."""
    found = difflib.get_close_matches(key, list(_SPECS), n=1, cutoff=0.6)
    if not found:  # a prefix: micro_batch for micro_batch_size
        found = sorted(f for f in _SPECS if f.startswith(key) or key.startswith(f))[:1]
    return found[0] if found else None


def read(path: str | Path) -> dict[str, Any]:
    """The flags of the TOML file ``path``, ``{field: value}``; raises
    :class:`ConfigFileError` naming the file and the key."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise ConfigFileError(f"--config: cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"--config: {path} is not TOML: {e}") from None
    values = _flatten(table, path)
    unknown = sorted(k for k in values if k not in _SPECS)
    if unknown:
        said = ", ".join(
            key + (f" (did you mean {guess}?)" if (guess := _closest(key)) else "")
            for key in unknown
        )
        raise ConfigFileError(
            f"--config {path}: {said} are no flags of the recipe "
            "(keys are the flags' names, e.g. micro_batch_size or micro-batch-size; see "
            "python -m dmuon.train --help)"
        )
    return values


def argv(values: Mapping[str, Any], path: str | Path) -> list[str]:
    """``values`` as command-line arguments (a switch set to ``false`` gives none)."""
    out: list[str] = []
    for dest, value in values.items():
        spec = _SPECS[dest]
        if spec.kind == "bool":
            if not isinstance(value, bool):
                raise ConfigFileError(f"--config {path}: {dest} is a switch: true or false")
            out += [spec.option] if value else []
            continue
        if isinstance(value, bool | list | dict) or value is None:
            raise ConfigFileError(
                f"--config {path}: {dest} takes one {spec.kind} value, not {value!r}"
            )
        out += [spec.option, str(value)]
    return out


def split(arguments: Sequence[str]) -> tuple[str | None, list[str]]:
    """``(--config's path or None, the other arguments)``."""
    rest: list[str] = []
    path = None
    items = list(arguments)
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--config" and i + 1 < len(items):
            path, i = items[i + 1], i + 2
            continue
        if item.startswith("--config="):
            path = item.split("=", 1)[1]
        else:
            rest.append(item)
        i += 1
    return path, rest


def dump(config: Any) -> str:
    """A resolved `dmuon.train.cli.TrainConfig` as TOML (settings left unset omitted),
    readable by ``--config``."""
    lines = ["# The resolved settings of a dmuon.train run: python -m dmuon.train --config FILE"]
    names = {f.name for f in fields(config)}
    for dest, value in asdict(config).items():
        if dest not in names or dest not in _SPECS or value is None:
            continue
        if _SPECS[dest].kind == "bool" and not value:
            continue
        lines.append(f"{dest} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"
