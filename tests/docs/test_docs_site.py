"""Site plumbing of the built site: sitemap, 404 pages, titles, language links and search.

The browser-side behaviour (the language switcher keeping the #anchor, search queries
typed into the page) is checked in headless Chromium by ``test_docs_browser.py``.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from html import unescape as html_unescape
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from docs_md import REPO, built_page, en_pages, parse_html, rel

SITEMAP_NS = {"s": "http://www.sitemaps.org/schemas/sitemap/0.9"}


class _Loader(yaml.SafeLoader):
    """Reads mkdocs.yml, taking each ``!ENV [NAME, default]`` at its default."""


_Loader.add_constructor("!ENV", lambda loader, node: loader.construct_sequence(node)[-1])


def mkdocs_config() -> dict:
    return yaml.load((REPO / "mkdocs.yml").read_text(encoding="utf-8"), Loader=_Loader)


def test_sitemap_lists_real_addresses(site: Path) -> None:
    site_url = mkdocs_config()["site_url"]
    tree = ET.parse(site / "sitemap.xml")
    locs = [el.text or "" for el in tree.getroot().findall("s:url/s:loc", SITEMAP_NS)]
    assert locs, "empty sitemap"
    for loc in locs:
        assert loc.startswith(site_url), loc
        path = site / loc[len(site_url) :] / "index.html"
        assert path.is_file(), f"sitemap entry {loc} has no page"
    assert len(locs) == 2 * len(en_pages())


def test_no_page_asks_for_a_missing_sitemap(site: Path) -> None:
    """The theme fetches sitemap.xml next to every head hreflang link; each must exist."""
    for path in sorted(site.rglob("index.html")):
        head = path.read_text(encoding="utf-8").split("</head>", 1)[0]
        for href in re.findall(r'<link rel="alternate" href="([^"]*)" hreflang=', head):
            target = (path.parent / href).resolve() if not href.startswith("/") else site
            assert (target / "sitemap.xml").is_file(), f"{path}: {href}sitemap.xml is missing"


def _h1(path: Path) -> str:
    match = re.search(r"<h1[^>]*>(.*?)</h1>", path.read_text(encoding="utf-8"), re.S)
    assert match, f"{path}: no heading"
    return re.sub(r"<[^>]+>", "", match.group(1)).strip()


@pytest.mark.parametrize(
    ("lang", "file", "heading"),
    [("en", "404.html", "404 - Not found"), ("zh", "zh/404.html", "404 - 页面不存在")],
)
def test_a_404_page_per_language(site: Path, lang: str, file: str, heading: str) -> None:
    path = site / file
    html = path.read_text(encoding="utf-8")
    assert f'<html lang="{lang}"' in html
    assert _h1(path) == heading
    root = urlsplit(mkdocs_config()["site_url"]).path
    page = parse_html(path)
    assert page.alternates == {"en": root, "zh": f"{root}zh/"}, page.alternates
    # Its assets are addressed from the site root, so it works at any missing address.
    assert f'href="{root}assets/stylesheets/' in html


def _title(path: Path) -> str:
    match = re.search(r"<title>(.*?)</title>", path.read_text(encoding="utf-8"))
    assert match, path
    return match.group(1)


def test_titles_follow_one_pattern_in_both_languages(site: Path) -> None:
    name = mkdocs_config()["site_name"]
    assert _title(site / "index.html") == _title(site / "zh" / "index.html") == name
    for page in en_pages():
        if rel(page) == "index.md":
            continue
        for lang in ("en", "zh"):
            title = _title(built_page(site, rel(page), lang))
            assert title.endswith(f" - {name}") and title != f" - {name}", title


def test_language_links_carry_the_anchor_script(site: Path) -> None:
    for page in en_pages():
        for lang in ("en", "zh"):
            assets = parse_html(built_page(site, rel(page), lang)).assets
            assert any(url.endswith("javascripts/language-anchor.js") for _, url in assets), (
                f"{lang} {rel(page)} lacks the script that keeps the #anchor"
            )


def test_edit_links_only_with_a_repository(site: Path) -> None:
    has_repo = bool(mkdocs_config().get("repo_url"))
    html = (site / "concepts" / "index.html").read_text(encoding="utf-8")
    assert ("md-content__button" in html) == has_repo


# --------------------------------------------------------------------------- search


def _index(site: Path, lang: str) -> dict:
    root = site / "zh" if lang == "zh" else site
    return json.loads((root / "search" / "search_index.json").read_text(encoding="utf-8"))


def test_each_language_has_its_own_search_index(site: Path) -> None:
    for lang in ("en", "zh"):
        root = site / "zh" if lang == "zh" else site
        docs = _index(site, lang)["docs"]
        assert docs
        for doc in docs:
            page = doc["location"].split("#", 1)[0]
            assert (root / page / "index.html").is_file(), f"{lang}: {doc['location']}"
            assert not page.startswith("zh/"), f"{lang} index holds {doc['location']}"
    zh_text = "".join(d["text"] for d in _index(site, "zh")["docs"])
    en_text = "".join(d["text"] for d in _index(site, "en")["docs"])
    assert "微批次" in zh_text and "微批次" not in en_text
    # Every section is searchable in both languages, also those whose text is the same in
    # both (the API reference's English docstrings).
    locations = {lang: {d["location"] for d in _index(site, lang)["docs"]} for lang in ("en", "zh")}
    assert locations["en"] == locations["zh"], locations["en"] ^ locations["zh"]


def _config_base(path: Path) -> Path:
    match = re.search(r'<script id="__config" type="application/json">(.*?)</script>',
                      path.read_text(encoding="utf-8"), re.S)  # fmt: skip
    assert match, path
    return (path.parent / json.loads(match.group(1))["base"]).resolve()


def test_pages_search_their_own_language(site: Path) -> None:
    """The theme loads ``search/search_index.json`` from the page's base."""
    for page in en_pages():
        assert _config_base(built_page(site, rel(page), "en")) == site.resolve()
        assert _config_base(built_page(site, rel(page), "zh")) == (site / "zh").resolve()


def _words(doc: dict, separator: re.Pattern[str]) -> set[str]:
    return {w for w in separator.split(doc["title"] + " " + doc["text"]) if w}


@pytest.mark.parametrize(
    ("word", "page"),
    [("微批次", "gradient-accumulation/"), ("专属参数", "concepts/"), ("钩子边界", "concepts/")],
)
def test_project_words_stay_whole_in_the_chinese_index(site: Path, word: str, page: str) -> None:
    """jieba knows the project's vocabulary (``个微批次`` must not become ``个微 | 批次``)."""
    index = _index(site, "zh")
    separator = re.compile(index["config"]["separator"])
    pages = {d["location"].split("#", 1)[0] for d in index["docs"] if word in _words(d, separator)}
    assert page in pages, f"{word!r} is not a search term of zh/{page}; found on {sorted(pages)}"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_glossary_terms_have_hover_definitions(site: Path, lang: str) -> None:
    """Each glossary term is defined on the glossary page and hovers where it is used."""
    glossary = parse_html(built_page(site, "glossary.md", lang))
    concepts = built_page(site, "concepts.md", lang).read_text(encoding="utf-8")
    titles = re.findall(r'<abbr title="([^"]+)">([^<]+)</abbr>', concepts)
    assert len(titles) >= 5, titles
    for definition, _word in titles:
        plain = " ".join(html_unescape(definition).split())
        assert plain in glossary.text, f"{lang}: hover text not on the glossary page: {plain!r}"
