"""The glossary: one list of terms that renders the glossary page and the hover definitions.

``<!-- generated: glossary -->`` on the glossary page becomes the list of terms. On every
other page, each occurrence of a term in running text (not in code, headings, links or
diagrams) is wrapped in ``<abbr title="definition">``, which the theme shows as a tooltip.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html import escape

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page


@dataclass(frozen=True)
class Term:
    """One glossary entry in both languages."""

    anchor: str
    en: str
    en_pattern: str
    en_definition: str
    zh: str
    zh_pattern: str
    zh_definition: str
    link: str


TERMS: tuple[Term, ...] = (
    Term(
        "dedicated-parameter",
        "dedicated parameter",
        r"dedicated (?:parameters?|matri(?:x|ces))",
        "A Muon-target matrix given to exactly one rank, its owner; the other ranks keep a "
        "0-element placeholder. Trained with Muon.",
        "专属参数",
        r"专属参数|专属矩阵",
        "交给唯一一个 rank（它的所有者）的 Muon 目标矩阵；其他 rank 只保留 0 元素的占位张量。"
        "用 Muon 训练。",
        "concepts.md#dedicated-ownership",
    ),
    Term(
        "symmetric-parameter",
        "symmetric parameter",
        r"symmetric parameters?",
        "Every parameter that is not dedicated (embeddings, norms, the output head, biases): "
        "sharded by FSDP2 over all ranks and trained with AdamW.",
        "对称参数",
        r"对称参数",
        "没有成为专属参数的其余参数（嵌入、归一化层、输出头、偏置）：由 FSDP2 在所有 rank "
        "上分片，用 AdamW 训练。",
        "concepts.md#dedicated-ownership",
    ),
    Term(
        "owner",
        "owner",
        r"owners?",
        "The rank that holds the full float32 master of a dedicated matrix, receives its "
        "reduced gradient and runs its Muon update.",
        "所有者",
        r"所有者",
        "持有专属矩阵完整 float32 主副本的 rank：梯度归约到它，Muon 更新也由它执行。",
        "concepts.md#owners",
    ),
    Term(
        "hook-boundary",
        "hook boundary",
        r"hook boundar(?:y|ies)",
        "The module around which dedicated matrices are broadcast before forward and reduced "
        "after backward; by default each element of a ModuleList named layers, blocks or h.",
        "钩子边界",
        r"钩子边界",
        "专属矩阵在其前向之前广播、反向之后归约的模块；默认是名为 layers、blocks 或 h 的 "
        "ModuleList 中的每个元素。",
        "concepts.md#hook-boundaries",
    ),
    Term(
        "packed-buffer",
        "packed buffer",
        r"packed buffers?",
        "One flat tensor per owner and hook boundary holding that owner's matrices back to "
        "back, sent in one collective.",
        "打包缓冲区",
        r"打包缓冲区",
        "每个所有者在每个钩子边界上的一个一维张量，把该所有者的矩阵首尾相接存放，"
        "用一次集合通信发送。",
        "concepts.md#packed-buffers",
    ),
    Term(
        "p-m",
        "P_M",
        r"P_M",
        "The number of elements of all dedicated matrices together.",
        "P_M",
        r"P_M",
        "所有专属矩阵的元素总数。",
        "communication.md#unit",
    ),
    Term(
        "unit",
        "unit",
        r"units?",
        "(N−1)/N · P_M elements per rank: what one ring broadcast, reduce, all-gather or "
        "reduce-scatter of the dedicated matrices moves over N ranks.",
        "单位",
        r"单位",
        "每个 rank (N−1)/N · P_M 个元素：在 N 个 rank 上对全部专属矩阵做一次环形广播、归约、"
        "all-gather 或 reduce-scatter 的通信量。",
        "communication.md#unit",
    ),
    Term(
        "z2-z3",
        "Z2 / Z3",
        r"Z[23]",
        "Z3 (reshard_after_forward=True, the default) frees packed buffers after forward and "
        "broadcasts again before backward: 3 units per step. Z2 keeps them allocated for the "
        "whole run and broadcasts once per step, after step() changed the values: 2.",
        "Z2 / Z3",
        r"Z[23]",
        "Z3（reshard_after_forward=True，默认）在前向后释放打包缓冲区、反向前再广播一次："
        "每步 3 个单位。Z2 在整个训练中一直保留它们，step() 改变数值后每步广播一次："
        "每步 2 个单位。",
        "z2-vs-z3.md",
    ),
    Term(
        "micro-batch",
        "micro-batch",
        r"micro-batch(?:es)?",
        "One of the k batches whose gradients are summed before an optimizer step; all but "
        "the last run under dmuon.no_sync.",
        "微批次",
        r"微批次",
        "在一个优化器步之前累积梯度的 k 个批次之一；除最后一个外都在 dmuon.no_sync 中运行。",
        "gradient-accumulation.md",
    ),
    Term(
        "master",
        "master",
        r"masters?",
        "The float32 copy of a dedicated matrix that its owner keeps and steps; forward and "
        "backward use it cast to the compute dtype.",
        "主副本",
        r"主副本",
        "所有者保存并更新的专属矩阵的 float32 副本；前向和反向使用它转换为计算 dtype 后的值。",
        "concepts.md#owners",
    ),
    Term(
        "recipe",
        "recipe",
        r"recipe",
        "python -m dmuon.train: the reference training script the package ships (models, "
        "data, schedule, evaluation, checkpoints, trackers).",
        "训练配方",
        r"训练配方",
        "python -m dmuon.train：包里附带的参考训练脚本"
        "（模型、数据、调度、评估、检查点、实验跟踪）。",
        "training.md",
    ),
    Term(
        "token",
        "token",
        r"tokens?",
        "One unit of text a model reads and predicts: a byte for the presets, a tokenizer's "
        "piece for Hugging Face models.",
        "token",
        r"token",
        "模型读入并预测的一个文本单位：预设模型是一个字节，Hugging Face 模型是分词器切出的一段。",
        "training.md",
    ),
)

PAGE_TITLES = {
    "en": {
        "concepts.md": "Core concepts",
        "communication.md": "Communication cost",
        "z2-vs-z3.md": "Z2 vs Z3",
        "gradient-accumulation.md": "Gradient accumulation",
        "training.md": "Training guide",
    },
    "zh": {
        "concepts.md": "核心概念",
        "communication.md": "通信开销",
        "z2-vs-z3.md": "Z2 与 Z3",
        "gradient-accumulation.md": "梯度累积",
        "training.md": "训练指南",
    },
}
MORE = {"en": "More", "zh": "详见"}

SKIP_TAGS = {"code", "pre", "a", "h1", "h2", "h3", "h4", "h5", "h6", "abbr", "svg", "script",
             "style", "title", "button", "label", "nav"}  # fmt: skip
TAG = re.compile(r"<(/?)([a-zA-Z][a-zA-Z0-9]*)\b[^>]*?(/?)>")


def render_glossary(lang: str) -> str:
    """The glossary page's list of terms in ``lang``, alphabetical in English."""
    out = []
    for term in sorted(TERMS, key=lambda t: t.en.lower()):
        name, definition = (term.en, term.en_definition) if lang == "en" else (
            term.zh, term.zh_definition
        )  # fmt: skip
        page = term.link.split("#", 1)[0]
        out += [
            f"## {name} {{#{term.anchor}}}",
            "",
            definition,
            "",
            f"{MORE[lang]}{': ' if lang == 'en' else '：'}[{PAGE_TITLES[lang][page]}]({term.link})",
            "",
        ]
    return "\n".join(out)


def _term_pattern(lang: str) -> re.Pattern[str]:
    """One regex matching any term as a whole word (ASCII neighbours only for Chinese)."""
    if lang == "en":
        body = "|".join(f"(?P<t{i}>{t.en_pattern})" for i, t in enumerate(TERMS))
        return re.compile(rf"(?<![\w-])(?:{body})(?![\w-])", re.IGNORECASE)
    body = "|".join(f"(?P<t{i}>{t.zh_pattern})" for i, t in enumerate(TERMS))
    return re.compile(rf"(?<![A-Za-z0-9_])(?:{body})(?![A-Za-z0-9_])")


def annotate(html: str, lang: str) -> str:
    """Wrap the first occurrence of each term in running text in an ``<abbr>`` tooltip."""
    pattern = _term_pattern(lang)
    seen: set[int] = set()

    def wrap_terms(text: str) -> str:
        def wrap(match: re.Match[str]) -> str:
            index = int(next(k for k, v in match.groupdict().items() if v is not None)[1:])
            if index in seen:
                return match.group(0)
            seen.add(index)
            term = TERMS[index]
            definition = term.en_definition if lang == "en" else term.zh_definition
            return f'<abbr title="{escape(definition)}">{match.group(0)}</abbr>'

        return pattern.sub(wrap, text)

    out: list[str] = []
    skipping: list[str] = []
    position = 0
    for match in TAG.finditer(html):
        text = html[position : match.start()]
        out.append(text if skipping else wrap_terms(text))
        closing, name, self_closing = match.group(1), match.group(2).lower(), match.group(3)
        if name in SKIP_TAGS and not self_closing:
            if not closing:
                skipping.append(name)
            elif name in skipping:
                del skipping[len(skipping) - 1 - skipping[::-1].index(name)]
        out.append(match.group(0))
        position = match.end()
    tail = html[position:]
    out.append(tail if skipping else wrap_terms(tail))
    return "".join(out)


def on_page_content(html: str, /, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Hover definitions on every page but the glossary itself."""
    if page.file.src_uri.endswith("glossary.md"):
        return html
    lang = str(getattr(page.file, "locale", None) or "en")
    return annotate(html, "zh" if lang == "zh" else "en")
