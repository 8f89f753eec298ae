"""MkDocs hook: the parts of a two-language site that the theme and the i18n plugin leave open.

The i18n plugin builds the site once per language into the same folder. This hook:

* gives each language its own search index (``search/search_index.json`` holds the English
  pages, ``zh/search/search_index.json`` the Chinese ones) and points the Chinese pages'
  search at theirs, so a search on a Chinese page returns Chinese pages. The i18n plugin
  drops a Chinese section whose title and text equal the English one (the API reference,
  generated from English docstrings), expecting one shared index; each such section is put
  back into the Chinese index, so it finds everything its pages show;
* keeps one 404 page per language (``404.html`` in English, ``zh/404.html`` in Chinese),
  each with its own chrome and language links to the two home pages;
* drops the ``<link rel="alternate" hreflang>`` tags from page heads: the theme fetches a
  ``sitemap.xml`` next to every such link, which only exists at the site root. The
  sitemap itself lists every page with its translations, and the visible language
  switcher is unchanged.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority, get_plugin_logger
from mkdocs.structure.pages import Page

log = get_plugin_logger("dmuon-i18n")

DEFAULT_LANG = "en"
OTHER_LANGS = ("zh",)

HEAD_ALTERNATE = re.compile(r'[ \t]*<link rel="alternate" href="[^"]*" hreflang="[^"]*">\n?')
CONFIG_BASE = re.compile(
    r'(<script id="__config" type="application/json">\{[^<]*?"base": ")([^"]*)(")'
)

_saved_404: dict[str, str] = {}


def _i18n(config: MkDocsConfig) -> Any:
    return config.plugins.get("i18n")


def current_language(config: MkDocsConfig) -> str:
    """The language the i18n plugin is building now."""
    plugin = _i18n(config)
    return str(getattr(plugin, "current_language", None) or DEFAULT_LANG)


def _site_path(config: MkDocsConfig) -> str:
    """The path the site is served under, from ``site_url`` (``/`` by default)."""
    url = config.site_url or "/"
    path = "/" + url.split("://", 1)[-1].partition("/")[2]
    return path if path.endswith("/") else path + "/"


def _home(config: MkDocsConfig, lang: str) -> str:
    """Absolute path of a language's home page."""
    root = _site_path(config)
    return root if lang == DEFAULT_LANG else f"{root}{lang}/"


def on_template_context(
    context: dict[str, Any], /, *, template_name: str, config: MkDocsConfig
) -> dict[str, Any]:
    """The 404 page's language and home page (a 404 page is served at any address)."""
    if template_name == "404.html":
        context["dmuon_lang"] = current_language(config)
        context["dmuon_home"] = _home(config, context["dmuon_lang"])
    return context


SWITCHER_LINK = re.compile(r'<a href="[^"]*" hreflang="(?P<lang>[^"]+)" class="md-select__link">')


def _page_lang(page: Page) -> str:
    return str(getattr(page.file, "locale", None) or DEFAULT_LANG)


def on_post_page(output: str, /, *, page: Page, config: MkDocsConfig) -> str:
    """Remove head hreflang links; send a translated page's search to its own index."""
    output = HEAD_ALTERNATE.sub("", output)
    lang = _page_lang(page)
    if lang != DEFAULT_LANG:

        def rebase(match: re.Match[str]) -> str:
            base = match.group(2).rstrip("/") or "."
            return f"{match.group(1)}{base}/{lang}/{match.group(3)}"

        output = CONFIG_BASE.sub(rebase, output, count=1)
    return output


def on_post_template(output: str, /, *, template_name: str, config: MkDocsConfig) -> str:
    """Fix the 404 page's language links; remember the page (the next language overwrites it)."""
    if template_name == "404.html":
        # The language links lead to the home pages, by absolute path.
        output = SWITCHER_LINK.sub(
            lambda m: (
                f'<a href="{_home(config, m.group("lang"))}" hreflang="{m.group("lang")}" '
                'class="md-select__link">'
            ),
            output,
        )
        _saved_404[current_language(config)] = output
    return output


@event_priority(-200)  # after the i18n plugin has built every language and the search index
def on_post_build(*, config: MkDocsConfig) -> None:
    """Once every language is built: write each 404 page and split the search index."""
    if getattr(_i18n(config), "building", False):
        return  # a language built from within the first build; the first one finishes
    site = Path(config.site_dir)
    for lang, html in _saved_404.items():
        target = site / "404.html" if lang == DEFAULT_LANG else site / lang / "404.html"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(html, encoding="utf-8")
    _saved_404.clear()
    split_search_index(site)


def split_search_index(site: Path) -> None:
    """One search index per language; locations relative to that language's root."""
    index_path = site / "search" / "search_index.json"
    if not index_path.is_file():
        log.warning("no search index at %s", index_path)
        return
    index = json.loads(index_path.read_text(encoding="utf-8"))
    docs = index.get("docs", [])
    others = tuple(f"{lang}/" for lang in OTHER_LANGS)
    default_docs = [doc for doc in docs if not doc["location"].startswith(others)]
    for lang in OTHER_LANGS:
        prefix = f"{lang}/"
        mine = [
            {**doc, "location": doc["location"][len(prefix) :]}
            for doc in docs
            if doc["location"].startswith(prefix)
        ]
        # Sections the i18n plugin removed as duplicates had the English title and text.
        have = {doc["location"] for doc in mine}
        mine += [
            doc
            for doc in default_docs
            if doc["location"] not in have
            and (site / lang / doc["location"].split("#", 1)[0]).is_dir()
        ]
        target = site / lang / "search" / "search_index.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(
            json.dumps({**index, "docs": mine}, ensure_ascii=False, separators=(",", ":")),
            encoding="utf-8",
        )
    index_path.write_text(
        json.dumps({**index, "docs": default_docs}, ensure_ascii=False, separators=(",", ":")),
        encoding="utf-8",
    )
