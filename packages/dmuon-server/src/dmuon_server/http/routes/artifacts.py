"""A job's files: checkpoints, its HF export, metrics, logs and TensorBoard events, listed
and served one by one.

Only those five kinds are served, and only regular files below the job's folder that the
job's Unix account owns, with one link (:func:`dmuon_server.storage.safefiles.servable`): a path
with ``..``, a symbolic link anywhere on the way, a hard link (to the server's database,
say), another account's file, anything under a folder being written (``.tmp_...``, a save
in progress) or any other file of the folder (``spec.json``, ``exit.json``, ``init/``) is
answered with 404. A path with a control character (a newline, say) is neither listed
nor served: it could not be asked for again in a URL.
"""

from __future__ import annotations

import os
import re
import tarfile
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import dmuon_recipe_contract as contract
from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse

from dmuon_server.http.dependencies import IdentitiesDep, JobDep, SettingsDep
from dmuon_server.http.errors import ApiError, error_responses
from dmuon_server.schemas import Artifact, ArtifactKind, ArtifactList
from dmuon_server.schemas.common import escape_unsafe
from dmuon_server.storage.jobfiles import (
    CHECKPOINT_DIR,
    EXPORT_DIR,
    LOG_FILE,
    TORCHRUN_LOG_DIR,
    TRACKING_DIR,
)
from dmuon_server.storage.safefiles import open_in, servable

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])


#: Characters a served path may not hold: C0 controls and DEL. A newline cannot come back
#: in a URL's path (the route would not match it), and none belongs in a header.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def artifact_kind(relative: str) -> ArtifactKind | None:
    """The kind of the file at ``relative`` (a POSIX path in the job folder), or None:
    never for a path with a control character, which could not be asked for again."""
    parts = relative.split("/")
    if _CONTROL.search(relative):
        return None
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
#: Artifacts per page of ``/artifacts``, by default and at most.
DEFAULT_PAGE, MAX_PAGE = 1000, 10_000


def _components(relative: str) -> tuple[str, ...]:
    return tuple(relative.split("/"))


def iter_artifacts(
    job_dir: Path, owner_uid: int, after: str | None = None, under: str | None = None
) -> Iterator[Artifact]:
    """The job's artifacts in path order (component by component), after ``after`` and
    below the folder ``under`` when given: the files :func:`servable` for ``owner_uid``
    (links are not followed). Folders wholly before ``after`` are not entered, so a page
    deep into a large job costs what its own files cost."""
    root = Path(os.path.realpath(job_dir))
    cursor = _components(after) if after else None
    start: tuple[str, ...] = _components(under) if under else ()

    def walk(prefix: tuple[str, ...]) -> Iterator[Artifact]:
        try:
            entries = sorted(os.scandir(root.joinpath(*prefix)), key=lambda e: e.name)
        except OSError:
            return
        for entry in entries:
            path = (*prefix, entry.name)
            if entry.name.startswith(contract.TEMPORARY_PREFIX):
                continue
            if entry.is_dir(follow_symlinks=False):
                if cursor is None or path >= cursor[: len(path)]:
                    yield from walk(path)
                continue
            if cursor is not None and path <= cursor:
                continue
            relative = "/".join(path)
            kind = artifact_kind(relative)
            if kind is None:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if servable(st, owner_uid):
                shown = escape_unsafe(relative)
                yield Artifact(path=relative, shown=shown, bytes=st.st_size, kind=kind)

    if all(p not in ("", ".", "..") for p in start):
        yield from walk(start)


def list_artifacts(job_dir: Path, owner_uid: int) -> list[Artifact]:
    """Every artifact of the job, in path order (see :func:`iter_artifacts`)."""
    return list(iter_artifacts(job_dir, owner_uid))


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
def get_artifacts(
    job: JobDep,
    settings: SettingsDep,
    identities: IdentitiesDep,
    limit: Annotated[
        int, Query(ge=1, le=MAX_PAGE, description="Most artifacts in this page.")
    ] = DEFAULT_PAGE,
    after: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=4096,
            description="Start after this path: the `next` of the previous page.",
        ),
    ] = None,
    under: Annotated[
        str | None,
        Query(
            min_length=1,
            max_length=4096,
            description="Only the files below this folder (`export`, `checkpoints/step_...`).",
        ),
    ] = None,
) -> ArtifactList:
    """The job's files: `checkpoint`, `export`, `metrics`, `log` and `tracking`, with their
    sizes, a page at a time in path order. A folder comes whole as one `.tar` from
    `/archive/{folder}`."""
    job_dir = settings.job_dir(job.id)
    owner = identities.owner_uid(job.user or "")
    if not job_dir.is_dir():
        return ArtifactList(items=[], next=None)
    folder = under.strip("/") if under else None
    found = list(islice(iter_artifacts(job_dir, owner, after, under=folder), limit + 1))
    more = len(found) > limit
    items = found[:limit]
    return ArtifactList(items=items, next=items[-1].path if more else None)


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
    if artifact_kind(path) is None:
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


_BLOCK = 512


def _tar_member(root: Path, relative: str, name: str, owner_uid: int) -> Iterator[bytes]:
    """One file as a tar member (header, bytes, padding), read as it is sent; a file that
    cannot be served now (gone, replaced by a link) is left out."""
    try:
        fd = open_in(root, relative)
    except OSError:
        return
    st = os.fstat(fd)
    if not servable(st, owner_uid):
        os.close(fd)
        return
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = st.st_size, int(st.st_mtime), 0o644
    yield info.tobuf(format=tarfile.PAX_FORMAT)
    sent = 0
    with os.fdopen(fd, "rb") as f:
        while sent < st.st_size and (chunk := f.read(min(_CHUNK_BYTES, st.st_size - sent))):
            sent += len(chunk)
            yield chunk
    if sent < st.st_size:  # it shrank while being read: keep the archive well-formed
        yield bytes(st.st_size - sent)
    yield bytes(-st.st_size % _BLOCK)


@router.get(
    "/{job_id}/archive/{folder:path}",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "The folder's artifacts as one tar archive, streamed",
            "content": {"application/x-tar": {}},
        },
        **error_responses(401, 404, 422),
    },
)
def get_archive(
    job: JobDep,
    settings: SettingsDep,
    identities: IdentitiesDep,
    folder: Annotated[
        str,
        PathParam(
            min_length=1,
            max_length=4096,
            description="A folder of artifacts: `export`, `checkpoints/step_00000004`, "
            "`tracking/tensorboard/RUN`, ...",
        ),
    ],
) -> StreamingResponse:
    """Every artifact below ``folder`` as one tar archive (names start with the folder's
    own), streamed file by file: an HF export or a checkpoint in one download."""
    folder = folder.strip("/")
    root = Path(os.path.realpath(settings.job_dir(job.id)))
    owner = identities.owner_uid(job.user or "")
    if "\x00" in folder or artifact_kind(f"{folder}/x") is None:
        raise _not_found(job.id, folder)
    files = [a.path for a in iter_artifacts(root, owner, under=folder)]
    if not files:
        raise _not_found(job.id, folder)
    base = folder.rsplit("/", 1)[0] + "/" if "/" in folder else ""

    def stream() -> Iterator[bytes]:
        for path in files:
            # A name a job chose is renamed where it holds characters that could make
            # one file pass for another (U+202E, line breaks): escaped as in listings.
            yield from _tar_member(root, path, escape_unsafe(path[len(base) :]), owner)
        yield bytes(2 * _BLOCK)

    name = f"{job.id[:8]}-{folder.replace('/', '-')}.tar"
    return StreamingResponse(
        stream(),
        media_type="application/x-tar",
        headers={"Content-Disposition": f"attachment; filename*=utf-8''{quote(name)}"},
    )
