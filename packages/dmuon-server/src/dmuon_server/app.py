"""FastAPI routes of dmuon-server. The work happens in the modules the routes call."""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import shutil
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio
from fastapi import FastAPI, Header, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from dmuon_server import __version__
from dmuon_server.config import Settings
from dmuon_server.dashboard import mount_dashboard
from dmuon_server.events import SSE_HEADERS, job_events
from dmuon_server.metrics import Hub, MetricsTailer
from dmuon_server.schemas import (
    ALL_STATES,
    TERMINAL_STATES,
    FieldError,
    Health,
    Job,
    JobCreate,
    JobList,
    JobState,
    LaunchPlan,
    LogLines,
    MetricPage,
    Problem,
)
from dmuon_server.store import IdempotencyConflict, Store
from dmuon_server.supervisor import (
    LOG_FILE,
    DataPathError,
    Supervisor,
    build_plan,
    tail_lines,
)
from dmuon_server.views import job_view, metric_point

log = logging.getLogger("dmuon_server")

PROBLEM_JSON = "application/problem+json"
_PROBLEM_BASE = "urn:dmuon-server:problem:"
_ERROR_TEXT = {
    400: "Bad request",
    401: "Missing or invalid bearer token",
    404: "Not found",
    409: "Conflict",
    422: "Invalid request",
    500: "Internal server error",
}

JobId = Annotated[
    str, Path(min_length=1, max_length=64, description="Job id as returned on creation.")
]


class ApiError(Exception):
    """An error a route reports as RFC 9457 problem details."""

    def __init__(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        kind: str | None = None,
        errors: list[FieldError] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Describe the problem; ``kind`` becomes the ``type`` URN."""
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.kind = kind
        self.errors = errors
        self.extra = extra or {}


def problem_response(
    status: int,
    title: str,
    detail: str | None,
    *,
    kind: str | None = None,
    errors: list[FieldError] | None = None,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    """An ``application/problem+json`` response."""
    body = Problem(
        type=_PROBLEM_BASE + kind if kind else "about:blank",
        title=title,
        status=status,
        detail=detail,
        instance=instance,
        errors=errors,
        **(extra or {}),
    )
    return JSONResponse(
        body.model_dump(mode="json", exclude_none=True),
        status_code=status,
        media_type=PROBLEM_JSON,
        headers=headers,
    )


def field_error(
    loc: tuple[str | int, ...] | list[str | int], message: str, kind: str
) -> FieldError:
    """A :class:`FieldError` for the location ``loc`` (``("body", "train", "steps")``)."""
    return FieldError(
        field=".".join(str(p) for p in loc), loc=list(loc), message=message, type=kind
    )


def _validation_problem(errors: list[FieldError]) -> tuple[str, str]:
    fields = ", ".join(e.field for e in errors)
    detail = "; ".join(f"{e.field}: {e.message}" for e in errors)
    return f"Invalid request ({fields})", detail


class BearerAuthMiddleware:
    """Requires ``Authorization: Bearer <token>`` everywhere but ``/healthz``.

    The token is compared in constant time (:func:`hmac.compare_digest`).
    """

    def __init__(self, app: ASGIApp, token: str) -> None:
        """Wrap ``app``."""
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Let authorised requests (and health checks) through, answer 401 otherwise."""
        if scope["type"] != "http" or scope.get("path") == "/healthz":
            await self.app(scope, receive, send)
            return
        auth = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                auth = value
                break
        scheme, _, credentials = auth.partition(b" ")
        ok = scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), self.token)
        if ok:
            await self.app(scope, receive, send)
            return
        detail = (
            "send the header 'Authorization: Bearer <token>' with the server's token"
            if not auth
            else "the bearer token is wrong; use the token the server was started with"
        )
        response = problem_response(
            401,
            _ERROR_TEXT[401],
            detail,
            kind="unauthorized",
            headers={
                "WWW-Authenticate": 'Bearer realm="dmuon-server"'
                + (', error="invalid_token"' if auth else "")
            },
        )
        await response(scope, receive, send)


@contextlib.contextmanager
def data_dir_lock(settings: Settings) -> Any:
    """Hold an exclusive lock on the data directory: one server per data directory."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with (settings.data_dir / "server.lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(
                f"another dmuon-server is using the data directory {settings.data_dir}; "
                "stop it or pass another --data-dir"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _encode_cursor(seq: int) -> str:
    return base64.urlsafe_b64encode(f"seq:{seq}".encode()).decode().rstrip("=")


def _decode_cursor(cursor: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
        prefix, _, value = raw.partition(":")
        if prefix != "seq":
            raise ValueError(raw)
        seq = int(value)
        if not 0 <= seq < 2**62:
            raise ValueError(raw)
        return seq
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise ApiError(
            422,
            "Invalid request (query.cursor)",
            "query.cursor: not a cursor this server issued; pass the 'next' value of a "
            "previous page, or omit it for the first page",
            kind="invalid-request",
            errors=[field_error(("query", "cursor"), "not a valid cursor", "value_error")],
        ) from None


def _problem_ref() -> dict[str, Any]:
    return {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"description": _ERROR_TEXT[code], "content": _problem_ref()} for code in codes}


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the application for ``settings`` (defaults from the environment)."""
    settings = settings or Settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    store = Store(settings.db_path)
    hub = Hub()
    tailer = MetricsTailer(store, hub)
    supervisor = Supervisor(settings, store, hub, tailer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with data_dir_lock(settings):
            supervisor.start()
            try:
                yield
            finally:
                supervisor.stop()

    app = FastAPI(
        title="dmuon-server",
        version=__version__,
        summary="Job controller that launches DMuon training with torchrun and streams metrics.",
        lifespan=lifespan,
        separate_input_output_schemas=False,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.hub = hub
    app.state.supervisor = supervisor
    app.state.tailer = tailer
    if settings.token:
        app.add_middleware(BearerAuthMiddleware, token=settings.token)
    mount_dashboard(app)

    # ---------------------------------------------------------------- error handlers

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return problem_response(
            exc.status,
            exc.title,
            exc.detail,
            kind=exc.kind,
            errors=exc.errors,
            instance=request.url.path,
            extra=exc.extra,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            field_error(tuple(e.get("loc", ())), str(e.get("msg", "")), str(e.get("type", "")))
            for e in exc.errors()
        ]
        title, detail = _validation_problem(errors)
        return problem_response(
            422, title, detail, kind="invalid-request", errors=errors, instance=request.url.path
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        title = _ERROR_TEXT.get(exc.status_code, "HTTP error")
        detail = exc.detail if isinstance(exc.detail, str) else None
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names only the methods of the first route on the path.
            methods: set[str] = set()
            for route in app.router.routes:
                match, _ = route.matches(request.scope)
                if match != Match.NONE:
                    methods |= set(getattr(route, "methods", None) or ())
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        return problem_response(
            exc.status_code, title, detail, instance=request.url.path, headers=headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return problem_response(
            500,
            _ERROR_TEXT[500],
            "the server failed to handle this request; see its log",
            instance=request.url.path,
        )

    # ----------------------------------------------------------------------- helpers

    def check_limits(body: JobCreate) -> None:
        errors: list[FieldError] = []
        if body.nproc_per_node > settings.max_nproc_per_node:
            errors.append(
                field_error(
                    ("body", "nproc_per_node"),
                    f"{body.nproc_per_node} processes is more than this server runs per job "
                    f"(at most {settings.max_nproc_per_node}, one per CPU core unless "
                    "configured with --max-nproc)",
                    "less_than_equal",
                )
            )
        if body.train.data is not None:
            try:
                from dmuon_server.supervisor import resolve_data_path

                resolve_data_path(settings, body.train.data)
            except DataPathError as e:
                errors.append(field_error(("body", "train", "data"), str(e), "value_error"))
        if errors:
            title, detail = _validation_problem(errors)
            raise ApiError(422, title, detail, kind="invalid-request", errors=errors)

    def get_row(job_id: str) -> dict[str, Any]:
        row = store.get_job(job_id)
        if row is None:
            raise ApiError(
                404,
                "Job not found",
                f"no job with id {job_id!r}; list jobs with GET /v1/jobs",
                kind="job-not-found",
            )
        return row

    # ------------------------------------------------------------------------ routes

    @app.get("/healthz", response_model=Health, tags=["service"])
    def healthz() -> Health:
        """Liveness check; needs no token."""
        return Health(version=__version__)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        tags=["service"],
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors(401),
        },
    )
    def prometheus() -> PlainTextResponse:
        """Prometheus text exposition: jobs by state, queue depth, active streams."""
        counts = store.counts_by_state()
        lines = [
            "# HELP dmuon_jobs Jobs by state.",
            "# TYPE dmuon_jobs gauge",
            *(f'dmuon_jobs{{state="{s}"}} {counts.get(s, 0)}' for s in ALL_STATES),
            "# HELP dmuon_queue_depth Jobs waiting for a free slot.",
            "# TYPE dmuon_queue_depth gauge",
            f"dmuon_queue_depth {counts.get('queued', 0)}",
            "# HELP dmuon_active_streams Open event streams.",
            "# TYPE dmuon_active_streams gauge",
            f"dmuon_active_streams {hub.active_streams}",
            "# HELP dmuon_max_concurrent_jobs Jobs that may run at the same time.",
            "# TYPE dmuon_max_concurrent_jobs gauge",
            f"dmuon_max_concurrent_jobs {settings.max_concurrent_jobs}",
            "# HELP dmuon_jobs_launched_total Jobs launched by this server process.",
            "# TYPE dmuon_jobs_launched_total counter",
            f"dmuon_jobs_launched_total {supervisor.launched_total}",
            "# HELP dmuon_metric_points_ingested_total Metric points stored by this process.",
            "# TYPE dmuon_metric_points_ingested_total counter",
            f"dmuon_metric_points_ingested_total {tailer.points_total}",
            "# HELP dmuon_metric_lines_rejected_total Metrics-file lines that were not JSON "
            "objects.",
            "# TYPE dmuon_metric_lines_rejected_total counter",
            f"dmuon_metric_lines_rejected_total {tailer.rejected_total}",
        ]
        return PlainTextResponse(
            "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @app.post(
        "/v1/jobs",
        status_code=201,
        response_model=Job,
        tags=["jobs"],
        responses={
            200: {"description": "Same Idempotency-Key and spec: the existing job", "model": Job},
            201: {
                "description": "Job created and queued",
                "headers": {
                    "Location": {"description": "URL of the job", "schema": {"type": "string"}}
                },
            },
            **_errors(401, 409, 422),
        },
    )
    def create_job(
        body: JobCreate,
        response: Response,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                min_length=1,
                max_length=255,
                pattern=r"^[\x21-\x7e]+$",
                description="Retry-safe submission: the same key and spec return the same job.",
            ),
        ] = None,
    ) -> Job:
        """Submit a training job; it is queued and started in FIFO order."""
        check_limits(body)
        canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        job_id = uuid.uuid4().hex
        plan = build_plan(settings, body, settings.job_dir(job_id), 0)
        try:
            row, created = store.create_job(
                job_id=job_id,
                name=body.name,
                nproc=body.nproc_per_node,
                spec=canonical,
                spec_hash=hashlib.sha256(canonical.encode()).hexdigest(),
                idempotency_key=idempotency_key,
                argv=plan.argv,
            )
        except IdempotencyConflict as e:
            raise ApiError(
                409,
                "Idempotency-Key already used",
                f"the Idempotency-Key was used for job {e.job_id} with a different spec; "
                "use a new key for a new job, or resend the original spec",
                kind="idempotency-conflict",
                extra={"job_id": e.job_id},
            ) from None
        if created:
            supervisor.wake()
        else:
            response.status_code = 200
        response.headers["Location"] = f"/v1/jobs/{row['id']}"
        return job_view(store, row)

    @app.post(
        "/v1/jobs:validate",
        response_model=LaunchPlan,
        tags=["jobs"],
        responses=_errors(401, 422),
    )
    def validate_job(body: JobCreate) -> LaunchPlan:
        """Dry run: the exact argv, world size, global batch and warnings; starts nothing."""
        check_limits(body)
        ahead = len(store.jobs_in_states(["queued", "starting", "running"]))
        return build_plan(settings, body, settings.job_dir("<job-id>"), ahead)

    @app.get("/v1/jobs", response_model=JobList, tags=["jobs"], responses=_errors(401, 422))
    def list_jobs(
        state: Annotated[
            list[JobState] | None, Query(description="Only jobs in these states (repeatable).")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=200)] = 50,
        cursor: Annotated[
            str | None,
            Query(
                min_length=1,
                max_length=64,
                pattern=r"^[A-Za-z0-9_-]+$",
                description="`next` of the previous page.",
            ),
        ] = None,
    ) -> JobList:
        """Jobs, newest first, with cursor pagination."""
        before = _decode_cursor(cursor) if cursor is not None else None
        rows = store.list_jobs(states=state, before_seq=before, limit=limit + 1)
        page = rows[:limit]
        nxt = _encode_cursor(page[-1]["seq"]) if len(rows) > limit else None
        return JobList(items=[job_view(store, r) for r in page], next=nxt)

    @app.get(
        "/v1/jobs/{job_id}", response_model=Job, tags=["jobs"], responses=_errors(401, 404, 422)
    )
    def get_job(job_id: JobId) -> Job:
        """A job: state, history with reasons, exit code, failure, live summary."""
        return job_view(store, get_row(job_id))

    @app.post(
        "/v1/jobs/{job_id}/cancel",
        status_code=202,
        response_model=Job,
        tags=["jobs"],
        responses=_errors(401, 404, 409, 422),
    )
    def cancel_job(job_id: JobId) -> Job:
        """Cancel: SIGTERM to every process of the job, SIGKILL after the grace period.

        Idempotent; a queued job is cancelled at once. 409 for a job that already
        succeeded or failed.
        """
        row = supervisor.cancel(job_id)
        if row is None:
            get_row(job_id)  # raises 404
            raise AssertionError  # pragma: no cover
        if row["state"] in ("succeeded", "failed"):
            raise ApiError(
                409,
                "Job already finished",
                f"job {job_id} already {row['state']}; there is nothing to cancel",
                kind="job-finished",
            )
        return job_view(store, row)

    @app.delete(
        "/v1/jobs/{job_id}",
        status_code=204,
        response_class=Response,
        tags=["jobs"],
        responses=_errors(401, 404, 409, 422),
    )
    def delete_job(job_id: JobId) -> Response:
        """Forget a finished job: its record, metrics and working folder."""
        row = get_row(job_id)
        if row["state"] not in TERMINAL_STATES or not store.delete_job(job_id):
            raise ApiError(
                409,
                "Job not finished",
                f"job {job_id} is {row['state']}; cancel it first and delete it once it is "
                "cancelled",
                kind="job-not-finished",
            )
        shutil.rmtree(settings.job_dir(job_id), ignore_errors=True)
        return Response(status_code=204)

    @app.get(
        "/v1/jobs/{job_id}/metrics",
        response_model=MetricPage,
        response_model_exclude_unset=True,
        tags=["metrics"],
        responses=_errors(401, 404, 422),
    )
    def get_metrics(
        job_id: JobId,
        after_step: Annotated[
            int, Query(ge=-1, le=2**62, description="Only points with a larger step.")
        ] = -1,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    ) -> MetricPage:
        """Stored metric points in step order; follow `next` until it is null."""
        get_row(job_id)
        rows = store.metrics_after(job_id, after_step, limit + 1)
        page = rows[:limit]
        nxt = page[-1]["step"] if len(rows) > limit else None
        return MetricPage(items=[metric_point(r["data"]) for r in page], next=nxt)

    @app.get(
        "/v1/jobs/{job_id}/events",
        response_class=StreamingResponse,
        tags=["metrics"],
        responses={
            200: {
                "description": "Server-Sent Events: `metric` (id = step), `state`, `end`.",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            204: {"description": "Reconnect to a finished job with nothing left to send."},
            **_errors(401, 404, 422),
        },
    )
    async def get_events(
        job_id: JobId,
        after_step: Annotated[
            int, Query(ge=-1, le=2**62, description="Start after this step (-1: everything).")
        ] = -1,
        last_event_id: Annotated[
            str | None,
            Header(
                alias="Last-Event-ID",
                pattern=r"^-?[0-9]{1,18}$",
                description="Resume after this step (takes precedence over after_step).",
            ),
        ] = None,
    ) -> Response:
        """Live metrics of a job as Server-Sent Events."""
        row = await anyio.to_thread.run_sync(store.get_job, job_id)
        if row is None:
            get_row(job_id)
        start = max(-1, int(last_event_id)) if last_event_id is not None else after_step
        if last_event_id is not None and row is not None and row["state"] in TERMINAL_STATES:
            rest = await anyio.to_thread.run_sync(store.metrics_after, job_id, start, 1)
            if not rest:
                return Response(status_code=204)
        return StreamingResponse(
            job_events(store, hub, job_id, start, settings.heartbeat_s),
            media_type="text/event-stream; charset=utf-8",
            headers=SSE_HEADERS,
        )

    @app.get(
        "/v1/jobs/{job_id}/logs",
        response_model=LogLines,
        tags=["jobs"],
        responses=_errors(401, 404, 422),
    )
    def get_logs(job_id: JobId, tail: Annotated[int, Query(ge=1, le=10_000)] = 100) -> LogLines:
        """The last `tail` lines of the job's log (torchrun and every rank, teed)."""
        get_row(job_id)
        lines, truncated = tail_lines(settings.job_dir(job_id) / LOG_FILE, tail)
        return LogLines(lines=lines, truncated=truncated)

    # ----------------------------------------------------------------------- OpenAPI

    def custom_openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            routes=app.routes,
            separate_input_output_schemas=False,
        )
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
        comps.update(problem.pop("$defs", {}))
        comps["Problem"] = problem
        for name in ("HTTPValidationError", "ValidationError"):
            comps.pop(name, None)
        if "JobCreate" in comps:
            comps["JobCreate"]["properties"]["nproc_per_node"]["maximum"] = (
                settings.max_nproc_per_node
            )
        for path, ops in schema.get("paths", {}).items():
            for op in ops.values():
                responses = op.get("responses", {})
                if "requestBody" in op:  # a body that is not UTF-8 JSON at all
                    responses.setdefault("400", {"description": _ERROR_TEXT[400]})
                for code, resp in responses.items():
                    if code.startswith(("4", "5")):
                        resp["content"] = _problem_ref()
                        resp.setdefault("description", _ERROR_TEXT.get(int(code), "Error"))
                if path == "/healthz":
                    continue
                if settings.token:
                    op["security"] = [{"bearer": []}]
        if settings.token:
            schema["components"]["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"}
            }
        app.openapi_schema = schema
        return schema

    app.openapi = custom_openapi  # type: ignore[method-assign]
    return app
