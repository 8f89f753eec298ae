"""The benchmarks page in each language: its figures, which run sits where, step times.

Oracles: the committed results (``benchmarks/results/*.json``: the machine each run was
taken on, its step times) and the PNG files themselves (their ``Description`` metadata,
written by ``benchmarks/plots.py``, holds every text the figure shows).
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path

import pytest
from docs_md import DOCS, REPO, ZH, built_page

RESULTS = REPO / "benchmarks" / "results"
HAN = re.compile(r"[\u4e00-\u9fff]")


def png_text(path: Path) -> dict[str, str]:
    """The tEXt, zTXt and iTXt entries of a PNG file."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    entries: dict[str, str] = {}
    pos = 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            entries[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            entries[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _language, _, rest = rest.partition(b"\0")
            _translated, _, text = rest.partition(b"\0")
            entries[key.decode("latin-1")] = (zlib.decompress(text) if compressed else text).decode(
                "utf-8"
            )
    return entries


def _images(site: Path, lang: str) -> list[Path]:
    """The benchmark figures the built page shows, as files of the built site."""
    page = built_page(site, "benchmarks.md", lang)
    sources = re.findall(r'<img[^>]+src="([^"]*assets/benchmarks/[^"]+\.png)"', page.read_text())
    return [(page.parent / src).resolve() for src in sources]


def test_each_language_shows_figures_drawn_in_it(site: Path) -> None:
    en, zh = _images(site, "en"), _images(site, "zh")
    assert len(en) == len(zh) >= 4
    for english, chinese in zip(en, zh, strict=True):
        assert english.name == chinese.name
        assert (site / "zh") in chinese.parents, chinese
        en_text = png_text(english).get("Description", "")
        zh_text = png_text(chinese).get("Description", "")
        assert en_text and not HAN.search(en_text), f"{english.name}: {en_text[:200]}"
        assert HAN.search(zh_text), f"zh {chinese.name} has no Chinese text: {zh_text[:200]}"
        assert english.read_bytes() != chinese.read_bytes()


def _markers_by_section(path: Path) -> dict[str, list[str]]:
    """Section anchor -> names of the results its ``benchmark:`` markers render."""
    sections: dict[str, list[str]] = {}
    current = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"#+ .*\{#([\w-]+)\}\s*$", line)
        if heading:
            current = heading.group(1)
        marker = re.match(r"<!-- benchmark: [a-z-]+ ([\w.-]+) -->", line)
        if marker:
            sections.setdefault(current, []).append(marker.group(1))
    return sections


def _native_bf16(name: str) -> bool:
    return bool(json.loads((RESULTS / f"{name}.json").read_text())["machine"]["native_bf16"])


@pytest.mark.parametrize("root", [DOCS, ZH], ids=["en", "zh"])
def test_runs_sit_under_the_machine_their_section_names(root: Path) -> None:
    """ "Targets" is about the CPU without native bfloat16 (AVX2), "On a CPU with native
    bfloat16" about the AMX one: every run rendered in each must come from that machine."""
    sections = _markers_by_section(root / "benchmarks.md")
    assert sections["targets"] and sections["small-amx"]
    for name in sections["targets"]:
        assert not _native_bf16(name), f"{name} ran with native bfloat16, shown under AVX2"
    for name in sections["small-amx"]:
        assert _native_bf16(name), f"{name} ran without native bfloat16, shown under AMX"


def _ms(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


SPAN = {
    "en": "{lo} to {hi} ms at accumulation {accum}",
    "zh": "梯度累积 {accum} 时 {lo} 至 {hi} 毫秒",
}


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_gpu_step_times_are_the_results(site: Path, lang: str) -> None:
    """The one-GPU section states the fastest and slowest median step per accumulation of
    each run (they were called "tens of milliseconds"; base at accumulation 8 takes 249 ms
    and more)."""
    html = built_page(site, "benchmarks.md", lang).read_text(encoding="utf-8")
    section = re.sub(r"<[^>]+>", "", html.split('id="gpu-distributed"', 1)[1])
    for name in ("cuda-small-n1", "cuda-base-n1"):
        result = json.loads((RESULTS / f"{name}.json").read_text())
        for accum in sorted({r["accum"] for r in result["rows"]}):
            times = [r["median_step_s"] * 1e3 for r in result["rows"] if r["accum"] == accum]
            span = SPAN[lang].format(lo=_ms(min(times)), hi=_ms(max(times)), accum=accum)
            assert span in section, (name, span)
