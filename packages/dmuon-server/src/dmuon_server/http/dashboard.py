"""The web dashboard: ``/`` and its static files (plain HTML, CSS and JavaScript).

The files hold no job data: every job, metric and log the page shows comes from the REST
and event-stream API under ``/v1``, called by the page with the bearer token the user
types in. So the files themselves are served without a token, by a small ASGI layer
placed in front of the API (and of its token check). Everything else passes through.

The page loads nothing from outside the service: the chart library is vendored under
``static/vendor/`` and a Content-Security-Policy header tells the browser so.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: Folder holding ``index.html``, ``dashboard.css``, ``js/`` and ``vendor/``.
STATIC_DIR = Path(__file__).resolve().parents[1] / "static"
#: URL prefix of the dashboard's files; ``/`` serves ``index.html``.
ASSET_PREFIX = "/ui"

#: Only this origin, for scripts, styles, images and connections. Inline styles are
#: allowed because the chart library positions its elements with them.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self'; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
_HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    # File names carry no version: let the browser revalidate (ETag) on every load.
    (b"cache-control", b"no-cache"),
]


def dashboard_file(path: str) -> str | None:
    """The file path (relative to :data:`STATIC_DIR`, with a leading ``/``) that the URL
    path ``path`` asks for, or ``None`` when ``path`` is not the dashboard's."""
    if path in ("/", "/index.html"):
        return "/index.html"
    if path.startswith(ASSET_PREFIX + "/"):
        return path[len(ASSET_PREFIX) :]
    return None


class DashboardFiles:
    """ASGI layer that answers ``GET``/``HEAD`` for the dashboard's files and passes every
    other request on to ``app`` unchanged."""

    def __init__(self, app: ASGIApp, directory: Path = STATIC_DIR) -> None:
        """Serve the files under ``directory`` in front of ``app``."""
        self.app = app
        self.files = StaticFiles(directory=directory)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve a dashboard file, or hand the request to the wrapped app."""
        file = None
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD"):
            file = dashboard_file(scope.get("path", ""))
        if file is None:
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *_HEADERS]}
            await send(message)

        try:
            await self.files({**scope, "path": file, "root_path": ""}, receive, send_with_headers)
        except HTTPException as exc:  # raised before anything was sent
            response = JSONResponse(
                {
                    "type": "about:blank",
                    "title": "Not found" if exc.status_code == 404 else "HTTP error",
                    "status": exc.status_code,
                    "detail": f"the dashboard has no file {scope.get('path')!r}; open / instead",
                },
                status_code=exc.status_code,
                media_type="application/problem+json",
            )
            await response(scope, receive, send)


def mount_dashboard(app: FastAPI) -> None:
    """Serve the dashboard at ``/`` (files under ``/ui/``) in front of ``app``'s routes.

    Call it after the bearer-token middleware is added: middleware added later runs
    first, so the page loads without a token and then asks the user for one.
    """
    app.add_middleware(DashboardFiles)
