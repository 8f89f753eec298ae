"""Request body size limit, enforced before the body is read."""

from __future__ import annotations

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dmuon_server.http.errors import ERROR_TEXT, problem_response


class BodySizeLimitMiddleware:
    """Answer 413 to a request whose body is larger than ``max_bytes``.

    A declared ``Content-Length`` over the limit is refused before a byte of the body is
    read; a body without one (chunked) is counted as it arrives and refused as soon as
    it passes the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        """Wrap ``app``."""
        self.app = app
        self.max_bytes = max_bytes

    def _detail(self) -> str:
        return (
            f"the request body is larger than this server accepts ({self.max_bytes} bytes); "
            "send a smaller body (a job spec is a few hundred bytes)"
        )

    def _refusal(self, scope: Scope) -> object:
        return problem_response(
            413,
            ERROR_TEXT[413],
            self._detail(),
            kind="body-too-large",
            instance=scope.get("path"),
            headers={"Connection": "close"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the declared length, then count what arrives."""
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._refusal(scope)(scope, receive, send)  # type: ignore[operator]
                    return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI turns other errors while reading a body into a 400.
                    raise HTTPException(413, self._detail(), {"Connection": "close"})
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except HTTPException as e:
            if started or e.status_code != 413:
                raise
            await self._refusal(scope)(scope, receive, send)  # type: ignore[operator]
