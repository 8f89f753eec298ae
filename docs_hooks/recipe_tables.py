"""The training guide's flag and preset tables, rendered from the recipe's own code.

Every value a reader could copy (flag spellings, choices, defaults, preset sizes and
parameter counts) comes from ``dmuon.train.build_parser()`` and ``dmuon.train.PRESETS``.
Only the explanatory prose lives here, per language; a flag without prose of its own is
described by its ``--help`` text, so a new flag appears in both languages with no edit to
the docs.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

# Prose that reads better than the one-line ``--help`` text (links, fuller sentences).
MEANING: dict[str, dict[str, str]] = {
    "en": {
        "--model": "a model preset ([below](#presets)), or a Hugging Face model directory "
        "([Train your own model](train-your-own-model.md#models))",
        "--tokenizer": "a `tokenizer.json` or tokenizer directory "
        "([tokenizers](train-your-own-model.md#tokenizers))",
        "--data": "a file or a folder read recursively: text, `.jsonl`/`.json`, `.parquet`, "
        "or `.bin` token files ([data formats](train-your-own-model.md#data))",
        "--text-field": "the field (column) holding the text of `.jsonl`, `.json` and "
        "`.parquet` records",
        "--cache-dir": "where the tokenized corpus is cached",
        "--val-fraction": "share of files (of bytes, for a single file) held out for validation",
        "--steps": "optimizer steps",
        "--micro-batch-size": "sequences per micro-batch per process",
        "--accum-steps": "micro-batches accumulated per optimizer step",
        "--seq-len": "tokens per sequence (bytes, for the presets)",
        "--seed": "initialization and data-order seed",
        "--device": "`auto` = CUDA if available, else CPU",
        "--threads": "intra-op CPU threads per process",
        "--collective-timeout": "seconds a collective waits for every process before the run "
        "fails naming it (a dead or stalled process; [hangs](troubleshooting.md#hangs))",
        "--dtype": "master parameter dtype (`float64` for exactness checks)",
        "--param-dtype": "compute dtype; `bfloat16` = FSDP2 mixed precision with float32 "
        "masters and reduction ([precision](train-your-own-model.md#precision))",
        "--activation-checkpointing": "recompute each decoder layer in backward",
        "--compile": "`torch.compile` each decoder layer's forward",
        "--peak-tflops": "peak TFLOP/s of one device, for the `mfu` metric",
        "--optimizer": "`dmuon` = DMuon on the hidden matrices (2-D `Linear` weights, and the "
        "expert stacks of `moe`) plus AdamW on the rest; `adamw` = `torch.optim.AdamW` on "
        "everything",
        "--ns-dtype": "[Newton-Schulz dtype](newton-schulz.md#iteration) of `dmuon`: `auto` "
        "is bfloat16 on CUDA and on CPUs that multiply it natively, float32 elsewhere",
        "--muon-variant": "update rule of the dedicated matrices: `muon`, or `normuon` "
        "([NorMuon](newton-schulz.md#normuon): per-neuron second-moment normalization of "
        "the orthogonalized update)",
        "--mode": "[Z2 or Z3](z2-vs-z3.md), for DMuon's buffers and FSDP2's parameters alike "
        "(`reshard_after_forward` of both)",
        "--hsdp": "replicate degree R of an [HSDP](hsdp.md) mesh: R replicas of world size / R "
        "shards (usually R = the number of nodes); `1` = a 1-D mesh over every process",
        "--ns-split": "consecutive ranks G of a shard group (a node's GPUs) that share the "
        "Newton-Schulz iterations of the largest matrices, for shard groups with more ranks "
        "than matrices to balance ([`ns_split`](scaling.md#ns-split)); G divides the shard "
        "size; `1` = each matrix iterated whole",
        "--reduce-dtype": "dtype the dedicated matrices' gradients are summed in on their way "
        "to the owner; `bfloat16` halves the reduce's bytes "
        "([half-precision communication](communication.md#comm-dtype))",
        "--broadcast-dtype": "dtype the dedicated matrices are broadcast in; `auto` = the "
        "compute dtype (`--param-dtype`); `bfloat16` halves the broadcasts' bytes",
        "--lr": "peak Muon learning rate of the dedicated matrices (`dmuon` only)",
        "--adamw-lr": "peak AdamW learning rate: embedding, norms and `lm_head` with `dmuon`; "
        "every parameter with `adamw`",
        "--warmup-steps": "linear warm-up steps",
        "--min-lr-ratio": "final learning rate as a fraction of the peak",
        "--clip-grad": "clip the global gradient norm (`dmuon.clip_grad_norm_`) to this value; "
        "`0` disables it; the logged `grad_norm` is the norm before clipping",
        "--eval-every": "evaluate at step 0, every N steps and at the end; `0` turns "
        "evaluation off",
        "--eval-sequences": "fixed validation windows per evaluation",
        "--metrics-file": "append one JSON line per optimizer step (rank 0)",
        "--log-every": "print every N steps when there is no progress bar",
        "--progress": "a progress bar on a terminal, plain lines otherwise",
        "--checkpoint-dir": "write [checkpoints](#checkpoints) here as `step_NNNNNNNN` "
        "folders; with it a final checkpoint is always written at the end and on "
        "SIGTERM or SIGINT",
        "--checkpoint-every": "also write a checkpoint every N steps (needs "
        "`--checkpoint-dir`); `0` = only the final one",
        "--keep-checkpoints": "keep the newest K complete checkpoints; `0` keeps all",
        "--on-checkpoint-error": "a checkpoint that cannot be written (a full disk): `stop` = "
        "end the run with exit status 4, naming the folder and the space; `warn` = say so "
        "and train on ([faults](#faults))",
        "--resume": "`auto` = continue from the latest complete checkpoint in "
        "`--checkpoint-dir` if there is one; `never` = start fresh; a path = continue "
        "from that checkpoint",
        "--init-from": "start a new run from the weights of this checkpoint (optimizer, "
        "schedule and step start fresh); an error if `--resume` also finds a checkpoint",
        "--export-hf": "at the end, write a Hugging Face model directory here "
        "([export](train-your-own-model.md#export))",
    },
    "zh": {
        "--model": "模型预设（见[下文](#presets)），或 Hugging Face 模型目录"
        "（[训练你自己的模型](train-your-own-model.md#models)）",
        "--tokenizer": "`tokenizer.json` 或分词器目录"
        "（[分词器](train-your-own-model.md#tokenizers)）",
        "--data": "一个文件或递归读取的文件夹：文本、`.jsonl`/`.json`、`.parquet` 或 `.bin` "
        "token 文件（[数据格式](train-your-own-model.md#data)）",
        "--text-field": "`.jsonl`、`.json` 和 `.parquet` 记录中存放文本的字段（列）",
        "--cache-dir": "分词后语料的缓存位置",
        "--val-fraction": "留作验证集的文件比例（单个文件时为字节比例）",
        "--steps": "优化器步数",
        "--micro-batch-size": "每个进程每个微批次的序列数",
        "--accum-steps": "每个优化器步累积的微批次数",
        "--seq-len": "每条序列的 token 数（预设为字节数）",
        "--seed": "初始化和数据顺序的种子",
        "--device": "`auto` = 有 CUDA 就用，否则用 CPU",
        "--threads": "每个进程的算子内 CPU 线程数",
        "--collective-timeout": "集合通信等待所有进程的秒数，超时后运行失败并指明是哪次集合通信"
        "（某个进程崩溃或停滞；[挂起](troubleshooting.md#hangs)）",
        "--dtype": "主参数的数据类型（`float64` 用于精确性检查）",
        "--param-dtype": "计算数据类型；`bfloat16` = FSDP2 混合精度，主副本和归约保持 float32"
        "（[精度](train-your-own-model.md#precision)）",
        "--activation-checkpointing": "在反向中重新计算每个解码层",
        "--compile": "对每个解码层的前向调用 `torch.compile`",
        "--peak-tflops": "单个设备的峰值 TFLOP/s，用于 `mfu` 指标",
        "--optimizer": "`dmuon` = 隐藏层矩阵（二维 `Linear` 权重，以及 `moe` 的专家堆叠）用 "
        "DMuon，其余用 AdamW；`adamw` = 全部用 `torch.optim.AdamW`",
        "--ns-dtype": "`dmuon` 的 [Newton-Schulz 数据类型](newton-schulz.md#iteration)：`auto` "
        "在 CUDA 和原生支持 bfloat16 乘法的 CPU 上为 bfloat16，其他情况为 float32",
        "--muon-variant": "专用矩阵的更新规则：`muon`，或 `normuon`"
        "（[NorMuon](newton-schulz.md#normuon)：对正交化后的更新按神经元做二阶矩归一化）",
        "--mode": "[Z2 或 Z3](z2-vs-z3.md)，同时作用于 DMuon 的缓冲区和 FSDP2 的参数"
        "（两者的 `reshard_after_forward`）",
        "--hsdp": "[HSDP](hsdp.md) 网格的复制度 R：R 个副本，每个副本 world size / R 个分片"
        "（通常 R = 节点数）；`1` = 覆盖所有进程的一维网格",
        "--ns-split": "分片组中共同承担最大矩阵 Newton-Schulz 迭代的连续 rank 数 G"
        "（一个节点的 GPU），用于 rank 多于可均衡的矩阵的分片组"
        "（[`ns_split`](scaling.md#ns-split)）；G 须整除分片大小；`1` = 每个矩阵整体迭代",
        "--reduce-dtype": "专属矩阵的梯度在归约到所有者途中求和所用的数据类型；"
        "`bfloat16` 使归约的字节数减半"
        "（[半精度通信](communication.md#comm-dtype)）",
        "--broadcast-dtype": "广播专属矩阵所用的数据类型；"
        "`auto` = 计算数据类型（`--param-dtype`）；"
        "`bfloat16` 使广播的字节数减半",
        "--lr": "专属矩阵的 Muon 峰值学习率（仅 `dmuon`）",
        "--adamw-lr": "AdamW 的峰值学习率：`dmuon` 时用于嵌入、归一化层和 `lm_head`；"
        "`adamw` 时用于所有参数",
        "--warmup-steps": "线性预热步数",
        "--min-lr-ratio": "最终学习率占峰值的比例",
        "--clip-grad": "把全局梯度范数（`dmuon.clip_grad_norm_`）裁剪到这个值；`0` 表示不裁剪；"
        "记录的 `grad_norm` 是裁剪前的范数",
        "--eval-every": "在第 0 步、每 N 步以及结束时评估；`0` 关闭评估",
        "--eval-sequences": "每次评估使用的固定验证窗口数",
        "--metrics-file": "每个优化器步追加一行 JSON（由 rank 0 写入）",
        "--log-every": "没有进度条时每 N 步打印一次",
        "--progress": "在终端上显示进度条，否则输出普通文本行",
        "--checkpoint-dir": "把[检查点](#checkpoints)以 `step_NNNNNNNN` 文件夹的形式写在这里；"
        "指定后，训练结束时以及收到 SIGTERM 或 SIGINT 时总会写一个最终检查点",
        "--checkpoint-every": "另外每 N 步写一个检查点（需要 `--checkpoint-dir`）；"
        "`0` = 只写最终检查点",
        "--keep-checkpoints": "保留最新的 K 个完整检查点；`0` 表示全部保留",
        "--on-checkpoint-error": "检查点无法写入时（磁盘写满）：`stop` = 以退出码 4 结束运行，"
        "并指明文件夹和空间；`warn` = 给出提示并继续训练（[故障](#faults)）",
        "--resume": "`auto` = 若 `--checkpoint-dir` 中有完整检查点，就从最新的一个继续；"
        "`never` = 从头开始；路径 = 从该检查点继续",
        "--init-from": "用这个检查点的权重开始一次新的训练（优化器、学习率调度和步数都从头开始）；"
        "若 `--resume` 也找到了检查点则报错",
        "--export-hf": "训练结束时在这里写出 Hugging Face 模型目录"
        "（[导出](train-your-own-model.md#export)）",
    },
}

# What a default of ``None`` means for flags whose value is decided at run time; ``{NAME}``
# is the value of the constant NAME of ``dmuon.train.cli``.
RUNTIME_DEFAULT: dict[str, dict[str, str]] = {
    "en": {
        "--data": "the standard library source",
        "--cache-dir": "`$DMUON_CACHE_DIR` or `~/.cache/dmuon`",
        "--threads": "`OMP_NUM_THREADS` if set, else the available cores divided by the "
        "processes on this machine",
        "--metrics-file": "none",
        "--checkpoint-dir": "none (no checkpoints)",
        "--init-from": "none",
        "--tokenizer": "the model directory's; raw bytes for presets",
        "--peak-tflops": "known for A100, H100, H200 and B200 in bfloat16; else no `mfu`",
        "--export-hf": "none (no export)",
    },
    "zh": {
        "--data": "标准库源代码",
        "--cache-dir": "`$DMUON_CACHE_DIR` 或 `~/.cache/dmuon`",
        "--threads": "设置了 `OMP_NUM_THREADS` 时取其值，否则为可用核数除以本机进程数",
        "--metrics-file": "无",
        "--checkpoint-dir": "无（不写检查点）",
        "--init-from": "无",
        "--tokenizer": "模型目录自带的；预设为原始字节",
        "--peak-tflops": "A100、H100、H200 和 B200 在 bfloat16 下已知；否则没有 `mfu`",
        "--export-hf": "无（不导出）",
    },
}

LABELS: dict[str, dict[str, str]] = {
    "en": {
        "flag": "flag",
        "default": "default",
        "meaning": "meaning",
        "none": "none",
        "preset": "preset",
        "layers": "layers",
        "width": "width",
        "heads": "heads",
        "mlp": "MLP width",
        "experts": "experts",
        "dense": "none (dense MLP)",
        "top": "top",
        "params": "parameters",
    },
    "zh": {
        "flag": "参数",
        "default": "默认值",
        "meaning": "含义",
        "none": "无",
        "preset": "预设",
        "layers": "层数",
        "width": "宽度",
        "heads": "注意力头",
        "mlp": "MLP 宽度",
        "experts": "专家",
        "dense": "无（稠密 MLP）",
        "top": "top",
        "params": "参数量",
    },
}


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def recipe_parser() -> argparse.ArgumentParser:
    """The recipe's argument parser (``dmuon-train --help`` prints from it)."""
    return importlib.import_module("dmuon.train.cli").build_parser()


def documented_actions(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The parser's options in ``--help`` order, without ``--help`` and hidden ones."""
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if any(s.startswith("--") for s in action.option_strings):
            yield action


def long_flag(action: argparse.Action) -> str:
    """The ``--long`` spelling of an option."""
    return next(s for s in action.option_strings if s.startswith("--"))


def invocation(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """How ``--help`` spells the option with its argument, e.g. ``--model {base,small,tiny}``."""
    formatter = parser._get_formatter()
    if not action.option_strings or action.nargs == 0:
        return long_flag(action)
    default_metavar = formatter._get_default_metavar_for_optional(action)
    return f"{long_flag(action)} {formatter._format_args(action, default_metavar)}"


def default_text(value: Any) -> str:
    """A default as the command line would spell it (``None`` handled by the caller)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return repr(value)
    return str(value)


def render_flags(lang: str) -> str:
    """The ``dmuon-train`` flag table in ``lang`` (``en`` or ``zh``)."""
    labels = LABELS[lang]
    parser = recipe_parser()
    constants = vars(importlib.import_module("dmuon.train.cli"))
    rows = [
        f"| {labels['flag']} | {labels['default']} | {labels['meaning']} |",
        "|---|---|---|",
    ]
    for action in documented_actions(parser):
        flag = long_flag(action)
        if action.default is None:
            default = RUNTIME_DEFAULT[lang].get(flag, labels["none"]).format_map(constants)
        else:
            default = f"`{default_text(action.default)}`"
        meaning = MEANING[lang].get(flag) or str(action.help or "")
        rows.append(
            f"| `{_cell(invocation(parser, action))}` | {_cell(default)} | {_cell(meaning)} |"
        )
    return "\n".join(rows)


def count_millions(n: int) -> str:
    """A parameter count in millions as the docs show it (two decimals below 10 M)."""
    millions = n / 1e6
    return f"{millions:.2f} M" if millions < 10 else f"{millions:.1f} M"


def experts_text(n_experts: int, top_k: int, labels: Mapping[str, str]) -> str:
    """The experts cell: ``4, top 2`` for a mixture of experts, else the dense label."""
    return f"{n_experts}, {labels['top']} {top_k}" if n_experts > 0 else labels["dense"]


def render_presets(lang: str) -> str:
    """The model preset table in ``lang``: shapes and parameter counts from ``PRESETS``.

    For a mixture-of-experts preset the MLP width is that of one expert.
    """
    labels = LABELS[lang]
    presets: Mapping[str, Any] = importlib.import_module("dmuon.train.models.preset").PRESETS
    rows = [
        f"| {labels['preset']} | {labels['layers']} | {labels['width']} | {labels['heads']} | "
        f"{labels['mlp']} | {labels['experts']} | {labels['params']} |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for name, config in presets.items():
        experts = experts_text(config.n_experts, config.top_k, labels)
        rows.append(
            f"| `{name}` | {config.n_layers} | {config.dim} | {config.n_heads} | "
            f"{config.ffn_dim} | {experts} | {count_millions(config.num_params)} |"
        )
    return "\n".join(rows)
