"""The built site as readers see it, in headless Chromium (Debian's package, via Playwright).

Screenshots of the home, gradient-accumulation and Z2 vs Z3 pages in both languages, light
and dark, at 1,280 and 390 px wide, are kept under ``test-artifacts/screenshots/``. Each
render fails on a table with a horizontal scrollbar, a missing diagram, a cut first
example on the home page, or a request the site cannot answer. The language switcher and
Chinese search are checked the way a reader uses them.

Without Chromium these tests skip, except in CI (``CI=true``), where they must run.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from docs_md import REPO

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = REPO / "test-artifacts" / "screenshots"

if not CHROMIUM and os.environ.get("CI") != "true":
    pytest.skip(
        "Chromium is not installed (apt-get install chromium fonts-noto-cjk); "
        "the browser tests run in CI",
        allow_module_level=True,
    )

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

PAGES = {"": "home", "gradient-accumulation/": "gradient-accumulation", "z2-vs-z3/": "z2-vs-z3"}
DIAGRAM_PAGES = {"gradient-accumulation/", "z2-vs-z3/"}
WIDTHS = (1280, 390)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def base_url(site: Path) -> Iterator[str]:
    """The built site over HTTP on a free port (as a static host serves it)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    assert CHROMIUM, "CI=true but Chromium is not installed (see .ci/run)"
    with sync_api.sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=CHROMIUM)
        yield instance
        instance.close()


OVERFLOW_JS = """() => {
  const wide = (el) => el.scrollWidth > el.clientWidth + 1;
  const tables = [...document.querySelectorAll('.md-typeset__table, .md-typeset__scrollwrap')]
    .filter(wide).map((el) => (el.querySelector('th') || el).textContent.trim().slice(0, 40));
  const page = document.documentElement.scrollWidth > window.innerWidth + 1;
  const diagrams = [...document.querySelectorAll('figure.dmuon-diagram svg')]
    .filter((svg) => svg.getBoundingClientRect().width > 100).length;
  const firstCode = document.querySelector('.md-content pre > code');
  return {tables, page, diagrams, firstCodeCut: firstCode ? wide(firstCode) : null};
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("width", WIDTHS)
def test_pages_render_without_overflow(
    base_url: str, browser: Any, width: int, scheme: str
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(
        viewport={"width": width, "height": 900}, color_scheme=scheme, device_scale_factor=1
    )
    page = context.new_page()
    missing: list[str] = []
    page.on("response", lambda r: missing.append(r.url) if r.status >= 400 else None)
    problems: list[str] = []
    try:
        for lang_prefix in ("", "zh/"):
            for path, name in PAGES.items():
                page.goto(base_url + lang_prefix + path, wait_until="load")
                lang = "zh" if lang_prefix else "en"
                page.screenshot(
                    path=str(ARTIFACTS / f"{name}-{lang}-{scheme}-{width}.png"), full_page=True
                )
                found = page.evaluate(OVERFLOW_JS)
                where = f"{lang}/{name} at {width}px ({scheme})"
                if found["tables"]:
                    problems.append(f"{where}: tables scroll sideways: {found['tables']}")
                if found["page"]:
                    problems.append(f"{where}: the page scrolls sideways")
                if path in DIAGRAM_PAGES and found["diagrams"] < 1:
                    problems.append(f"{where}: diagram missing")
                if path == "" and found["firstCodeCut"]:
                    problems.append(f"{where}: the first example does not fit")
    finally:
        context.close()
    assert not missing, f"requests the site cannot answer: {missing}"
    assert not problems, "\n".join(problems)


def test_language_switch_keeps_the_anchor(base_url: str, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        en, zh = base_url + "concepts/#which-parameters", base_url + "zh/concepts/#which-parameters"
        page.goto(en)
        page.locator("a.md-select__link[hreflang=zh]").dispatch_event("click")
        page.wait_for_url(lambda url: url == zh)
        page.locator("a.md-select__link[hreflang=en]").dispatch_event("click")
        page.wait_for_url(lambda url: url == en)
    finally:
        page.close()


def _search(page: Any, query: str) -> list[str]:
    """Type ``query`` into the search box and return the result links, best first."""
    box = page.locator("input.md-search__input")
    box.click()
    box.fill("")
    page.keyboard.type(query)
    page.keyboard.press("End")  # the theme searches on key events; typed CJK sends none
    page.wait_for_selector(".md-search-result__item", timeout=15_000)
    hrefs = page.locator(".md-search-result__item > a").evaluate_all(
        "links => links.map((a) => a.href)"
    )
    return [h.split("?", 1)[0] for h in hrefs]


REFERENCES = ("zh/reference/api/", "zh/reference/rest/")


@pytest.mark.parametrize(
    ("query", "expected"),
    [("微批次", "zh/gradient-accumulation/"), ("专属参数", "zh/concepts/")],
)
def test_chinese_search_finds_the_guide(
    base_url: str, browser: Any, query: str, expected: str
) -> None:
    """The guide for the term is among the first three pages, ahead of the references."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(base_url + "zh/quickstart/")
        results = _search(page, query)
        assert all(r.startswith(base_url + "zh/") for r in results), results
        pages = list(dict.fromkeys(r.split("#", 1)[0][len(base_url) :] for r in results))
        assert expected in pages[:3], f"{query}: {pages[:6]}"
        before = pages[: pages.index(expected)]
        assert not any(ref in before for ref in REFERENCES), f"{query}: {pages[:6]}"
    finally:
        page.close()
