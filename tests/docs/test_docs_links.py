"""No broken internal link or anchor anywhere in the built site."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from urllib.parse import unquote, urlsplit

from docs_md import HtmlPage, parse_html


def test_internal_links_and_anchors_resolve(site: Path) -> None:
    @cache
    def page(path: Path) -> HtmlPage:
        return parse_html(path)

    broken: list[str] = []
    checked = 0
    for path in sorted(site.rglob("*.html")):
        if path.name == "404.html":
            continue  # served for any missing URL, so its links are root-absolute by design
        for href in page(path).links:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
                continue
            if parts.path.startswith("/"):
                broken.append(f"{path.relative_to(site)}: absolute link {href}")
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir() or parts.path.endswith("/"):
                target = target / "index.html"
            checked += 1
            if not target.is_file():
                broken.append(f"{path.relative_to(site)}: {href} -> missing {target}")
                continue
            fragment = unquote(parts.fragment)
            if fragment and target.suffix == ".html" and fragment not in page(target).ids:
                broken.append(f"{path.relative_to(site)}: {href} -> no anchor #{fragment}")
    assert checked > 100, f"only {checked} links found; is the site empty?"
    assert not broken, "\n".join(broken[:50])
