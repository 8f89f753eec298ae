"""What the recipe's event lines say, as a job's events show them.

The recipe writes an event line (``{"event": ..., ...}``, `dmuon_recipe_contract.EVENT_KEY`)
into its metrics file when something happened that is not a metric point: a damaged
checkpoint that ``--resume auto`` passed over (``checkpoint_skipped``), a checkpoint that
could not be written while ``--on-checkpoint-error warn`` kept training
(``checkpoint_failed``), a stop on a signal (``stopped``), the experiment trackers' runs
(``trackers``), a sample of the model's text (``sample``, kept as written). Each becomes one
:class:`~dmuon_server.storage.store.EventRecord` with a level and a one-line message; the first two
are warnings.
"""

from __future__ import annotations

import json
from pathlib import PurePath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import dmuon_recipe_contract as contract

from dmuon_server.storage.store import EventRecord

#: Events that say something went wrong while the run went on.
WARNING_EVENTS = frozenset({contract.CHECKPOINT_SKIPPED_EVENT, contract.CHECKPOINT_FAILED_EVENT})
#: Longest message kept (the recipe's are a few hundred characters).
MAX_MESSAGE_CHARS = 2000


def _name(path: Any) -> str:
    """The folder name of a checkpoint path (the job's folders are the server's)."""
    return PurePath(str(path)).name if path else "?"


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def _store(uri: Any) -> str:
    """An MLflow tracking URI as clients may see it: a local store by its file name (server
    paths are not shown; the job's own is ``tracking/mlflow.db``), a remote one without
    credentials."""
    text = str(uri)
    scheme, _, rest = text.partition(":")
    if scheme in ("sqlite", "file", "") or not rest.startswith("//"):
        return f"a local store ({PurePath(rest).name})" if rest else "?"
    parsed = urlsplit(text)
    host = parsed.hostname or ""
    netloc = host + (f":{parsed.port}" if parsed.port else "")
    return urlunsplit((parsed.scheme, netloc, parsed.path, "", ""))


def tracker_runs(trackers: Any) -> str:
    """Where each tracker's run is, in words: MLflow's run id and store, TensorBoard's
    folder in the job's, the W&B run path."""
    if not isinstance(trackers, dict) or not trackers:
        return "no tracker"
    parts = []
    for name, ids in trackers.items():
        ids = ids if isinstance(ids, dict) else {}
        if name == "mlflow":
            parts.append(f"mlflow run {ids.get('run_id')} at {_store(ids.get('tracking_uri'))}")
        elif name == "tensorboard":
            logdir = PurePath(str(ids.get("logdir", "?")))
            parts.append(f"tensorboard events in tracking/tensorboard/{logdir.name}")
        elif name == "wandb":
            parts.append(f"wandb run {ids.get('path')}")
        else:
            parts.append(str(name))
    return "; ".join(parts)


def describe(obj: dict[str, Any], attempt: int) -> EventRecord:
    """The event of attempt ``attempt`` that the parsed line ``obj`` holds."""
    kind = str(obj.get(contract.EVENT_KEY))[:64]
    step = obj.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else None
    level = "warning" if kind in WARNING_EVENTS else "info"
    if kind == contract.CHECKPOINT_SKIPPED_EVENT:
        problems = obj.get("problems")
        why = "; ".join(map(str, problems)) if isinstance(problems, list) and problems else "?"
        message = f"skipped the damaged checkpoint {_name(obj.get('checkpoint'))}: {why}"
        if step is not None:
            message += f"; resumed from step {step}" if step else "; started from step 0"
    elif kind == contract.CHECKPOINT_FAILED_EVENT:
        message = str(obj.get("message") or f"the checkpoint of step {step} was not written")
    elif kind == contract.SAMPLE_EVENT:  # text as written, line breaks included
        text = f"{obj.get('prompt') or ''}{obj.get('text') or ''}"
        return EventRecord(attempt, kind, level, text[:MAX_MESSAGE_CHARS], step)
    elif kind == contract.TRACKERS_EVENT:
        message = "reporting to " + tracker_runs(obj.get("trackers"))
    elif kind == contract.STOPPED_EVENT:
        by = obj.get("signal") or "a signal on another rank"
        saved = obj.get("checkpoint")
        message = f"stopped by {by} after step {step}" + (
            f", saved checkpoint {_name(saved)}" if saved else ", no checkpoint saved"
        )
    else:
        rest = {k: v for k, v in obj.items() if k != contract.EVENT_KEY}
        message = f"{kind}: {json.dumps(rest, sort_keys=True)}" if rest else kind
    return EventRecord(attempt, kind, level, _clip(message), step)
