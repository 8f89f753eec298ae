"""MkDocs hook: render the parts of the docs that must match the code exactly.

A page asks for generated content with a marker on a line of its own:

``<!-- generated: ns-coefficients -->``
    The Newton-Schulz coefficient sets, read from ``dmuon.optim._orthogonalize``.
``<!-- generated: rest-reference -->``
    The REST reference, rendered from the job service's OpenAPI document
    (``dmuon_server.app``), so the page cannot drift from the routes.
``<!-- generated: recipe-flags -->``, ``<!-- generated: recipe-presets -->``
    The training recipe's flags (from its argument parser) and model presets (from
    ``dmuon.train.PRESETS``); see ``docs_hooks/recipe_tables.py``.
``<!-- generated: scaling-MODEL -->``
    The Scaling page's plan of ``benchmarks/models/MODEL.json`` at every layout, from
    ``dmuon.plan``; see ``docs_hooks/scaling.py``.
``<!-- generated: torch-muon-defaults -->`` and the other ``torch-*`` markers
    ``dmuon.Muon``'s defaults against ``torch.optim.Muon``'s and ``torch.optim.AdamW``'s,
    from their signatures; see ``docs_hooks/torch_muon.py``.

Labels follow the page language (English, or Chinese for pages under ``docs/zh/``). If the
code cannot be imported the hook logs a warning, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page


def _sibling(name: str) -> ModuleType:
    """A sibling module of this hook, loaded from its file under a name of its own
    (MkDocs loads hooks by file path, not as a package; a plain ``import scaling`` could
    find another ``scaling``, such as ``benchmarks/scaling.py``)."""
    module_name = f"dmuon_docs_hook_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, Path(__file__).parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


diagrams = _sibling("diagrams")
glossary = _sibling("glossary")
recipe_tables = _sibling("recipe_tables")
scaling = _sibling("scaling")
torch_muon = _sibling("torch_muon")

log = get_plugin_logger("dmuon-docs")

MARKER = re.compile(r"^<!-- generated: (?P<name>[a-z0-9-]+) -->[ \t]*$", re.MULTILINE)

LABELS: dict[str, dict[str, str]] = {
    "en": {
        "set": "Coefficient set",
        "step": "Step",
        "steps_note": "Steps after the last row repeat the last row.",
        "published": "Published (before the safety factor)",
        "safety": "Safety factor",
        "endpoints": "Endpoints",
        "schemas": "Schemas",
        "parameters": "Parameters",
        "name": "Name",
        "in": "In",
        "type": "Type",
        "required": "Required",
        "default": "Default",
        "description": "Description",
        "body": "Request body",
        "responses": "Responses",
        "status": "Status",
        "field": "Field",
        "yes": "yes",
        "no": "no",
        "auth": "Requires the bearer token.",
        "version": "OpenAPI document",
        "sep": ", ",
        "lang": "en",
    },
    "zh": {
        "set": "系数集",
        "step": "步",
        "steps_note": "超出表格的步数重复使用最后一行。",
        "published": "论文原值（除以安全系数之前）",
        "safety": "安全系数",
        "endpoints": "端点",
        "schemas": "数据模型",
        "parameters": "参数",
        "name": "名称",
        "in": "位置",
        "type": "类型",
        "required": "必填",
        "default": "默认值",
        "description": "说明",
        "body": "请求体",
        "responses": "响应",
        "status": "状态码",
        "field": "字段",
        "yes": "是",
        "no": "否",
        "auth": "需要 bearer token。",
        "version": "OpenAPI 文档",
        "sep": "，",
        "lang": "zh",
    },
}


def page_lang(page: Page) -> str:
    """``zh`` for pages of the Chinese mirror, ``en`` otherwise."""
    locale = str(getattr(page.file, "locale", None) or "en")
    return locale if locale in LABELS else "en"


def _labels(page: Page) -> dict[str, str]:
    return LABELS[page_lang(page)]


def _cell(text: object) -> str:
    """Make ``text`` safe for one Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


# --------------------------------------------------------------------------- Newton-Schulz


def _fmt(x: float) -> str:
    return repr(float(x))


def render_ns_coefficients(labels: Mapping[str, str]) -> str:
    """Tables of every named coefficient set, straight from the code's constants."""
    ns = importlib.import_module("dmuon.optim._orthogonalize")
    sets: Mapping[str, tuple[tuple[float, float, float], ...]] = ns.COEFFICIENT_SETS
    out: list[str] = []
    for name, triples in sets.items():
        out.append(f'**{labels["set"]} `"{name}"`**')
        out.append("")
        out.append(f"| {labels['step']} | a | b | c |")
        out.append("|---:|---:|---:|---:|")
        for i, (a, b, c) in enumerate(triples, start=1):
            out.append(f"| {i} | `{_fmt(a)}` | `{_fmt(b)}` | `{_fmt(c)}` |")
        out.append("")
    published = getattr(ns, "POLAR_EXPRESS_PUBLISHED_COEFFICIENTS", None)
    safety = getattr(ns, "POLAR_EXPRESS_SAFETY_FACTOR", None)
    if published is not None and safety is not None:
        sep = labels["sep"]
        out.append(
            f'**{labels["published"]}{sep}`"polar_express"`{sep}{labels["safety"]} s = {safety}**'
        )
        out.append("")
        out.append(f"| {labels['step']} | a | b | c |")
        out.append("|---:|---:|---:|---:|")
        for i, (a, b, c) in enumerate(published, start=1):
            out.append(f"| {i} | `{_fmt(a)}` | `{_fmt(b)}` | `{_fmt(c)}` |")
        out.append("")
    out.append(labels["steps_note"])
    return "\n".join(out)


# --------------------------------------------------------------------------- OpenAPI


def load_openapi() -> dict[str, Any]:
    """The job service's OpenAPI document, produced by its FastAPI app.

    The app is built with a token (so the document shows which routes require it) and a
    throw-away data directory; it is never started.
    """
    module = importlib.import_module("dmuon_server.app")
    config = importlib.import_module("dmuon_server.config")
    with tempfile.TemporaryDirectory(prefix="dmuon-docs-") as data_dir:
        settings = config.Settings(data_dir=Path(data_dir), token="docs", max_nproc_per_node=1)
        app = module.create_app(settings)
        spec = dict(app.openapi())
    # The maximum of nproc_per_node is the running server's --max-nproc, not a constant.
    job_create = spec.get("components", {}).get("schemas", {}).get("JobCreate", {})
    job_create.get("properties", {}).get("nproc_per_node", {}).pop("maximum", None)
    return spec


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _schema_anchor(name: str) -> str:
    return "schema-" + re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _type_of(schema: Mapping[str, Any]) -> str:
    """A short human-readable type for a JSON schema."""
    if "$ref" in schema:
        name = _ref_name(str(schema["$ref"]))
        return f"[{name}](#{_schema_anchor(name)})"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " | ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(_type_of(s) for s in schema[key])
    kind = schema.get("type")
    if kind == "array":
        return f"array of {_type_of(schema.get('items', {}))}"
    if kind == "object" and "additionalProperties" in schema:
        extra = schema["additionalProperties"]
        if isinstance(extra, Mapping):
            return f"object of {_type_of(extra)}"
    if isinstance(kind, list):
        return " or ".join(str(k) for k in kind)
    if kind is None:
        return "any"
    fmt = schema.get("format")
    return f"{kind} ({fmt})" if fmt else str(kind)


def _num(x: object) -> str:
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x)


def _constraints(schema: Mapping[str, Any]) -> str:
    """Bounds of a JSON schema (or of the non-null branch of an ``anyOf``), for people."""
    for key in ("anyOf", "oneOf"):
        if key in schema:
            parts = [_constraints(s) for s in schema[key] if s.get("type") != "null"]
            return "; ".join(p for p in parts if p)
    parts = []
    if "minimum" in schema:
        parts.append(f"≥ {_num(schema['minimum'])}")
    if "exclusiveMinimum" in schema:
        parts.append(f"> {_num(schema['exclusiveMinimum'])}")
    if "maximum" in schema:
        parts.append(f"≤ {_num(schema['maximum'])}")
    if "exclusiveMaximum" in schema:
        parts.append(f"< {_num(schema['exclusiveMaximum'])}")
    if "minLength" in schema or "maxLength" in schema:
        parts.append(f"length {schema.get('minLength', 0)}–{schema.get('maxLength', '∞')}")
    return ", ".join(parts)


def _op_anchor(method: str, path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")


def _content_schema(content: Mapping[str, Any]) -> str:
    parts = []
    for media, spec in content.items():
        schema = spec.get("schema", {}) if isinstance(spec, Mapping) else {}
        shown = _type_of(schema) if schema else "—"
        parts.append(f"`{media}`: {shown}")
    return "; ".join(parts) if parts else "—"


def render_openapi(spec: Mapping[str, Any], labels: Mapping[str, str]) -> str:
    """Markdown for every operation and schema of ``spec``."""
    out: list[str] = []
    info = spec.get("info", {})
    out.append(
        f"{labels['version']}: **{info.get('title', '')}** {info.get('version', '')} "
        f"(OpenAPI {spec.get('openapi', '')})"
    )
    out.append("")
    out.append(f"## {labels['endpoints']} {{#endpoints}}")
    out.append("")
    methods = ("get", "post", "put", "patch", "delete")
    for path, item in spec.get("paths", {}).items():
        for method in methods:
            op = item.get(method)
            if op is None:
                continue
            anchor = _op_anchor(method, path)
            out.append(f"### `{method.upper()} {path}` {{#{anchor}}}")
            out.append("")
            if op.get("summary"):
                out.append(f"**{op['summary']}**")
                out.append("")
            if op.get("description"):
                out.append(str(op["description"]).strip())
                out.append("")
            if op.get("security") or spec.get("security"):
                out.append(labels["auth"])
                out.append("")
            params = op.get("parameters", [])
            if params:
                out.append(f"**{labels['parameters']}**")
                out.append("")
                out.append(
                    f"| {labels['name']} | {labels['in']} | {labels['type']} | "
                    f"{labels['required']} | {labels['description']} |"
                )
                out.append("|---|---|---|---|---|")
                for p in params:
                    req = labels["yes"] if p.get("required") else labels["no"]
                    pschema = p.get("schema", {})
                    bounds = _constraints(pschema)
                    shown_type = _type_of(pschema) + (f" ({bounds})" if bounds else "")
                    out.append(
                        f"| `{p.get('name')}` | {p.get('in')} | {_cell(shown_type)} | {req} | "
                        f"{_cell(p.get('description', ''))} |"
                    )
                out.append("")
            body = op.get("requestBody")
            if body:
                out.append(f"**{labels['body']}**: {_content_schema(body.get('content', {}))}")
                out.append("")
            responses = op.get("responses", {})
            if responses:
                out.append(f"**{labels['responses']}**")
                out.append("")
                out.append(f"| {labels['status']} | {labels['description']} | {labels['type']} |")
                out.append("|---|---|---|")
                for status, resp in responses.items():
                    out.append(
                        f"| `{status}` | {_cell(resp.get('description', ''))} | "
                        f"{_cell(_content_schema(resp.get('content', {})))} |"
                    )
                out.append("")
    schemas = spec.get("components", {}).get("schemas", {})
    if schemas:
        out.append(f"## {labels['schemas']} {{#schemas}}")
        out.append("")
        for name, schema in schemas.items():
            out.append(f"### {name} {{#{_schema_anchor(name)}}}")
            out.append("")
            if schema.get("description"):
                out.append(str(schema["description"]).strip())
                out.append("")
            props = schema.get("properties", {})
            if props:
                required = set(schema.get("required", []))
                out.append(
                    f"| {labels['field']} | {labels['type']} | {labels['required']} | "
                    f"{labels['default']} | {labels['description']} |"
                )
                out.append("|---|---|---|---|---|")
                for field, fschema in props.items():
                    req = labels["yes"] if field in required else labels["no"]
                    default = f"`{json.dumps(fschema['default'])}`" if "default" in fschema else ""
                    bounds = _constraints(fschema)
                    shown_type = _type_of(fschema) + (f" ({bounds})" if bounds else "")
                    out.append(
                        f"| `{field}` | {_cell(shown_type)} | {req} | {_cell(default)} | "
                        f"{_cell(fschema.get('description', ''))} |"
                    )
                out.append("")
            elif "enum" in schema:
                out.append(f"{labels['type']}: {_type_of(schema)}")
                out.append("")
    return "\n".join(out)


def render_rest_reference(labels: Mapping[str, str]) -> str:
    return render_openapi(load_openapi(), labels)


RENDERERS: dict[str, Callable[[Mapping[str, str]], str]] = {
    "ns-coefficients": render_ns_coefficients,
    "rest-reference": render_rest_reference,
    "recipe-flags": lambda labels: recipe_tables.render_flags(labels["lang"]),
    "recipe-presets": lambda labels: recipe_tables.render_presets(labels["lang"]),
    "glossary": lambda labels: glossary.render_glossary(labels["lang"]),
    # scaling-llama-3-8b, ...: the Scaling page's plans; see docs_hooks/scaling.py.
    **{
        name: (lambda labels, render=render: render(labels["lang"]))
        for name, render in scaling.RENDERERS.items()
    },
    # torch-muon-defaults, torch-muon-differences, ...: see docs_hooks/torch_muon.py.
    **{
        name: (lambda labels, render=render: render(labels["lang"]))
        for name, render in torch_muon.RENDERERS.items()
    },
}


def on_page_markdown(markdown: str, /, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace each ``<!-- generated: NAME -->`` marker with content rendered from code."""
    labels = _labels(page)

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        renderer = RENDERERS.get(name)
        if renderer is None:
            log.warning("%s: unknown generated block %r", page.file.src_uri, name)
            return match.group(0)
        try:
            return renderer(labels)
        except Exception as exc:  # the page must not silently lose its content
            log.warning(
                "%s: could not render %r from the code: %s: %s",
                page.file.src_uri,
                name,
                type(exc).__name__,
                exc,
            )
            return match.group(0)

    return MARKER.sub(replace, markdown)


DIAGRAM = re.compile(r"^<!-- diagram: (?P<name>[a-z0-9-]+) -->[ \t]*$", re.MULTILINE)


def on_page_content(html: str, /, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace each ``<!-- diagram: NAME -->`` with its inline SVG (``docs_hooks/diagrams.py``)."""
    lang = page_lang(page)

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        renderer = diagrams.RENDERERS.get(name)
        if renderer is None:
            log.warning("%s: unknown diagram %r", page.file.src_uri, name)
            return match.group(0)
        try:
            return renderer(lang)
        except Exception as exc:  # a missing diagram must fail the strict build
            log.warning(
                "%s: could not draw %r: %s: %s", page.file.src_uri, name, type(exc).__name__, exc
            )
            return match.group(0)

    return DIAGRAM.sub(replace, html)


ROOT_HREF = re.compile(r'(?P<attr>\b(?:href|src))="/(?P<path>(?!/)[^"]*)"')


def on_post_page(output: str, /, *, page: Page, config: MkDocsConfig) -> str:
    """Make root-absolute links relative (the language switcher of the home pages).

    The i18n plugin links the home page of each language as ``/`` and ``/zh/``; relative
    links keep the site working when it is served from a sub-path or opened from disk.
    """
    if page.file.src_uri == "404.md":
        return output
    depth = page.url.count("/") if page.url else 0
    up = "../" * depth

    def relative(match: re.Match[str]) -> str:
        target = up + match.group("path")
        return f'{match.group("attr")}="{target or "./"}"'

    return ROOT_HREF.sub(relative, output)
