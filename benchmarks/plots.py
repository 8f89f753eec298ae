"""Plots of the committed results, drawn from their JSON (matplotlib, the ``bench`` extra).

* ``step-ratios.png``: step time over FSDP2 + AdamW at the same FSDP2 mode, per contender
  and accumulation (``results/<name>.json``, default ``small-n2``);
* ``loss-curves.png``: validation loss over steps of every run of the learning-rate sweeps
  (``results/quality.json``);
* ``scaling.png``: step time and counted traffic per rank as the model and the ranks grow
  (``results/scaling.json``);
* ``moe_quality.png``: training and validation loss of the ``moe`` preset's best runs
  (``results/moe_quality.json``; ``benchmarks/moe_quality.py`` draws it too);
* ``comm_dtype.png``: training loss with float32 and with bfloat16 communication side by
  side, and each one's difference from float32 (``results/comm_dtype.json``;
  ``benchmarks/comm_dtype.py`` draws it too);
* ``qk_clip.png``: the largest attention logit and the training loss of a run made to
  blow up, without and with QK-clip (``results/qk_clip.json``; ``benchmarks/qk_clip.py``
  draws it too);
* ``quality_small.png``: validation loss of each optimizer's best-rate runs at every seed,
  with AdamW's final losses (``results/quality_small.json``, from
  ``benchmarks/quality_scale.py``).

Each figure is drawn once per language of the docs, with its titles, axes and legends in
that language: ``docs/assets/benchmarks/`` for the English pages and
``docs/zh/assets/benchmarks/`` for the Chinese ones (``X.png`` and ``X.zh.png`` in
``results/`` for the MoE and communication figures, where the docs build picks them up). Each PNG
carries its texts in its ``Description`` metadata, which the docs tests read. The Chinese
figures need a CJK font (Debian: ``apt-get install fonts-noto-cjk``). A missing result is
skipped.

    python benchmarks/plots.py                       # every figure
    python benchmarks/plots.py --only quality_small  # one of them
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
DOCS = Path(__file__).resolve().parents[1] / "docs"
OUT = {"en": DOCS / "assets" / "benchmarks", "zh": DOCS / "zh" / "assets" / "benchmarks"}
LANGS = tuple(OUT)
#: Fonts tried for Chinese text; matplotlib falls back glyph by glyph along the list.
CJK_FONTS = ("Noto Sans CJK SC", "Source Han Sans SC", "WenQuanYi Micro Hei")

TEXT: dict[str, dict[str, str]] = {
    "en": {
        "accumulation": "accumulation {accum}",
        "ratio_axis": "step time / FSDP2 + AdamW (same mode)",
        "ratio_title": "{model}, N={nproc}, {device} (medians, one run)",
        "step_axis": "optimizer step",
        "val_axis": "validation loss",
        "best": " (best)",
        "run": "{optimizer} lr {lr:g}",
        "curves_title": "{model}, same seed and tokens; dashed: AdamW's best final loss",
        "time_axis": "median step time (s)",
        "moved_axis": "elements moved per rank per step (M, over (N-1)/N)",
        "scaling_title": "scaling, accumulation 1 (configurations that ran)",
        "moe_run": "{contender} ({swept} {lr:g})",
        "moe_train_axis": "training loss (mean of 10 steps)",
        "moe_train_title": "Training loss",
        "moe_val_title": "Validation loss",
        "moe_title": "moe preset, {steps} steps, best of 3 learning rates each",
        "step": "step",
        "comm_train_title": "Training loss",
        "comm_train_axis": "training loss",
        "comm_diff_title": "Relative difference from float32 communication",
        "comm_diff_axis": "relative difference (zeros not drawn)",
        "comm_title": "{model}, 2 ranks, {steps} steps, same seed and batches",
        "scale_run": "{optimizer} lr {lr:g}, seed {seed}",
        "scale_target": "AdamW's final loss, seed {seed}",
        "scale_title": "{model}, {steps} steps, best of 3 learning rates each",
        "qk_logit_title": "Largest attention logit of the step",
        "qk_logit_axis": "largest logit (log scale)",
        "qk_loss_title": "Training loss",
        "qk_loss_axis": "training loss",
        "qk_tau": "tau = {tau:g}",
        "qk_no_clip": "no clip",
        "qk_clipped": "QK-clip, tau {tau:g}",
        "qk_title": "{model} preset, Muon rate {lr:g} (constant), {steps} steps, "
        "same seed and batches",
    },
    "zh": {
        "accumulation": "梯度累积 {accum}",
        "ratio_axis": "步时 / FSDP2 + AdamW（同一模式）",
        "ratio_title": "{model}，N={nproc}，{device}（中位数，一次运行）",
        "step_axis": "优化器步",
        "val_axis": "验证损失",
        "best": "（最佳）",
        "run": "{optimizer} 学习率 {lr:g}",
        "curves_title": "{model}，相同的随机种子和词元；虚线：AdamW 最佳的最终损失",
        "time_axis": "步时中位数（秒）",
        "moved_axis": "每个 rank 每步传输的元素数（百万，按 (N-1)/N 计）",
        "scaling_title": "扩展性，梯度累积 1（已运行的配置）",
        "moe_run": "{contender}（{swept} {lr:g}）",
        "moe_train_axis": "训练损失（10 步平均）",
        "moe_train_title": "训练损失",
        "moe_val_title": "验证损失",
        "moe_title": "moe 预设，{steps} 步，各取 3 个学习率中最好的",
        "step": "步",
        "comm_train_title": "训练损失",
        "comm_train_axis": "训练损失",
        "comm_diff_title": "与 float32 通信的相对差",
        "comm_diff_axis": "相对差（零值不画出）",
        "comm_title": "{model}，2 个 rank，{steps} 步，相同的随机种子和批次",
        "scale_run": "{optimizer} 学习率 {lr:g}，种子 {seed}",
        "scale_target": "AdamW 的最终损失，种子 {seed}",
        "scale_title": "{model}，{steps} 步，各取 3 个学习率中最好的",
        "qk_logit_title": "每步最大的注意力 logit",
        "qk_logit_axis": "最大 logit（对数坐标）",
        "qk_loss_title": "训练损失",
        "qk_loss_axis": "训练损失",
        "qk_tau": "tau = {tau:g}",
        "qk_no_clip": "不裁剪",
        "qk_clipped": "QK-clip，tau {tau:g}",
        "qk_title": "{model} 预设，Muon 学习率 {lr:g}（恒定），{steps} 步，相同的随机种子和批次",
    },
}


def _load(name: str) -> Any | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _pyplot(lang: str) -> Any:
    """matplotlib's pyplot, set up to draw ``lang`` text (a CJK font for Chinese)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import font_manager
    from matplotlib import pyplot as plt

    fonts = ["DejaVu Sans"]
    if lang == "zh":
        installed = {f.name for f in font_manager.fontManager.ttflist}
        cjk = [name for name in CJK_FONTS if name in installed]
        if not cjk:
            raise SystemExit(
                f"no CJK font for the Chinese figures (tried {', '.join(CJK_FONTS)}); "
                "install one, e.g. apt-get install fonts-noto-cjk"
            )
        fonts += cjk[:1]
    plt.rcParams["font.family"] = fonts  # a list: glyphs missing from one come from the next
    return plt


def _save(fig: Any, path: Path, dpi: int) -> None:
    """Write ``fig`` with every text it shows in the PNG's ``Description`` metadata."""
    texts = [
        text.get_text()
        for text in fig.findobj(lambda artist: hasattr(artist, "get_text"))
        if text.get_text().strip()
    ]
    description = " | ".join(dict.fromkeys(texts))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, metadata={"Description": description})


def step_ratios(result: dict[str, Any], path: Path, lang: str) -> None:
    """Grouped bars: each contender's step time over AdamW's (same mode), per accumulation."""
    t, plt = TEXT[lang], _pyplot(lang)
    accums = sorted({r["accum"] for r in result["rows"]})
    names = [c for c in result["contenders"] if any(r["contender"] == c for r in result["rows"])]
    width = 0.8 / max(1, len(names))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, name in enumerate(names):
        by_accum = {r["accum"]: r for r in result["rows"] if r["contender"] == name}
        missing = {"vs_adamw_same_mode": float("nan")}
        ratios = [by_accum.get(a, missing)["vs_adamw_same_mode"] for a in accums]
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(accums))]
        ax.bar(xs, ratios, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")  # the slowest peer is tens of times AdamW's step
    ax.set_xticks(range(len(accums)), [t["accumulation"].format(accum=a) for a in accums])
    ax.set_ylabel(t["ratio_axis"])
    ax.set_title(t["ratio_title"].format(**result))
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    _save(fig, path, 100)
    plt.close(fig)


def loss_curves(result: dict[str, Any], path: Path, lang: str) -> None:
    """Validation loss against step for every (optimizer, rate); the best runs drawn bold."""
    t, plt = TEXT[lang], _pyplot(lang)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"dmuon": "tab:blue", "adamw": "tab:orange"}
    for run in result["runs"]:
        best = result["best_lr"][run["optimizer"]] == run["lr"]
        steps, losses = zip(*run["curve"], strict=True)
        ax.plot(
            steps,
            losses,
            color=colors[run["optimizer"]],
            linewidth=2.2 if best else 0.9,
            alpha=1.0 if best else 0.5,
            label=t["run"].format(**run) + (t["best"] if best else ""),
        )
    target = result["best_final_val_loss"]["adamw"]
    ax.axhline(target, color="gray", linestyle="--", linewidth=0.8)
    ax.set_ylim(top=min(max(r["curve"][1][1] for r in result["runs"]), 10))
    ax.set_xlabel(t["step_axis"])
    ax.set_ylabel(t["val_axis"])
    ax.set_title(t["curves_title"].format(**result))
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path, 100)
    plt.close(fig)


def scaling(result: dict[str, Any], path: Path, lang: str) -> None:
    """Two panels: step time per preset and rank count; elements moved per rank."""
    t, plt = TEXT[lang], _pyplot(lang)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    labels = [f"{r['model']}\nN={r['nproc']}" for r in result["runs"]]
    contenders = sorted({row["contender"] for r in result["runs"] for row in r["rows"]})
    for name in contenders:
        times, moved = [], []
        for r in result["runs"]:
            row = next((x for x in r["rows"] if x["contender"] == name), None)
            times.append(row["median_step_s"] if row else float("nan"))
            moved.append(sum(row["elements_per_rank"].values()) / 1e6 if row else float("nan"))
        left.plot(labels, times, marker="o", label=name)
        right.plot(labels, moved, marker="o", label=name)
    left.set_ylabel(t["time_axis"])
    left.set_yscale("log")
    right.set_ylabel(t["moved_axis"])
    left.legend(fontsize=8)
    fig.suptitle(t["scaling_title"])
    fig.tight_layout()
    _save(fig, path, 100)
    plt.close(fig)


def moe_quality(result: dict[str, Any], path: Path, lang: str) -> None:
    """Training loss (moving average over 10 steps) and validation loss of the best runs."""
    t, plt = TEXT[lang], _pyplot(lang)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for contender, best in result["best"].items():
        run = result["runs"][contender][str(best["lr"])]
        losses = run["train_loss"]
        window = 10
        smooth = [
            statistics.fmean(losses[max(0, i - window + 1) : i + 1]) for i in range(len(losses))
        ]
        swept = best["swept"].replace("_", " ")
        label = t["moe_run"].format(contender=contender, swept=swept, lr=best["lr"])
        left.plot(range(1, len(losses) + 1), smooth, label=label)
        steps, values = zip(*run["val_loss"], strict=True)
        right.plot(steps, values, marker="o", markersize=3, label=label)
    left.set(xlabel=t["step"], ylabel=t["moe_train_axis"], title=t["moe_train_title"])
    right.set(xlabel=t["step"], ylabel=t["val_axis"], title=t["moe_val_title"])
    low = min(best["final_val_loss"] for best in result["best"].values())
    for axis in (left, right):
        axis.set_ylim(low - 0.2, low + 1.6)
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(t["moe_title"].format(steps=result["settings"]["steps"]))
    _save(fig, path, 110)
    plt.close(fig)


def comm_dtype(result: dict[str, Any], path: Path, lang: str) -> None:
    """Training loss of each communication dtype side by side, and its difference from
    the float32 run's, step by step."""
    t, plt = TEXT[lang], _pyplot(lang)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    base = result["runs"]["float32"]["train_loss"]
    for index, (name, run) in enumerate(result["runs"].items()):
        losses = run["train_loss"]
        steps = range(1, len(losses) + 1)
        color = f"C{index}"  # the same colour for a contender in both panels
        width = 2.4 if name == "float32" else 1.0
        left.plot(steps, losses, label=name, color=color, linewidth=width)
        if name != "float32":
            diffs = [abs(a - b) / abs(b) for a, b in zip(losses, base, strict=True)]
            right.plot(steps, diffs, label=name, color=color, marker="o", markersize=2)
    left.set(xlabel=t["step"], ylabel=t["comm_train_axis"])
    left.set_title(t["comm_train_title"])
    right.set(xlabel=t["step"], ylabel=t["comm_diff_axis"], yscale="log")
    right.set_title(t["comm_diff_title"])
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    s = result["settings"]
    fig.suptitle(t["comm_title"].format(model=s["model"], steps=s["steps"]))
    _save(fig, path, 110)
    plt.close(fig)


def quality_scale(result: dict[str, Any], path: Path, lang: str) -> None:
    """Validation loss of each optimizer's best-rate runs, one line style per seed, with
    AdamW's final loss of each seed (the target of the steps ratio) as a dotted line."""
    t, plt = TEXT[lang], _pyplot(lang)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"adamw": "tab:orange", "muon": "tab:blue", "normuon": "tab:green"}
    styles = ["-", "--", ":", "-."]
    seeds = result["seeds"]
    for run in result["runs"]:
        if run["lr"] != result["best_lr"][run["optimizer"]]:
            continue
        steps, losses = zip(*run["curve"], strict=True)
        ax.plot(
            steps,
            losses,
            color=colors[run["optimizer"]],
            linestyle=styles[seeds.index(run["seed"]) % len(styles)],
            linewidth=1.4,
            label=t["scale_run"].format(**run),
        )
        if run["optimizer"] == "adamw":
            ax.axhline(
                run["final_val_loss"],
                color="gray",
                linestyle=styles[seeds.index(run["seed"]) % len(styles)],
                linewidth=0.7,
                label=t["scale_target"].format(seed=run["seed"]),
            )
    floor = min(r["final_val_loss"] for r in result["runs"])
    ax.set_ylim(floor - 0.05, floor + 1.0)
    ax.set_xlabel(t["step_axis"])
    ax.set_ylabel(t["val_axis"])
    ax.set_title(t["scale_title"].format(**result))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    _save(fig, path, 100)
    plt.close(fig)


def qk_clip(result: dict[str, Any], path: Path, lang: str) -> None:
    """The blow-up run's largest logit per step, without and with QK-clip, and both
    training losses (``results/qk_clip.json``; ``benchmarks/qk_clip.py`` draws it too)."""
    t, plt = TEXT[lang], _pyplot(lang)
    data = result["blow_up"]
    s = data["settings"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for index, run in enumerate(data["runs"].values()):
        label = t["qk_no_clip"] if run["tau"] is None else t["qk_clipped"].format(tau=run["tau"])
        steps = range(1, len(run["loss"]) + 1)
        left.plot(steps, run["max_logit"], label=label, color=f"C{index}")
        right.plot(steps, run["loss"], label=label, color=f"C{index}")
    left.axhline(
        s["tau"],
        color="gray",
        linestyle="--",
        linewidth=0.8,
        label=t["qk_tau"].format(tau=s["tau"]),
    )
    left.set(xlabel=t["step"], ylabel=t["qk_logit_axis"], yscale="log")
    left.set_title(t["qk_logit_title"])
    right.set(xlabel=t["step"], ylabel=t["qk_loss_axis"])
    right.set_title(t["qk_loss_title"])
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(t["qk_title"].format(**s))
    _save(fig, path, 110)
    plt.close(fig)


def language_paths(png: Path) -> dict[str, Path]:
    """Where ``moe_quality`` writes each language: ``X.png`` and ``X.zh.png``."""
    return {lang: png if lang == "en" else png.with_suffix(f".{lang}.png") for lang in LANGS}


Draw = Callable[[dict[str, Any], Path, str], None]


def main() -> None:
    """Draw every plot whose results exist, in every language."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--distributed", default="small-n2", help="results/<name>.json")
    parser.add_argument("--only", default=None, help="draw only the figure of this result")
    args = parser.parse_args()
    figures: list[tuple[str, Draw, dict[str, Path]]] = [
        (args.distributed, step_ratios, {lang: OUT[lang] / "step-ratios.png" for lang in LANGS}),
        ("quality", loss_curves, {lang: OUT[lang] / "loss-curves.png" for lang in LANGS}),
        ("scaling", scaling, {lang: OUT[lang] / "scaling.png" for lang in LANGS}),
        ("moe_quality", moe_quality, language_paths(RESULTS / "moe_quality.png")),
        ("comm_dtype", comm_dtype, language_paths(RESULTS / "comm_dtype.png")),
        ("quality_small", quality_scale, language_paths(RESULTS / "quality_small.png")),
        ("qk_clip", qk_clip, language_paths(RESULTS / "qk_clip.png")),
    ]
    for name, draw, paths in figures:
        if args.only is not None and name != args.only:
            continue
        result = _load(name)
        if result is None:
            print(f"skipped {name}: no results/{name}.json")
            continue
        for lang, path in paths.items():
            draw(result, path, lang)
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
