"""The built site as readers see it, in headless Chromium (Debian's package, via Playwright).

The home, gradient-accumulation and Z2 vs Z3 pages are rendered in both languages, light
and dark, at 1,280 and 390 px wide. Each render fails on a table with a horizontal
scrollbar, a missing diagram, a code block that wraps its lines instead of scrolling, a
first example on the home page that does not fit at desktop width, or a request the site
cannot answer; a render that fails is saved, whole page, under
``test-artifacts/screenshots/`` (every render is with ``DMUON_SCREENSHOTS=1``: full-page
screenshots would be most of these tests' time). Diagram labels must not overlap
each other or run out of their boxes. The language switcher and Chinese search are checked
the way a reader uses them.

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
SCREENSHOT_EVERY_RENDER = os.environ.get("DMUON_SCREENSHOTS") == "1"

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
  // Code keeps its lines (indentation reads as written) and scrolls sideways when too wide.
  const wrapping = [...document.querySelectorAll('.md-content pre > code')]
    .filter((el) => getComputedStyle(el).whiteSpace !== 'pre'
      || !['auto', 'scroll'].includes(getComputedStyle(el).overflowX))
    .map((el) => el.textContent.trim().slice(0, 40));
  return {tables, page, diagrams, wrapping, firstCodeCut: firstCode ? wide(firstCode) : null};
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
                found = page.evaluate(OVERFLOW_JS)
                where = f"{lang}/{name} at {width}px ({scheme})"
                before = len(problems)
                if found["tables"]:
                    problems.append(f"{where}: tables scroll sideways: {found['tables']}")
                if found["page"]:
                    problems.append(f"{where}: the page scrolls sideways")
                if path in DIAGRAM_PAGES and found["diagrams"] < 1:
                    problems.append(f"{where}: diagram missing")
                if found["wrapping"]:
                    problems.append(f"{where}: code blocks wrap: {found['wrapping']}")
                if path == "" and width >= 1000 and found["firstCodeCut"]:
                    problems.append(f"{where}: the first example does not fit")
                if len(problems) > before or SCREENSHOT_EVERY_RENDER:
                    page.screenshot(
                        path=str(ARTIFACTS / f"{name}-{lang}-{scheme}-{width}.png"), full_page=True
                    )
    finally:
        context.close()
    assert not missing, f"requests the site cannot answer: {missing}"
    assert not problems, "\n".join(problems)


DIAGRAM_LAYOUT_JS = """() => {
  const problems = [];
  for (const figure of document.querySelectorAll('figure.dmuon-diagram')) {
    const name = figure.dataset.diagram;
    const svg = figure.querySelector('svg');
    const view = svg.viewBox.baseVal;
    const texts = [...svg.querySelectorAll('text')].map((el) => ({el, box: el.getBBox()}));
    const rects = [...svg.querySelectorAll('rect')].map((el) => el.getBBox());
    const inside = (a, b, slack) => a.x >= b.x - slack && a.y >= b.y - slack
      && a.x + a.width <= b.x + b.width + slack && a.y + a.height <= b.y + b.height + slack;
    // Boxes include the font's line gap (CJK faces: about 1.5 em), so stacked lines touch;
    // a collision is an overlap of more than a quarter of a line.
    const overlap = (a, b) => a.x < b.x + b.width - 1 && b.x < a.x + a.width - 1
      && Math.min(a.y + a.height, b.y + b.height) - Math.max(a.y, b.y)
        > 0.25 * Math.min(a.height, b.height);
    for (const [i, t] of texts.entries()) {
      const label = t.el.textContent;
      if (!inside(t.box, view, 0)) problems.push(`${name}: '${label}' runs out of the drawing`);
      // The smallest box the label starts in must hold all of it.
      const x = +t.el.getAttribute('x'), y = +t.el.getAttribute('y');
      const anchor = t.el.getAttribute('text-anchor') === 'middle' ? x : x + 1;
      const holders = rects.filter((r) => anchor >= r.x && anchor <= r.x + r.width
        && y - 3 >= r.y && y - 3 <= r.y + r.height);
      holders.sort((a, b) => a.width * a.height - b.width * b.height);
      if (holders.length && !inside(t.box, holders[0], 1.5)) {
        problems.push(`${name}: '${label}' runs out of its box`);
      }
      for (const u of texts.slice(i + 1)) {
        if (overlap(t.box, u.box)) {
          problems.push(`${name}: '${label}' overlaps '${u.el.textContent}'`);
        }
      }
    }
  }
  return problems;
}"""


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_diagram_labels_do_not_collide(base_url: str, browser: Any, lang: str) -> None:
    """Every label of every diagram, measured as the browser lays it out."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems = []
    try:
        for path in ("concepts/", "gradient-accumulation/", "z2-vs-z3/"):
            page.goto(base_url + ("zh/" if lang == "zh" else "") + path, wait_until="load")
            problems += [f"{lang}/{path}: {p}" for p in page.evaluate(DIAGRAM_LAYOUT_JS)]
    finally:
        page.close()
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


def test_a_chinese_query_on_the_english_site_points_to_the_chinese_search(
    base_url: str, browser: Any
) -> None:
    """梯度累积 finds nothing on the English pages; the empty result links to the Chinese
    site's search for it, which finds the guide, with titles free of zero-width spaces."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(base_url + "quickstart/")
        box = page.locator("input.md-search__input")
        box.click()
        page.keyboard.type("梯度累积")
        page.keyboard.press("End")  # the theme searches on key events; typed CJK sends none
        hint = page.locator(".md-search-result__meta .dmuon-search-hint")
        hint.wait_for(timeout=15_000)
        href = hint.get_attribute("href") or ""
        assert href.startswith(base_url + "zh/?q="), href
        page.goto(href)
        page.wait_for_selector(".md-search-result__item", timeout=15_000)
        links = page.locator(".md-search-result__item > a").evaluate_all(
            "links => links.map((a) => a.href)"
        )
        assert any("zh/gradient-accumulation/" in link for link in links), links
        titles = page.locator(".md-search-result__item h1, .md-search-result__item h2")
        texts = titles.evaluate_all("ts => ts.map((t) => t.textContent)")
        assert texts and not any("\u200b" in t for t in texts), texts
    finally:
        page.close()
