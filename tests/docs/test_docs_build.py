"""The site builds strictly, in both languages, with search and nothing loaded from outside."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import Build
from docs_md import built_page, en_pages, parse_html, rel, zh_pages


def html_pages(site: Path) -> list[Path]:
    return sorted(p for p in site.rglob("*.html") if p.name != "404.html")


def test_strict_build_succeeds(build: Build) -> None:
    assert build.returncode == 0, "mkdocs build --strict failed:\n" + build.log[-6000:]


def test_every_page_is_built_in_both_languages(site: Path) -> None:
    for page in en_pages():
        assert built_page(site, rel(page), "en").is_file(), rel(page)
    for page in zh_pages():
        assert built_page(site, rel(page), "zh").is_file(), "zh/" + rel(page)


def test_language_switcher_on_every_page(site: Path) -> None:
    for path in html_pages(site):
        page = parse_html(path)
        assert set(page.alternates) >= {"en", "zh"}, f"{path}: no language switcher"
        for lang, href in page.alternates.items():
            target = (path.parent / href).resolve()
            target = target / "index.html" if href.endswith("/") else target
            assert target.is_file(), f"{path}: {lang} switcher points to missing {href}"
        # The switcher leads to the same page in the other language, not to the home page.
        relative = path.relative_to(site).as_posix()
        is_zh = relative.startswith("zh/")
        mirror = relative[3:] if is_zh else "zh/" + relative
        other = "en" if is_zh else "zh"
        target = (path.parent / page.alternates[other]).resolve()
        target = target / "index.html" if page.alternates[other].endswith("/") else target
        assert target == (site / mirror).resolve(), f"{relative}: switcher -> {target}"


def test_navigation_labels_translated(site: Path) -> None:
    en = (site / "index.html").read_text(encoding="utf-8")
    zh = (site / "zh" / "index.html").read_text(encoding="utf-8")
    for en_label, zh_label in [
        ("Gradient accumulation", "梯度累积"),
        ("Core concepts", "核心概念"),
        ("Troubleshooting", "故障排查"),
        ("API reference", "API 参考"),
    ]:
        assert en_label in en
        assert zh_label in zh, f"navigation label {en_label!r} is not translated"
        assert en_label not in zh, f"untranslated navigation label {en_label!r} on zh pages"
    assert '<html lang="zh"' in zh


EXTERNAL = re.compile(r"^(?:https?:)?//", re.IGNORECASE)


def test_nothing_loaded_from_the_internet(site: Path) -> None:
    """Scripts, styles, fonts and images all come from the site itself."""
    problems: list[str] = []
    for path in html_pages(site):
        for kind, url in parse_html(path).assets:
            if kind.startswith("link[") and not re.search(
                r"stylesheet|preload|icon|modulepreload|prefetch|manifest", kind
            ):
                continue  # alternate/canonical links are navigation, not loads
            if EXTERNAL.match(url):
                problems.append(f"{path.relative_to(site)}: {kind} {url}")
    for css in site.rglob("*.css"):
        text = css.read_text(encoding="utf-8", errors="replace")
        for url in re.findall(r"url\(\s*['\"]?((?:https?:)?//[^)'\"]+)", text):
            problems.append(f"{css.relative_to(site)}: url({url})")
        if "@import" in text and re.search(r"@import\s+(url\()?['\"]?(https?:)?//", text):
            problems.append(f"{css.relative_to(site)}: remote @import")
    assert not problems, "\n".join(problems)


def test_search_covers_both_languages(site: Path) -> None:
    """Each language has an index of its own pages; Chinese text is segmented into words."""
    en_index = json.loads((site / "search" / "search_index.json").read_text(encoding="utf-8"))
    zh_index = json.loads((site / "zh" / "search" / "search_index.json").read_text("utf-8"))
    assert {"en", "zh"} <= set(zh_index["config"]["lang"])
    assert en_index["docs"] and zh_index["docs"]
    separator = re.compile(zh_index["config"]["separator"])
    words: set[str] = set()
    for doc in zh_index["docs"]:
        if doc["location"].startswith("gradient-accumulation/"):
            words.update(w for w in separator.split(doc["title"] + " " + doc["text"]) if w)
    assert "梯度" in words or "梯度累积" in words, sorted(words)[:50]
    assert "\u200b" in "".join(d["text"] for d in zh_index["docs"]), "Chinese text not segmented"
