"""Pages rendered from the code show exactly what the code has."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from docs_md import built_page, load_hook, parse_html


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_newton_schulz_table_matches_code(lang: str, site: Path) -> None:
    # The module, not the function of the same name that dmuon.optim re-exports.
    ns = importlib.import_module("dmuon.optim._orthogonalize")
    text = parse_html(built_page(site, "newton-schulz.md", lang)).text
    for name, triples in ns.COEFFICIENT_SETS.items():
        assert name in text
        for triple in triples:
            for value in triple:
                assert repr(float(value)) in text, f"{name}: {value!r} missing"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_rest_reference_lists_every_operation(lang: str, site: Path) -> None:
    hook = load_hook()
    spec = hook.load_openapi()
    page = parse_html(built_page(site, "reference/rest.md", lang))
    missing = [
        f"{method.upper()} {path}"
        for path, item in spec["paths"].items()
        for method in item
        if method in {"get", "post", "put", "patch", "delete"}
        and hook._op_anchor(method, path) not in page.ids
    ]
    assert not missing, f"operations missing from the REST reference: {missing}"
    for name in spec.get("components", {}).get("schemas", {}):
        assert name in page.text, f"schema {name} missing from the REST reference"
