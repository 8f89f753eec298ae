"""Service endpoints: liveness, Prometheus metrics, and who you are (users)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from dmuon_server import __version__
from dmuon_server.http.dependencies import (
    AdminDep,
    SettingsDep,
    StoreDep,
    StreamsDep,
    SupervisorDep,
    TailerDep,
    UserDep,
    UsersDep,
)
from dmuon_server.http.errors import error_responses
from dmuon_server.schemas import (
    ACTIVE_STATES,
    ALL_STATES,
    Health,
    LimitInfo,
    ServerInfo,
    UserInfo,
    UserList,
)

router = APIRouter(tags=["service"])


@router.get("/healthz", response_model=Health)
def healthz() -> Health:
    """Liveness check; needs no token."""
    return Health(version=__version__)


@router.get("/v1/me", response_model=UserInfo, responses=error_responses(401))
def me(user: UserDep) -> UserInfo:
    """Who the token belongs to: your name, and whether you are an admin (null name: a
    server without users, where everyone may do everything)."""
    return UserInfo(name=user.name or None, admin=user.admin)


@router.get("/v1/server", response_model=ServerInfo, responses=error_responses(401))
def server(_: UserDep, settings: SettingsDep, supervisor: SupervisorDep) -> ServerInfo:
    """How this server runs jobs: its launcher and sandbox, and each kernel limit on local
    jobs with what asked for it and whether it is held (``unenforced`` names those that
    are not: the server was started with ``--allow-unenforced-limits``, or they are
    defaults this machine cannot hold)."""
    limits = [
        LimitInfo(name=s.name, asked_by=s.asked_by, held=s.held, why=s.why)
        for s in supervisor.launcher.limit_statuses
    ]
    return ServerInfo(
        version=__version__,
        launcher=settings.launcher,
        sandbox=settings.sandbox,
        allow_unenforced_limits=settings.allow_unenforced_limits,
        limits=limits,
        unenforced=[limit.name for limit in limits if not limit.held],
    )


@router.get("/v1/users", response_model=UserList, responses=error_responses(401, 403))
def users(admin: AdminDep, known: UsersDep, store: StoreDep) -> UserList:
    """The users this server knows, and those its jobs name (admins only)."""
    seen: dict[str, bool] = {u.name: u.admin for u in known.all()}
    for name in store.users():
        seen.setdefault(name, False)
    return UserList(items=[UserInfo(name=n, admin=a) for n, a in seen.items()])


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
        **error_responses(401),
    },
)
def prometheus(
    settings: SettingsDep,
    store: StoreDep,
    streams: StreamsDep,
    supervisor: SupervisorDep,
    tailer: TailerDep,
) -> PlainTextResponse:
    """Prometheus text exposition: jobs by state, queue depth, active streams."""
    counts = store.counts_by_state()
    busy = sum(len(j.gpu_list) for j in store.jobs_in_states(ACTIVE_STATES))
    lines = [
        "# HELP dmuon_jobs Jobs by state.",
        "# TYPE dmuon_jobs gauge",
        *(f'dmuon_jobs{{state="{s}"}} {counts.get(s, 0)}' for s in ALL_STATES),
        "# HELP dmuon_queue_depth Jobs waiting for a free slot.",
        "# TYPE dmuon_queue_depth gauge",
        f"dmuon_queue_depth {counts.get('queued', 0)}",
        "# HELP dmuon_active_streams Open event streams.",
        "# TYPE dmuon_active_streams gauge",
        f"dmuon_active_streams {streams.open}",
        "# HELP dmuon_max_concurrent_jobs Jobs that may run at the same time.",
        "# TYPE dmuon_max_concurrent_jobs gauge",
        f"dmuon_max_concurrent_jobs {settings.job_slots}",
        "# HELP dmuon_gpus GPUs the server gives jobs (--gpus).",
        "# TYPE dmuon_gpus gauge",
        f"dmuon_gpus {len(settings.gpus)}",
        "# HELP dmuon_gpus_busy GPUs held by active jobs.",
        "# TYPE dmuon_gpus_busy gauge",
        f"dmuon_gpus_busy {busy}",
        "# HELP dmuon_jobs_launched_total Jobs launched by this server process.",
        "# TYPE dmuon_jobs_launched_total counter",
        f"dmuon_jobs_launched_total {supervisor.launched_total}",
        "# HELP dmuon_metric_points_ingested_total Metric points stored by this process.",
        "# TYPE dmuon_metric_points_ingested_total counter",
        f"dmuon_metric_points_ingested_total {tailer.points_total}",
        "# HELP dmuon_metric_lines_rejected_total Metrics-file lines that were not stored.",
        "# TYPE dmuon_metric_lines_rejected_total counter",
        f"dmuon_metric_lines_rejected_total {tailer.rejected_total}",
        "# HELP dmuon_supervision_errors_total Rounds of a job's supervision that failed.",
        "# TYPE dmuon_supervision_errors_total counter",
        f"dmuon_supervision_errors_total {supervisor.errors_total}",
    ]
    return PlainTextResponse(
        "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8"
    )
