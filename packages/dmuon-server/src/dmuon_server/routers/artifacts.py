"""A job's files: checkpoints, its HF export, metrics and logs, listed and served one by one.

Only those four kinds are served, and only files that resolve inside the job's folder:
a path with ``..``, a symbolic link, anything under a folder being written (``.tmp_...``,
a save in progress) or any other file of the folder (``spec.json``, ``exit.json``,
``init/``) is answered with 404.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import dmuon_recipe_contract as contract
from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import FileResponse

from dmuon_server.dependencies import JobDep, SettingsDep
from dmuon_server.errors import ApiError, error_responses
from dmuon_server.jobfiles import CHECKPOINT_DIR, EXPORT_DIR, LOG_FILE, TORCHRUN_LOG_DIR
from dmuon_server.schemas import Artifact, ArtifactKind, ArtifactList

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])


def artifact_kind(relative: str) -> ArtifactKind | None:
    """The kind of the file at ``relative`` (a POSIX path in the job folder), or None."""
    parts = relative.split("/")
    if any(p.startswith(contract.TEMPORARY_PREFIX) or p in ("", ".", "..") for p in parts):
        return None  # folders of saves in progress, and anything odd
    if parts[0] == CHECKPOINT_DIR and len(parts) > 1:
        return "checkpoint"
    if parts[0] == EXPORT_DIR and len(parts) > 1:
        return "export"
    if len(parts) == 1 and parts[0].startswith("metrics") and parts[0].endswith(".jsonl"):
        return "metrics"
    if relative == LOG_FILE or (parts[0] == TORCHRUN_LOG_DIR and len(parts) > 1):
        return "log"
    return None


def list_artifacts(job_dir: Path) -> list[Artifact]:
    """The job's artifacts, sorted by path (links are not followed)."""
    items: list[Artifact] = []
    root = Path(os.path.realpath(job_dir))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(contract.TEMPORARY_PREFIX))
        for name in filenames:
            path = Path(dirpath) / name
            relative = path.relative_to(root).as_posix()
            kind = artifact_kind(relative)
            if kind is None or path.is_symlink():
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            items.append(Artifact(path=relative, bytes=size, kind=kind))
    return sorted(items, key=lambda a: a.path)


def _not_found(job_id: str, path: str) -> ApiError:
    return ApiError(
        404,
        "Artifact not found",
        f"job {job_id} has no artifact {path!r}; list them with GET /v1/jobs/{job_id}/artifacts",
        kind="artifact-not-found",
    )


@router.get(
    "/{job_id}/artifacts", response_model=ArtifactList, responses=error_responses(401, 404, 422)
)
def get_artifacts(job: JobDep, settings: SettingsDep) -> ArtifactList:
    """The job's files: `checkpoint`, `export`, `metrics` and `log`, with their sizes."""
    job_dir = settings.job_dir(job.id)
    return ArtifactList(items=list_artifacts(job_dir) if job_dir.is_dir() else [])


@router.get(
    "/{job_id}/artifacts/{path:path}",
    response_class=FileResponse,
    responses={
        200: {
            "description": "The file's bytes, streamed",
            "content": {"application/octet-stream": {}},
        },
        **error_responses(401, 404, 422),
    },
)
def get_artifact(
    job: JobDep,
    settings: SettingsDep,
    path: Annotated[
        str,
        PathParam(
            min_length=1,
            max_length=4096,
            description="Path relative to the job's folder, as listed by `/artifacts`.",
        ),
    ],
) -> FileResponse:
    """One artifact, streamed; paths never leave the job's folder."""
    root = Path(os.path.realpath(settings.job_dir(job.id)))
    if "\x00" in path or artifact_kind(path) is None:
        raise _not_found(job.id, path)
    target = root / path
    resolved = Path(os.path.realpath(target))
    if target.is_symlink() or not resolved.is_relative_to(root) or not resolved.is_file():
        raise _not_found(job.id, path)
    return FileResponse(resolved, filename=resolved.name, media_type="application/octet-stream")
