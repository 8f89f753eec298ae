"""A job's files: checkpoints, its HF export, metrics, logs and TensorBoard events, listed
and served one by one.

Only those five kinds are served, and only regular files below the job's folder that the
job's Unix account owns, with one link (:func:`dmuon_server.safefiles.servable`): a path
with ``..``, a symbolic link anywhere on the way, a hard link (to the server's database,
say), another account's file, anything under a folder being written (``.tmp_...``, a save
in progress) or any other file of the folder (``spec.json``, ``exit.json``, ``init/``) is
answered with 404.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import dmuon_recipe_contract as contract
from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse

from dmuon_server.dependencies import IdentitiesDep, JobDep, SettingsDep
from dmuon_server.errors import ApiError, error_responses
from dmuon_server.jobfiles import (
    CHECKPOINT_DIR,
    EXPORT_DIR,
    LOG_FILE,
    TORCHRUN_LOG_DIR,
    TRACKING_DIR,
)
from dmuon_server.safefiles import open_in, servable
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
    if parts[:2] == [TRACKING_DIR, "tensorboard"] and len(parts) > 2:
        return "tracking"
    return None


#: Bytes read from an artifact at a time while it is streamed.
_CHUNK_BYTES = 1 << 20


def list_artifacts(job_dir: Path, owner_uid: int) -> list[Artifact]:
    """The job's artifacts, sorted by path: the files :func:`servable` for ``owner_uid``
    (links are not followed)."""
    items: list[Artifact] = []
    root = Path(os.path.realpath(job_dir))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(contract.TEMPORARY_PREFIX))
        for name in filenames:
            path = Path(dirpath) / name
            relative = path.relative_to(root).as_posix()
            kind = artifact_kind(relative)
            if kind is None:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if servable(st, owner_uid):
                items.append(Artifact(path=relative, bytes=st.st_size, kind=kind))
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
def get_artifacts(job: JobDep, settings: SettingsDep, identities: IdentitiesDep) -> ArtifactList:
    """The job's files: `checkpoint`, `export`, `metrics`, `log` and `tracking`, with their
    sizes."""
    job_dir = settings.job_dir(job.id)
    owner = identities.owner_uid(job.user or "")
    return ArtifactList(items=list_artifacts(job_dir, owner) if job_dir.is_dir() else [])


def _read_chunks(fd: int) -> Iterator[bytes]:
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            yield chunk


@router.get(
    "/{job_id}/artifacts/{path:path}",
    response_class=StreamingResponse,
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
    identities: IdentitiesDep,
    path: Annotated[
        str,
        PathParam(
            min_length=1,
            max_length=4096,
            description="Path relative to the job's folder, as listed by `/artifacts`.",
        ),
    ],
) -> StreamingResponse:
    """One artifact, streamed; paths never leave the job's folder."""
    root = Path(os.path.realpath(settings.job_dir(job.id)))
    if "\x00" in path or artifact_kind(path) is None:
        raise _not_found(job.id, path)
    try:
        fd = open_in(root, path)
    except OSError:
        raise _not_found(job.id, path) from None
    st = os.fstat(fd)
    if not servable(st, identities.owner_uid(job.user or "")):
        os.close(fd)
        raise _not_found(job.id, path)
    name = path.rsplit("/", 1)[-1]
    return StreamingResponse(
        _read_chunks(fd),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(st.st_size),
            "Content-Disposition": f"attachment; filename*=utf-8''{quote(name)}",
        },
    )
