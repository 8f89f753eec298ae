"""Every cell of the training guide's flag and preset tables matches the code, in both languages.

The oracle for flags is argparse itself (what ``parse_args([])`` returns and the choices it
accepts); the oracle for parameter counts is the model built on the meta device, counted
tensor by tensor, not the formula the page is rendered from.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from docs_md import built_page, html_tables


def _parser() -> argparse.ArgumentParser:
    from dmuon.train.cli import build_parser

    return build_parser()


def _table_with_header(site: Path, lang: str, first_header: str) -> list[list[str]]:
    for table in html_tables(built_page(site, "training.md", lang)):
        if table and table[0] and table[0][0] == first_header:
            return table
    raise AssertionError(f"{lang} training page has no table headed {first_header!r}")


FLAG_HEADER = {"en": "flag", "zh": "参数"}
PRESET_HEADER = {"en": "preset", "zh": "预设"}


def _spelled(value: object) -> str:
    if isinstance(value, bool):  # a switch: the command line's spelling
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_flag_table_cells_match_the_parser(lang: str, site: Path) -> None:
    parser = _parser()
    defaults = vars(parser.parse_args([]))
    options = {
        s: a
        for a in parser._actions
        for s in a.option_strings
        if s.startswith("--") and s != "--help"
    }
    rows = _table_with_header(site, lang, FLAG_HEADER[lang])[1:]
    documented = {row[0].split(" ", 1)[0]: row for row in rows}
    assert set(documented) == set(options), (
        f"missing: {set(options) - set(documented)}, extra: {set(documented) - set(options)}"
    )
    for flag, (invocation, default, meaning) in documented.items():
        action = options[flag]
        if action.choices is not None:
            assert invocation == f"{flag} {{{','.join(map(str, action.choices))}}}", invocation
        value = defaults[action.dest]
        if value is not None:
            assert default == _spelled(value), f"{lang} {flag}: default {default!r}, code {value!r}"
        else:
            assert default and not default[0].isdigit(), f"{lang} {flag}: default {default!r}"
        assert meaning, f"{lang} {flag}: no explanation"


def test_flag_defaults_agree_with_the_train_config() -> None:
    """The parser's defaults are the TrainConfig's (the page shows the parser's)."""
    from dmuon.train.cli import TrainConfig

    config = vars(TrainConfig())
    parsed = vars(_parser().parse_args([]))
    assert parsed.pop("config") is None  # where flags come from (--config), not a setting
    for dest, value in parsed.items():
        assert config[dest] == value, dest


def _count_parameters(config: object) -> int:
    import torch

    from dmuon.train.models.preset import Transformer

    with torch.device("meta"):
        model = Transformer(config)  # type: ignore[arg-type]
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_preset_table_cells_match_the_models(lang: str, site: Path) -> None:
    from dmuon.train.models.preset import PRESETS

    rows = _table_with_header(site, lang, PRESET_HEADER[lang])[1:]
    assert [row[0] for row in rows] == list(PRESETS)
    for name, layers, width, heads, mlp, experts, params in rows:
        config = PRESETS[name]
        assert [int(layers), int(width), int(heads), int(mlp)] == [
            config.n_layers,
            config.dim,
            config.n_heads,
            config.ffn_dim,
        ], name
        if config.n_experts:
            count, top = experts.split(",")
            assert (int(count), int(top.split()[-1])) == (config.n_experts, config.top_k), name
        else:
            assert not any(c.isdigit() for c in experts), f"{name}: {experts!r}"
        assert params.endswith(" M"), params
        shown = float(params[:-2]) * 1e6
        decimals = len(params[:-2].partition(".")[2])
        actual = _count_parameters(config)
        assert abs(shown - actual) <= 0.5 * 10 ** (6 - decimals), f"{name}: {params} vs {actual}"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_the_rates_and_knobs_the_training_page_states_are_the_codes(lang: str) -> None:
    """The learning-rate and schedule sections quote the recipe's defaults and the demo's
    short-run rates; each number here comes from the contract or the demo's arguments."""
    import dmuon_recipe_contract as contract

    from dmuon.train.demo import DEMO_ARGS

    root = Path(__file__).resolve().parents[2] / "docs"
    text = " ".join((root / ("zh" if lang == "zh" else "") / "training.md").read_text().split())
    demo = dict(zip(DEMO_ARGS[::2], DEMO_ARGS[1::2], strict=False))

    def default(dest: str) -> str:
        return f"{contract.flag(dest).default:g}"

    lp, rp = ("（", "）") if lang == "zh" else ("(", ")")
    said = [
        f"`--lr {default('lr')}`",
        f"`--adamw-lr {contract.ADAMW_LR:g}`",
        f"`{demo['--lr']}`",
        f"`{demo['--adamw-lr']}`",
        f"{lp}{default('adamw_weight_decay')}{rp}",
        f"{default('momentum')}{rp}",
        f"{lp}{default('adamw_beta1')} ",
        f"{default('adamw_beta2')}{rp}",
    ]
    if lang == "en":
        said += [f"in {demo['--steps']}.", f"{default('weight_decay')} by default"]
    else:
        said += [f"默认 {default('weight_decay')}"]
    # Samples and trackers: their defaults, from the contract and the tracker modules.
    from dmuon.train.reporting.reporters import DEFAULT_TRACKING_DIR
    from dmuon.train.reporting.trackers import DEFAULT_EXPERIMENT

    quoted = [
        f"`{contract.flag('sample_prompt').default}`",
        f"`./{DEFAULT_TRACKING_DIR}`",
        f"`{DEFAULT_EXPERIMENT}`",
    ]
    if lang == "en":
        said += [f"default {q})" for q in quoted]
        said += [f"({contract.flag('sample_tokens').default} by default)"]
    else:
        said += [f"（默认 {q}）" for q in quoted]
        said += [f"（默认 {contract.flag('sample_tokens').default}）"]
    for phrase in said:
        assert phrase in text, f"{lang} training.md does not say {phrase!r}"
