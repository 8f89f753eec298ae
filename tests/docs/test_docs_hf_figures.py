"""The figures of "Train your own model" are the committed results, in both languages.

Oracle: ``benchmarks/results/hf_recipe*.json`` (written by ``benchmarks/hf_recipe.py``),
read here directly; every figure the page states is formatted here from them and must
appear on both pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = {"en": ROOT / "docs" / "train-your-own-model.md",
         "zh": ROOT / "docs" / "zh" / "train-your-own-model.md"}  # fmt: skip


def figures(result: dict) -> list[str]:
    """The cells the page's table shows for one result file."""
    s = result["settings"]
    tokens = s["nproc"] * s["accum_steps"] * s["micro_batch_size"] * s["seq_len"]
    adamw, dmuon = result["runs"]["adamw"], result["runs"]["dmuon"]
    return [
        f"{tokens:,}",
        f"{adamw['median_step_s']:.1f} s",
        f"{adamw['tokens_per_s']:,.0f}",
        f"{dmuon['median_step_s']:.1f} s",
        f"{dmuon['tokens_per_s']:,.0f}",
        f"{result['step_ratio_dmuon_over_adamw']:.2f}x",
    ]


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_figures_are_the_committed_results(lang: str) -> None:
    text = PAGES[lang].read_text(encoding="utf-8")
    results = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("hf_recipe*.json"))]
    assert results
    for result in results:
        row = "| " + " | ".join(figures(result)) + " |"
        assert row in text, f"{lang}: no row {row}"
        assert f"{result['model_params'] / 1e6:.1f} M" in text
        assert result["tokenization"]["corpus_bytes"] >= 100e6
        s = result["settings"]
        for fact in (
            f"{s['vocab']:,}",
            f"{s['rounds']} rounds" if lang == "en" else f"共 {s['rounds']} 轮",
            f"{s['seq_len']}",
            f"{s['micro_batch_size']}",
            f"{result['machine']['load_average'][0]:.1f}",
            f"{s['mode']}".upper(),
        ):
            assert fact in text, (lang, fact)
        for ratio in result["round_ratios"]:
            assert f"{ratio:.2f}x" in text, (lang, ratio)
        for name in ("bpe", "bytes"):
            assert f"{result['tokenization'][name]['mb_per_s']:.1f} MB/s" in text, (lang, name)
