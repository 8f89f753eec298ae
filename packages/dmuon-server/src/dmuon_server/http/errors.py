"""Errors as RFC 9457 problem details (``application/problem+json``), and their handlers."""

from __future__ import annotations

import errno
import http
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from dmuon_server.scheduling.requests import Refusal
from dmuon_server.schemas import FieldError, Problem
from dmuon_server.schemas.responses import field_error
from dmuon_server.storage.store import StoreFull, StoreUnavailable

log = logging.getLogger("dmuon_server")

PROBLEM_JSON = "application/problem+json"
_PROBLEM_BASE = "urn:dmuon-server:problem:"
#: Titles of the error statuses this API documents.
ERROR_TEXT = {
    400: "Malformed request body",
    401: "Missing or invalid bearer token",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    413: "Request body too large",
    415: "Unsupported media type",
    422: "Invalid request",
    429: "Over the user's limit of queued jobs",
    500: "Internal server error",
    503: "Service unavailable",
}
#: Seconds a client is asked to wait before it retries a request the server could not
#: store (``Retry-After`` of a 503).
RETRY_AFTER_S = 10


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


class ApiError(Refusal):
    """An error a route reports as RFC 9457 problem details (a `Refusal` of the service
    is answered the same way)."""

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
        super().__init__(status, title, detail, kind=kind, extra=extra)
        self.errors = errors


def status_title(status: int) -> str:
    """The title of an error status: this API's own, else the HTTP reason phrase."""
    if status in ERROR_TEXT:
        return ERROR_TEXT[status]
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


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


def invalid_request(errors: list[FieldError]) -> ApiError:
    """A 422 naming every invalid field in its title and detail."""
    fields = ", ".join(e.field for e in errors)
    detail = "; ".join(f"{e.field}: {e.message}" for e in errors)
    return ApiError(
        422, f"Invalid request ({fields})", detail, kind="invalid-request", errors=errors
    )


def problem_ref() -> dict[str, Any]:
    """The OpenAPI content of a problem response."""
    return {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}}


#: What a documented status means where it has more causes than its title.
_DESCRIPTIONS = {
    429: "Over the user's limit of queued jobs, or too many failed authentications from "
    "this address (Retry-After says when to try again)",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for error statuses (a route that may answer 401 may
    also answer 429, to a client past its failed authentications)."""
    documented = sorted(set(codes) | ({429} if 401 in codes else set()))
    return {
        code: {"description": _DESCRIPTIONS.get(code, ERROR_TEXT[code]), "content": problem_ref()}
        for code in documented
    }


async def _api_error(request: Request, exc: Refusal) -> JSONResponse:
    return problem_response(
        exc.status,
        exc.title,
        exc.detail,
        kind=exc.kind,
        errors=exc.errors if isinstance(exc, ApiError) else None,
        instance=request.url.path,
        extra=exc.extra,
    )


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    raw = list(exc.errors())
    malformed = [e for e in raw if e.get("type") == "json_invalid"]
    if malformed:
        ctx = malformed[0].get("ctx") or {}
        why = ctx.get("error", "the body is not valid JSON")
        return problem_response(
            400,
            ERROR_TEXT[400],
            f"the request body is not valid JSON ({why}); send a JSON object",
            kind="malformed-body",
            instance=request.url.path,
        )
    errors = [
        field_error(tuple(e.get("loc", ())), str(e.get("msg", "")), str(e.get("type", "")))
        for e in raw
    ]
    problem = invalid_request(errors)
    return problem_response(
        422,
        problem.title,
        problem.detail,
        kind=problem.kind,
        errors=errors,
        instance=request.url.path,
    )


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    detail = exc.detail if isinstance(exc.detail, str) else None
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        # Starlette names only the methods of the first route on the path: ask every
        # route which methods it would take here.
        allowed = [
            m
            for m in _METHODS
            if any(
                route.matches({**request.scope, "method": m})[0] == Match.FULL
                for route in request.app.router.routes
            )
        ]
        if allowed:
            headers["Allow"] = ", ".join(allowed)
    return problem_response(
        exc.status_code,
        status_title(exc.status_code),
        detail,
        instance=request.url.path,
        headers=headers,
    )


async def _store_unavailable(request: Request, exc: StoreUnavailable) -> JSONResponse:
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return problem_response(
        503,
        ERROR_TEXT[503],
        str(exc),
        kind="disk-full" if isinstance(exc, StoreFull) else "store-unavailable",
        instance=request.url.path,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _os_error(request: Request, exc: OSError) -> JSONResponse:
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return await _unexpected(request, exc)
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return problem_response(
        503,
        ERROR_TEXT[503],
        "the server's data directory is full (No space left on device): free space "
        "there (delete finished jobs or their checkpoints), then try again",
        kind="disk-full",
        instance=request.url.path,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    return problem_response(
        500,
        ERROR_TEXT[500],
        "the server failed to handle this request; see its log",
        instance=request.url.path,
    )


#: Each error type and its handler, most specific first (Starlette picks by the MRO).
_HANDLERS: tuple[tuple[type[Exception], Any], ...] = (
    (Refusal, _api_error),
    (RequestValidationError, _validation_error),
    (StarletteHTTPException, _http_error),
    (StoreUnavailable, _store_unavailable),
    (OSError, _os_error),
    (Exception, _unexpected),
)


def install_error_handlers(app: FastAPI) -> None:
    """Make every error of ``app`` a problem+json response."""
    for kind, handler in _HANDLERS:
        app.add_exception_handler(kind, handler)
