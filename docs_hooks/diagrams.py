"""Diagrams of the docs, drawn as inline SVG when the site is built.

A page asks for a diagram with ``<!-- diagram: NAME -->`` on a line of its own. The SVG is
written into the page itself: nothing is loaded at view time, it follows the page's
language, and its colours come from the theme's CSS variables (``docs/stylesheets/
diagrams.css``), so it stays legible in the dark scheme.

``ownership``
    Owners and packed buffers of the ``tiny`` preset on three ranks, as
    ``dmuon.plan_owners`` assigns them (computed here, not drawn by hand).
``z2-z3-timeline``
    One optimizer step of a two-layer model: when each layer's packed buffer is broadcast,
    freed and reduced, in Z3 and in Z2.
``no-sync-flow``
    Gradient flow over three micro-batches under ``dmuon.no_sync``.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from html import escape

OWNER_CLASSES = ("dg-r0", "dg-r1", "dg-r2", "dg-r3")

TEXT: dict[str, dict[str, str]] = {
    "en": {
        "ownership_title": "Ownership of the tiny preset on 3 ranks (dmuon.plan_owners)",
        "boundary": "hook boundary",
        "matrices": "dedicated matrices (width ∝ elements)",
        "buffers": "one buffer per layer, owners' parts side by side; one all-gather in forward",
        "rank": "rank",
        "owner_of": "owner: rank",
        "storage": "Each rank keeps float32 masters and Muon state only for the matrices it "
        "owns; elsewhere the parameter is a 0-element placeholder.",
        "timeline_title": "One optimizer step, two layers: packed buffers of dedicated matrices",
        "fwd": "forward",
        "bwd": "backward",
        "step": "step()",
        "bcast": "broadcast",
        "rebcast": "broadcast again",
        "reduce": "reduce to owner",
        "free": "free",
        "resident": "buffer allocated",
        "update": "owners update",
        "stale": "mark out of date",
        "z3_total": "Z3: 2 broadcasts + 1 reduce = 3 units per step",
        "z2_total": "Z2: 1 broadcast + 1 reduce = 2 units per step",
        "nosync_title": "Gradient accumulation over k = 3 micro-batches with dmuon.no_sync",
        "mb": "micro-batch",
        "under_no_sync": "under no_sync",
        "paren": "({})",
        "synced": "synced",
        "all_ranks": "every rank",
        "owner": "owner",
        "local": "add its gradient to _accumulated_grad (no communication)",
        "merge": "merge with _accumulated_grad, then one reduce to the owner",
        "ns": "momentum + Newton-Schulz + update",
        "z2_bcast": "Z2 broadcasts",
        "z3_bcast": "Z3 broadcasts",
        "once": "once per step (buffers stay valid)",
        "twice": "2 per micro-batch",
    },
    "zh": {
        "ownership_title": "tiny 预设在 3 个 rank 上的所有权（dmuon.plan_owners）",
        "boundary": "钩子边界",
        "matrices": "专属矩阵（宽度与元素数成正比）",
        "buffers": "每层一个打包缓冲区，各所有者的部分依次排列：前向时一次 all-gather",
        "rank": "rank",
        "owner_of": "所有者：rank",
        "storage": "每个 rank 只为自己拥有的矩阵保存 float32 主副本和 Muon 状态；"
        "在其他 rank 上，该参数是 0 元素的占位张量。",
        "timeline_title": "一个优化器步、两层模型：专属矩阵的打包缓冲区",
        "fwd": "前向",
        "bwd": "反向",
        "step": "step()",
        "bcast": "广播",
        "rebcast": "再次广播",
        "reduce": "归约到所有者",
        "free": "释放",
        "resident": "缓冲区已分配",
        "update": "所有者更新",
        "stale": "标记为过期",
        "z3_total": "Z3：2 次广播 + 1 次归约 = 每步 3 个单位",
        "z2_total": "Z2：1 次广播 + 1 次归约 = 每步 2 个单位",
        "nosync_title": "用 dmuon.no_sync 在 k = 3 个微批次上累积梯度",
        "mb": "微批次",
        "under_no_sync": "在 no_sync 中",
        "paren": "（{}）",
        "synced": "同步",
        "all_ranks": "每个 rank",
        "owner": "所有者",
        "local": "把梯度加到 _accumulated_grad（不通信）",
        "merge": "与 _accumulated_grad 合并，再向所有者归约一次",
        "ns": "动量 + Newton-Schulz + 更新",
        "z2_bcast": "Z2 广播",
        "z3_bcast": "Z3 广播",
        "once": "每步一次（缓冲区保持有效）",
        "twice": "每个微批次 2 次",
    },
}


@dataclass
class Svg:
    """A small SVG canvas; coordinates in viewBox units."""

    width: int
    height: int
    label: str
    parts: list[str] = field(default_factory=list)

    def rect(
        self, x: float, y: float, w: float, h: float, cls: str, rx: float = 3, title: str = ""
    ) -> None:
        tip = f"<title>{escape(title)}</title>" if title else ""
        self.parts.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{rx}" '
            f'class="{cls}">{tip}</rect>'
        )

    def text(
        self, x: float, y: float, content: str, cls: str = "dg-text", anchor: str = "start"
    ) -> None:
        self.parts.append(
            f'<text x="{x:.1f}" y="{y:.1f}" class="{cls}" text-anchor="{anchor}">'
            f"{escape(content)}</text>"
        )

    def line(self, x1: float, y1: float, x2: float, y2: float, cls: str = "dg-line") -> None:
        self.parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" class="{cls}"/>'
        )

    def render(self, name: str) -> str:
        body = "".join(self.parts)
        return (
            f'<figure class="dmuon-diagram" data-diagram="{name}">'
            f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {self.width} {self.height}" '
            f'role="img" aria-label="{escape(self.label)}">'
            f"{body}</svg>"
            f"<figcaption>{escape(self.label)}</figcaption></figure>"
        )


# --------------------------------------------------------------------------- ownership


def tiny_plan(world_size: int = 3) -> tuple[dict[str, tuple[int, int]], dict[str, str], dict]:
    """Shapes, hook boundaries and owners of the ``tiny`` preset's dedicated matrices.

    Selection follows ``dedicate_params`` with the default predicate (``nn.Linear`` weights
    that ``dmuon.default_predicate`` accepts); owners come from ``dmuon.plan_owners``.
    """
    torch = importlib.import_module("torch")
    nn = importlib.import_module("torch.nn")
    model_mod = importlib.import_module("dmuon.train.models.preset")
    planner = importlib.import_module("dmuon._ownership.planner")
    with torch.device("meta"):
        model = model_mod.Transformer(model_mod.PRESETS["tiny"])
    shapes: dict[str, tuple[int, int]] = {}
    boundaries: dict[str, str] = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        fqn = f"{module_name}.weight"
        if planner.default_predicate(fqn, module.weight):
            shapes[fqn] = tuple(module.weight.shape)
            boundaries[fqn] = planner.find_hook_boundary(model, fqn) or ""
    plan = planner.plan_owners(shapes, world_size, boundaries)
    return shapes, boundaries, plan.owners


def render_ownership(lang: str) -> str:
    t = TEXT[lang]
    world = 3
    shapes, boundaries, owners = tiny_plan(world)
    order = list(dict.fromkeys(boundaries.values()))
    total_per_boundary = max(
        sum(s[0] * s[1] for f, s in shapes.items() if boundaries[f] == b) for b in order
    )
    storage = wrap_lines(t["storage"], 780, SMALL_CHAR_W)
    svg = Svg(800, 110 + 150 * len(order) + SMALL_LINE_H * len(storage), t["ownership_title"])
    for rank in range(world):
        x = 470 + rank * 105
        svg.rect(x, 34, 16, 16, f"dg-chip {OWNER_CLASSES[rank]}")
        svg.text(x + 22, 47, f"{t['rank']} {rank}")
    scale = 760 / total_per_boundary
    y = 70
    for boundary in order:
        svg.text(10, y + 14, f"{t['boundary']}: {boundary}", "dg-strong")
        svg.text(10, y + 32, t["matrices"], "dg-small")
        x = 10.0
        mine = [f for f in shapes if boundaries[f] == boundary]
        for fqn in mine:
            rows, cols = shapes[fqn]
            w = rows * cols * scale
            short = fqn.removeprefix(boundary + ".").removesuffix(".weight").split(".")[-1]
            svg.rect(
                x, y + 40, w - 2, 30, f"dg-chip {OWNER_CLASSES[owners[fqn]]}",
                title=f"{fqn} {rows}×{cols}, {t['owner_of']} {owners[fqn]}",
            )  # fmt: skip
            svg.text(x + (w - 2) / 2, y + 60, short.replace("_proj", ""), "dg-small", "middle")
            x += w
        svg.text(10, y + 92, t["buffers"], "dg-small")
        x = 10.0
        for rank in range(world):
            fqns = [f for f in mine if owners[f] == rank]
            elements = sum(shapes[f][0] * shapes[f][1] for f in fqns)
            if not elements:
                continue
            w = elements * scale
            svg.rect(x, y + 100, w - 6, 30, f"dg-chip {OWNER_CLASSES[rank]}")
            names = "+".join(f.split(".")[-2].replace("_proj", "") for f in fqns)
            svg.text(x + 6, y + 120, f"{t['rank']} {rank}: {names} ({elements:,})", "dg-small")
            x += w
        y += 150
    for i, line in enumerate(storage):
        svg.text(10, y + 6 + i * SMALL_LINE_H, line, "dg-small")
    return svg.render("ownership")


# --------------------------------------------------------------------------- Z2 / Z3


PHASES = ("fwd0", "fwd1", "bwd1", "bwd0", "step")


def _phase_label(t: Mapping[str, str], phase: str) -> str:
    if phase == "step":
        return t["step"]
    kind = t["fwd"] if phase.startswith("fwd") else t["bwd"]
    return f"{kind} layers.{phase[-1]}"


def render_timeline(lang: str) -> str:
    t = TEXT[lang]
    col0, col_w = 110, 138
    svg = Svg(800, 420, t["timeline_title"])
    for i, phase in enumerate(PHASES):
        x = col0 + i * col_w
        svg.rect(x, 34, col_w - 6, 24, "dg-phase")
        svg.text(x + (col_w - 6) / 2, 51, _phase_label(t, phase), "dg-small", "middle")
    # (mode, layer) -> [(phase index, event key, chip class)], and resident spans.
    events = {
        ("Z3", 0): [(0, "bcast", "dg-bcast"), (0, "free", "dg-free"), (3, "rebcast", "dg-bcast"),
                    (3, "reduce", "dg-reduce"), (3, "free", "dg-free")],
        ("Z3", 1): [(1, "bcast", "dg-bcast"), (1, "free", "dg-free"), (2, "rebcast", "dg-bcast"),
                    (2, "reduce", "dg-reduce"), (2, "free", "dg-free")],
        ("Z2", 0): [(0, "bcast", "dg-bcast"), (3, "reduce", "dg-reduce"), (4, "stale", "dg-free")],
        ("Z2", 1): [(1, "bcast", "dg-bcast"), (2, "reduce", "dg-reduce"), (4, "stale", "dg-free")],
    }  # fmt: skip
    resident = {
        ("Z3", 0): [(0, 0), (3, 3)],
        ("Z3", 1): [(1, 1), (2, 2)],
        ("Z2", 0): [(0, 4)],
        ("Z2", 1): [(1, 4)],
    }
    y = 70
    for mode in ("Z3", "Z2"):
        svg.text(10, y + 18, mode, "dg-title")
        for layer in (0, 1):
            svg.text(40, y + 40 + layer * 62, f"layers.{layer}", "dg-small")
            top = y + 24 + layer * 62
            for first, last in resident[(mode, layer)]:
                svg.rect(
                    col0 + first * col_w, top, (last - first + 1) * col_w - 6, 56, "dg-resident"
                )
            per_phase: dict[int, int] = {}
            for phase, key, cls in events[(mode, layer)]:
                slot = per_phase.get(phase, 0)
                per_phase[phase] = slot + 1
                svg.rect(col0 + phase * col_w + 4, top + 3 + slot * 18, col_w - 14, 16, cls)
                svg.text(col0 + phase * col_w + 9, top + 15 + slot * 18, t[key], "dg-tiny")
            svg.rect(col0 + 4 * col_w + 4, top + 38, col_w - 14, 16, "dg-update")
            svg.text(col0 + 4 * col_w + 9, top + 50, t["update"], "dg-tiny")
        y += 150
    svg.rect(10, y - 2, 14, 12, "dg-resident")
    svg.text(30, y + 8, t["resident"], "dg-small")
    svg.text(200, y + 8, t["z3_total"], "dg-small")
    svg.text(200, y + 26, t["z2_total"], "dg-small")
    return svg.render("z2-z3-timeline")


# --------------------------------------------------------------------------- no_sync


def render_no_sync(lang: str) -> str:
    t = TEXT[lang]
    col0, col_w = 120, 160
    text_w = col_w - 20
    # Column heads on two lines: "micro-batch 1" over "(under no_sync)".
    heads = [
        (f"{t['mb']} 1", t["paren"].format(t["under_no_sync"])),
        (f"{t['mb']} 2", t["paren"].format(t["under_no_sync"])),
        (f"{t['mb']} 3", t["paren"].format(t["synced"])),
        (t["step"], ""),
    ]
    local, merge, ns = (wrap_lines(t[key], text_w) for key in ("local", "merge", "ns"))
    rank_h = 16 + LINE_H * max(len(local), len(merge))
    owner_h = 16 + LINE_H * len(ns)
    rank_y = 82
    owner_y = rank_y + rank_h + 24
    bcast_y = owner_y + owner_h + 28
    svg = Svg(820, bcast_y + 80, t["nosync_title"])
    for i, (first, second) in enumerate(heads):
        x = col0 + i * col_w
        svg.rect(x, 30, col_w - 8, 38, "dg-phase")
        center = x + (col_w - 8) / 2
        if second:
            svg.text(center, 46, first, "dg-small", "middle")
            svg.text(center, 61, second, "dg-small", "middle")
        else:
            svg.text(center, 53, first, "dg-small", "middle")
    svg.text(10, rank_y + 20, t["all_ranks"], "dg-strong")
    for i in range(2):
        x = col0 + i * col_w
        svg.rect(x, rank_y, col_w - 8, rank_h, "dg-local")
        _write_lines(svg, x + 6, rank_y + 18, local)
    x = col0 + 2 * col_w
    svg.rect(x, rank_y, col_w - 8, rank_h, "dg-reduce")
    _write_lines(svg, x + 6, rank_y + 18, merge)
    for i in range(2):
        arrow_x = col0 + (i + 1) * col_w - 8
        svg.line(arrow_x, rank_y + 28, arrow_x + 8, rank_y + 28, "dg-arrow")
    svg.text(10, owner_y + 22, t["owner"], "dg-strong")
    x = col0 + 3 * col_w
    svg.line(col0 + 2 * col_w + 80, rank_y + rank_h, x + 40, owner_y, "dg-arrow")
    svg.rect(x, owner_y, col_w - 8, owner_h, "dg-update")
    _write_lines(svg, x + 6, owner_y + 18, ns)
    # Broadcasts per mode, per micro-batch.
    rows = (("z2_bcast", (1, 0, 0)), ("z3_bcast", (2, 2, 2)))
    for r, (key, counts) in enumerate(rows):
        y = bcast_y + r * 40
        svg.text(10, y + 16, t[key], "dg-strong")
        for i, count in enumerate(counts):
            for k in range(count):
                svg.rect(col0 + i * col_w + k * 66, y, 60, 22, "dg-bcast")
                svg.text(col0 + i * col_w + k * 66 + 30, y + 15, t["bcast"], "dg-tiny", "middle")
        note = t["once"] if key == "z2_bcast" else t["twice"]
        svg.text(col0 + 3 * col_w, y + 16, note, "dg-small")
    return svg.render("no-sync-flow")


#: Line height of wrapped ``dg-tiny`` text (10.5 px type), in viewBox units.
LINE_H = 14
#: Width of one Latin character of ``dg-tiny`` text, a generous average so lines never run
#: past their box (CJK characters count double).
CHAR_W = 6.2
#: The same for ``dg-small`` text (12 px type).
SMALL_CHAR_W = 7.0
SMALL_LINE_H = 16


#: Where a line may break: at spaces, and between the words of a run of CJK text.
_PIECES = re.compile(r"\s+|[\u2e80-\uffff]+|[^\s\u2e80-\uffff]+")
_CJK = re.compile(r"[\u2e80-\uffff]")
#: Punctuation that must not start a line (it stays with the word before it).
_NO_LINE_START = set("，。、；：！？）》」』”’")


def _cjk_words(run: str) -> list[str]:
    """``run`` of CJK text cut into words (jieba's dictionary), closing punctuation kept
    with the word before it and one-character words and opening punctuation with the word
    after it, so a line never ends in 不 before 通信 or cuts 一次."""
    import logging

    import jieba

    jieba.setLogLevel(logging.WARNING)
    words: list[str] = []
    carry = ""  # opening punctuation and one-character words go with the next word
    for word in jieba.cut(run, HMM=False):
        if words and not carry and word[0] in _NO_LINE_START:
            words[-1] += word
        elif len(word) == 1:
            carry += word
        else:
            words.append(carry + word)
            carry = ""
    if carry:
        words.append(carry)
    return words


#: Punctuation that must not end a line (it goes with the word after it).
_NO_LINE_END = set("（《「『“‘")


def _pieces(content: str) -> list[str]:
    """The unbreakable pieces of ``content``: spaces, CJK words, other runs; punctuation
    stays with its word across a change of script too."""
    pieces: list[str] = []
    for piece in _PIECES.findall(content):
        for word in _cjk_words(piece) if _CJK.match(piece) else [piece]:
            joins_previous = word[0] in _NO_LINE_START or (
                pieces and pieces[-1][-1] in _NO_LINE_END
            )
            if pieces and not word.isspace() and not pieces[-1].isspace() and joins_previous:
                pieces[-1] += word
            else:
                pieces.append(word)
    return pieces


def wrap_lines(content: str, width: float, char_w: float = CHAR_W) -> list[str]:
    """``content`` split into lines that fit ``width``, at spaces or between CJK words.

    Every word is kept: a box grows with its label instead of cutting it.
    """
    per_line = max(8, int(width / char_w))
    lines: list[str] = []
    current = ""
    for piece in _pieces(content):
        if piece.isspace():
            current += " " if current else ""
            continue
        if current and _display_len(current + piece) > per_line:
            lines.append(current.rstrip())
            current = piece
        else:
            current += piece
    lines.append(current.rstrip())
    return lines


def _write_lines(svg: Svg, x: float, y: float, lines: list[str]) -> None:
    for i, line in enumerate(lines):
        svg.text(x, y + i * LINE_H, line, "dg-tiny")


def _display_len(text: str) -> int:
    return sum(2 if ord(ch) > 0x2E80 else 1 for ch in text)


RENDERERS: dict[str, Callable[[str], str]] = {
    "ownership": render_ownership,
    "z2-z3-timeline": render_timeline,
    "no-sync-flow": render_no_sync,
}
