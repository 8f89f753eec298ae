"""The OpenAPI document: problem+json for every error, the token scheme, live limits."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dmuon_server.config import Settings
from dmuon_server.http.errors import ERROR_TEXT, problem_ref
from dmuon_server.schemas import Problem


def build_openapi(app: FastAPI, settings: Settings) -> dict[str, Any]:
    """The document of ``app`` (built once, then cached on the app)."""
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
        comps["JobCreate"]["properties"]["nproc_per_node"]["maximum"] = settings.max_nproc_per_node
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            responses = op.get("responses", {})
            if "requestBody" in op:  # a body that is not JSON, or one that is too large
                responses.setdefault("400", {"description": ERROR_TEXT[400]})
                responses.setdefault("413", {"description": ERROR_TEXT[413]})
            for code, resp in responses.items():
                if code.startswith(("4", "5")):
                    resp["content"] = problem_ref()
                    resp.setdefault("description", ERROR_TEXT.get(int(code), "Error"))
            if path == "/healthz":
                continue
            if settings.token or settings.users_file:
                op["security"] = [{"bearer": []}]
    if settings.token or settings.users_file:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    app.openapi_schema = schema
    return schema
