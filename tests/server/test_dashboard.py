"""The dashboard's files as the server serves them (no browser): public, same-origin only,
complete, translated, and with the vendored library unchanged."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from server_helpers import finish_all_jobs, make_settings

from dmuon_server.app import create_app
from dmuon_server.http.dashboard import STATIC_DIR

TOKEN = "t0ken"


@pytest.fixture
def token_client(tmp_path: Path, data_dir: Path, fake_env: None) -> TestClient:
    """An in-process server that requires a token."""
    app = create_app(make_settings(tmp_path, data_dir=data_dir, token=TOKEN))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
        c.headers["Authorization"] = f"Bearer {TOKEN}"
        finish_all_jobs(c)


def _own_files(suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(
        p
        for p in STATIC_DIR.rglob("*")
        if p.suffix in suffixes and "vendor" not in p.relative_to(STATIC_DIR).parts
    )


def test_page_loads_without_token_but_the_api_still_needs_one(token_client: TestClient) -> None:
    page = token_client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "<title>DMuon jobs</title>" in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    script = token_client.get("/ui/js/main.js")
    assert script.status_code == 200
    assert "javascript" in script.headers["content-type"]
    assert token_client.head("/ui/dashboard.css").status_code == 200

    for path in ("/v1/jobs", "/openapi.json", "/metrics"):
        assert token_client.get(path).status_code == 401, path
    authorised = token_client.get("/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"})
    assert authorised.status_code == 200


def test_only_the_dashboards_files_are_served(token_client: TestClient) -> None:
    missing = token_client.get("/ui/nope.js")
    assert missing.status_code == 404
    assert missing.headers["content-type"] == "application/problem+json"
    assert missing.json()["status"] == 404 and "/ui/nope.js" in missing.json()["detail"]
    # A path that climbs out of the static folder finds nothing.
    assert token_client.get("/ui/%2e%2e/dashboard.py").status_code == 404
    assert token_client.get("/ui/..%2fdashboard.py").status_code == 404
    # Other methods on / reach the API (and its token check), not the files.
    assert token_client.post("/").status_code == 401
    schema = token_client.get("/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert not [p for p in schema.json()["paths"] if p == "/" or p.startswith("/ui")]


def test_every_local_reference_resolves(token_client: TestClient) -> None:
    html = (STATIC_DIR / "index.html").read_text()
    refs = re.findall(r'(?:src|href)="(/[^"]*)"', html)
    assert len(refs) >= 4
    for ref in refs:
        assert token_client.get(ref).status_code == 200, ref
    for js in _own_files((".js",)):
        for target in re.findall(r'from "(\.{1,2}/[^"]+)"', js.read_text()):
            assert (js.parent / target).resolve().is_file(), f"{js.name} imports {target}"


def test_no_address_outside_the_service_in_the_dashboards_own_files() -> None:
    files = _own_files((".html", ".js", ".css", ".svg"))
    assert len(files) >= 10
    for f in files:
        text = f.read_text()
        if f.suffix == ".svg":  # the XML namespace is a name, not a request
            text = text.replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), f.name


def test_vendored_files_match_their_recorded_sums() -> None:
    readme = (STATIC_DIR / "vendor" / "README.md").read_text()
    sums = re.findall(r"^([0-9a-f]{64})  (\S+)$", readme, re.M)
    assert len(sums) == 3
    for digest, name in sums:
        data = (STATIC_DIR / "vendor" / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, name
    vendored = {
        p.relative_to(STATIC_DIR / "vendor").as_posix()
        for p in (STATIC_DIR / "vendor").rglob("*")
        if p.is_file()
    }
    assert vendored - {"README.md"} == {name for _, name in sums}


def _text_keys(lang: str) -> set[str]:
    source = (STATIC_DIR / "js" / "i18n.js").read_text()
    en_start, zh_start = source.index("  en: {"), source.index("  zh: {")
    block = source[en_start:zh_start] if lang == "en" else source[zh_start:]
    block = block[: block.index("\n  },")]
    return set(re.findall(r'(?:^|[{,])\s*"?([A-Za-z_][\w.]*)"?\s*:\s*"', block, re.M))


def test_english_and_chinese_have_the_same_texts_and_every_used_key_exists() -> None:
    en, zh = _text_keys("en"), _text_keys("zh")
    assert len(en) > 100
    assert en == zh
    used = set(
        re.findall(r'data-i18n(?:-aria)?="([\w.]+)"', (STATIC_DIR / "index.html").read_text())
    )
    for js in _own_files((".js",)):
        used |= set(re.findall(r'\bt\("([\w.]+)"', js.read_text()))
    assert used, "no text key found"
    assert used <= en, f"keys without a text: {sorted(used - en)}"
