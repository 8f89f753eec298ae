"""HTTP details of the API: request bodies are JSON and nothing else, and ``HEAD`` works
wherever ``GET`` does.

* A request with a body must say ``Content-Type: application/json`` (415 otherwise, naming
  the header to send), and the body must be JSON the API can store: an object key given
  twice (``{"steps": 10, "steps": 99999999}``, which a JSON reader silently resolves to the
  last) is refused with 422 naming the key, and so is a string that is not valid Unicode (a
  lone surrogate escape). Nesting too deep for the reader is a malformed body (400).
* ``HEAD`` on an API route answers as ``GET`` would, headers only.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dmuon_server.http.errors import ERROR_TEXT, field_error, invalid_request, problem_response

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class DuplicateKey(ValueError):
    """An object of a JSON document names a key twice."""

    def __init__(self, loc: tuple[str | int, ...], key: str) -> None:
        """Remember where (``loc``, from the body's root) and which key."""
        super().__init__(key)
        self.loc = loc
        self.key = key


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey((), key)
        out[key] = value
    return out


def _locate(doc: bytes, key: str) -> tuple[str | int, ...]:
    """Where in ``doc`` an object first repeats ``key``, as a field path."""

    def walk(node: Any, loc: tuple[str | int, ...]) -> tuple[str | int, ...] | None:
        if isinstance(node, list):
            for i, v in enumerate(node):
                found = walk(v, (*loc, i))
                if found is not None:
                    return found
        elif isinstance(node, tuple):  # an object as its list of pairs
            seen: set[str] = set()
            for k, v in node:
                if k in seen and k == key:
                    return (*loc, k)
                seen.add(k)
                found = walk(v, (*loc, k))
                if found is not None:
                    return found
        return None

    tree = json.loads(doc, object_pairs_hook=tuple)
    return walk(tree, ()) or (key,)


def _bad_text(node: Any, loc: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """The path of the first string (or key) that is not valid Unicode, or None."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(node, loc)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((k, where))
                stack.append((v, (*where, k)))
        elif isinstance(value, list):
            stack.extend((v, (*where, i)) for i, v in enumerate(value))
    return None


class JsonBodyMiddleware:
    """Refuse request bodies that are not JSON, or whose JSON the API could misread."""

    def __init__(self, app: ASGIApp) -> None:
        """Wrap ``app``."""
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body, check it, and hand it on unchanged."""
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        path = scope.get("path")
        if body.strip():
            headers = dict(scope.get("headers", []))
            content_type = headers.get(b"content-type", b"").decode("latin-1")
            if not _is_json(content_type):
                sent = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
                response = problem_response(
                    415,
                    ERROR_TEXT[415],
                    f"the request body must be JSON, sent with the header 'Content-Type: "
                    f"application/json' (this request has {sent})",
                    kind="unsupported-media-type",
                    instance=path,
                )
                await response(scope, receive, send)
                return
            problem = _check_json(body, path)
            if problem is not None:
                await problem(scope, receive, send)
                return
        await self.app(scope, _replay([{"type": "http.request", "body": body}], receive), send)


def _check_json(body: bytes, path: str | None) -> Any:
    """The problem response for a body the API must not read, or None."""
    try:
        doc = json.loads(body, object_pairs_hook=_pairs)
    except DuplicateKey as e:
        loc = ("body", *_locate(body, e.key))
        err = invalid_request(
            [
                field_error(
                    loc,
                    f"the key {e.key!r} is given twice; give each key once (a JSON reader "
                    "would silently keep the last value)",
                    "duplicate_key",
                )
            ]
        )
        return problem_response(
            422, err.title, err.detail, kind=err.kind, errors=err.errors, instance=path
        )
    except RecursionError:
        return problem_response(
            400,
            ERROR_TEXT[400],
            "the request body is nested too deep to read; send a job spec (a few levels)",
            kind="malformed-body",
            instance=path,
        )
    except (ValueError, UnicodeDecodeError):
        return None  # malformed JSON: the API's own handler says where (400)
    where = _bad_text(doc)
    if where is not None:
        err = invalid_request(
            [
                field_error(
                    ("body", *where),
                    "not valid Unicode text (a lone surrogate escape such as \\ud800)",
                    "string_unicode",
                )
            ]
        )
        return problem_response(
            422, err.title, err.detail, kind=err.kind, errors=err.errors, instance=path
        )
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives ``messages`` first, then whatever the client sends next."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay


class HeadMiddleware:
    """Answer ``HEAD`` as ``GET``, without the body (FastAPI's routes take ``GET`` only).

    An event stream would never end by itself: once the headers are out the route is told
    that the client has gone.
    """

    def __init__(self, app: ASGIApp) -> None:
        """Wrap ``app``."""
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the request as ``GET`` and send its status and headers only."""
        if scope["type"] != "http" or scope.get("method") != "HEAD":
            await self.app(scope, receive, send)
            return
        done = False

        async def head_receive() -> Message:
            if done:
                return {"type": "http.disconnect"}
            return await receive()

        async def head_send(message: Message) -> None:
            nonlocal done
            if done:
                return
            if message["type"] == "http.response.start":
                await send(message)
            elif message["type"] == "http.response.body":
                done = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await send(message)

        await self.app({**scope, "method": "GET"}, head_receive, head_send)
