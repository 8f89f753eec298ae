"""The FastAPI application: wiring and lifespan. Routes live in :mod:`dmuon_server.http.routes`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from dmuon_server import __version__
from dmuon_server.config import Settings
from dmuon_server.http.auth import BearerAuthMiddleware
from dmuon_server.http.dashboard import mount_dashboard
from dmuon_server.http.errors import install_error_handlers
from dmuon_server.http.hosts import HostCheckMiddleware
from dmuon_server.http.limits import BodySizeLimitMiddleware
from dmuon_server.http.openapi import build_openapi
from dmuon_server.http.protocol import HeadMiddleware, JsonBodyMiddleware
from dmuon_server.http.routes import artifacts, jobs, metrics, service
from dmuon_server.launching.factory import launcher_for
from dmuon_server.launching.handover import check_launcher_matches
from dmuon_server.launching.identity import IdentityError, JobIdentities
from dmuon_server.launching.protocol import LauncherFactory
from dmuon_server.launching.slurm_jobs import check_slurm
from dmuon_server.recipe.fingerprint import PREFIX as FINGERPRINT_PREFIX
from dmuon_server.recipe.fingerprint import stored_spec_fingerprint
from dmuon_server.scheduling.lifecycle import move_job
from dmuon_server.scheduling.supervisor import Supervisor
from dmuon_server.storage.datadir import DataDirLock, StartupError, check_data_dir
from dmuon_server.storage.paths import PublicPaths
from dmuon_server.storage.states import JobState
from dmuon_server.storage.store import Store, StoreError
from dmuon_server.streams.feeds import EventStreams
from dmuon_server.streams.metrics import Hub, MetricsTailer
from dmuon_server.users import Users, UsersFileError


def create_app(
    settings: Settings | None = None,
    *,
    lock: DataDirLock | None = None,
    users: Users | None = None,
    make_launcher: LauncherFactory = launcher_for,
) -> FastAPI:
    """Build the application for ``settings`` (defaults from the environment).

    ``lock`` is the data directory's lock when the caller (the CLI) already holds it;
    otherwise the lifespan takes it. ``users`` are those the CLI loaded (it reloads them on
    SIGHUP); by default they are read from ``settings``. ``make_launcher`` builds where jobs
    run (by default the launcher ``settings`` name), given the store, hub, metrics tailer,
    the state-changing ``move`` and the job identities. Raises :class:`StartupError` for
    a data directory, database or users file the server cannot use.
    """
    settings = settings or Settings()
    users, identities, store = _open(settings, users)
    hub = Hub()

    def metrics_cap(job_id: str) -> tuple[int, str] | None:
        job = store.get_job(job_id)
        limit, source = settings.max_job_metrics_bytes, "--max-job-metrics-bytes"
        disk = users.limits_of(job.user).disk_gib if job is not None else None
        if disk is not None and disk * 2**30 < limit:
            limit, source = int(disk * 2**30), f"user {job.user}'s disk_gib in the users file"
        return limit, source

    tailer = MetricsTailer(
        store,
        hub,
        lambda job_id, text: PublicPaths(settings, settings.job_dir(job_id)).text(text),
        metrics_cap,
    )

    def move(job_id: str, state: JobState, reason: str, **kw: Any) -> bool:
        return move_job(store, hub, job_id, state, reason, **kw)

    launcher = make_launcher(settings, store, hub, tailer, move, identities)
    supervisor = Supervisor(settings, store, hub, tailer, launcher, identities=identities)
    streams = EventStreams(
        store, hub, supervisor.queue_places, lambda: users.generation, settings.heartbeat_s
    )
    data_lock = lock or DataDirLock(settings.data_dir)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        data_lock.acquire()
        hub.reopen()
        supervisor.start()
        try:
            yield
        finally:
            hub.shutdown()
            supervisor.stop()
            if lock is None:
                data_lock.release()

    app = FastAPI(
        title="dmuon-server",
        version=__version__,
        summary="Job controller that launches DMuon training with torchrun and streams metrics.",
        lifespan=lifespan,
        separate_input_output_schemas=False,
        # The interactive pages would load Swagger UI / ReDoc from a CDN (the service loads
        # nothing from outside) and cannot send a token; the REST reference of the docs and
        # /openapi.json describe the API instead.
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.hub = hub
    app.state.streams = streams
    app.state.supervisor = supervisor
    app.state.tailer = tailer
    app.state.users = users
    app.state.identities = identities
    _install_http(app, settings, users)
    return app


def _open(settings: Settings, users: Users | None) -> tuple[Users, JobIdentities, Store]:
    """Check the users file, the data directory, the launcher and the database, and open
    them; raise :class:`StartupError` for one the server cannot use."""
    if users is None:
        try:
            users = Users(settings.users_file, settings.token)
        except UsersFileError as e:
            raise StartupError(str(e)) from None
    try:
        identities = JobIdentities(settings, users)
    except IdentityError as e:
        raise StartupError(str(e)) from None
    check_data_dir(settings.data_dir, settings.jobs_dir)
    if settings.launcher == "slurm":
        check_slurm(settings)
    try:
        store = Store(settings.db_path)
    except StoreError as e:
        raise StartupError(str(e)) from None
    try:
        identities.secure_data_dir()
    except IdentityError as e:
        raise StartupError(str(e)) from None
    check_launcher_matches(store, settings.launcher)
    store.refresh_spec_hashes(stored_spec_fingerprint, FINGERPRINT_PREFIX)
    return users, identities, store


def _install_http(app: FastAPI, settings: Settings, users: Users) -> None:
    """Error handlers, routes, middleware, the dashboard and the OpenAPI document."""
    install_error_handlers(app)
    app.include_router(service.router)
    app.include_router(jobs.router)
    app.include_router(metrics.router)
    app.include_router(artifacts.router)
    # Middleware added later runs first: host check, dashboard files, token, body size,
    # JSON bodies, HEAD, then the routes.
    app.add_middleware(HeadMiddleware)
    app.add_middleware(JsonBodyMiddleware)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)
    if users.enabled:
        app.add_middleware(BearerAuthMiddleware, users=users)
    mount_dashboard(app)
    if settings.host_check is not None:  # added last: it runs first
        app.add_middleware(HostCheckMiddleware, allowed=settings.host_check)

    def openapi() -> dict[str, Any]:
        return build_openapi(app, settings)

    app.openapi = openapi  # type: ignore[method-assign]
