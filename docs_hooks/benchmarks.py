"""MkDocs hook: fill the benchmark pages from the committed results in benchmarks/results/.

A page asks for a table with a marker on a line of its own:

``<!-- benchmark: optimizer-step [NAME] -->``
    ``benchmarks/results/NAME.json`` (default ``optimizer_step``): the optimizer step alone,
    single process.
``<!-- benchmark: optimizer-step-spread [NAME] -->``
    The same file: every run's whole-model speedup of ``dmuon-default`` per preset, with
    its minimum, median and maximum (``--runs``), beside ``dmuon-bf16``'s in the same runs
    and the largest gap between the two in one run.
``<!-- benchmark: optimizer-profile [NAME] -->``
    The same file: a profiled step of torch and of ``dmuon-default`` per preset (the
    median of ``--profile-rounds``, or a single one in older files), split into matrix
    products, copies, other operators and the rest, with the products' rate, the rate of
    the same products alone (``--profile``), the ceilings they put on the speedup
    (`speedup_ceilings`) and, where recorded, the largest operators outside the products.
``<!-- benchmark: distributed NAME -->``
    ``benchmarks/results/NAME.json``: step time and counted traffic per contender.
``<!-- benchmark: checkpoint-io -->``
    ``benchmarks/results/checkpoint_io.json``: DCP save, load, size and export per contender.
``<!-- benchmark: moe-split -->``
    ``benchmarks/results/moe_split.json``: a fused ``gate_up_proj`` orthogonalized whole or
    split, validation loss per learning rate and the gate/up update ratio.
``<!-- benchmark: moe-quality -->``
    ``benchmarks/results/moe_quality.json``: the ``moe`` preset with Muon on the expert
    stacks, with the experts on AdamW and with AdamW only; the sweep and the best rates.
``<!-- benchmark: comm-dtype -->``
    ``benchmarks/results/comm_dtype.json``: the same run with float32 and with bfloat16
    communication, bytes per kind of collective and the loss differences.
``<!-- benchmark: qk-clip -->``
    ``benchmarks/results/qk_clip.json``: a run made to blow up without and with QK-clip
    (largest logit, the step it passes tau, the first clipped step, the largest logit
    after it, final validation loss) and the clip's step-time ratio.
``<!-- benchmark: quality-scale NAME -->``
    ``benchmarks/results/NAME.json`` (from ``benchmarks/quality_scale.py``): final
    validation loss per optimizer, rate and seed, and the steps Muon and NorMuon need to
    reach AdamW's best, per seed.
``<!-- benchmark: figure NAME -->``
    ``benchmarks/results/NAME.png`` (English) or ``NAME.zh.png`` (Chinese), which this hook
    copies into the site (under ``assets/benchmarks/`` of each language).
``<!-- benchmark: quality -->``
    ``benchmarks/results/quality.json``: final validation loss per optimizer and rate, and
    the steps DMuon needs to reach AdamW's best.
``<!-- benchmark: scaling -->``
    ``benchmarks/results/scaling.json``: step time and traffic per preset and rank count.
``<!-- benchmark: targets NAME -->``
    The step-time, traffic and quality targets, measured value and met or missed, from
    ``benchmarks/results/NAME.json`` and ``quality.json``.
``<!-- benchmark: profile NAME -->``
    ``benchmarks/results/NAME.json`` (from ``benchmarks/profile_step.py``): where the time
    of one optimizer step goes, per contender and accumulation (mean of the ranks).
``<!-- benchmark: profile-limit NAME -->``
    The same file: DMuon's extra time over AdamW next to each rank's Newton-Schulz time,
    its rate and the rate of a float32 batched product alone at the same shapes.
``<!-- benchmark: profile-step NAME -->``
    The same file: inside one ``optimizer.step()`` on rank 0 under torch.profiler, the
    allocations and the share of operator time in matrix products and in copies.
``<!-- benchmark: machine NAME -->``
    One line: the machine (with its vector unit and whether it multiplies bfloat16
    natively), torch version and load average a result was taken under.
``<!-- benchmark: layouts NAME -->``
    ``benchmarks/results/NAME.json`` (from ``benchmarks/layouts.py``): step time,
    optimizer-step time and counted traffic per contender under DDP or FSDP2 + TP.
``<!-- benchmark: step-range NAME -->``
    One list item: the fastest and slowest median step time per accumulation of a
    distributed result.

Numbers are never typed into the pages. A missing or unreadable file logs a warning, which
fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import get_plugin_logger
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

log = get_plugin_logger("dmuon-benchmarks")

MARKER = re.compile(
    r"^<!-- benchmark: (?P<kind>[a-z-]+)(?: (?P<name>[A-Za-z0-9_.-]+))? -->[ \t]*$", re.MULTILINE
)
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
#: Where the figures of benchmarks/results/ appear in the site, relative to each language.
FIGURES = "assets/benchmarks"

LABELS: dict[str, dict[str, Any]] = {
    "en": {
        "matrices": "Matrices",
        "spread_preset": "Preset",
        "spread_runs": "Runs",
        "spread_each": "`dmuon-default` speedup in each run",
        "spread_range": "Min / median / max",
        "spread_same": "`dmuon-bf16`, the same setting, in the same runs",
        "spread_gap": "Largest gap between the two in one run",
        "prof_contender": "Step",
        "prof_total": "Profiled step (ms)",
        "prof_products": "Matrix products (ms)",
        "prof_rate": "Products' rate (GFLOP/s)",
        "prof_copies": "Copies (ms)",
        "prof_other": "Other operators (ms)",
        "prof_rest": "Python and dispatch (ms)",
        "prof_kernel": "the same bfloat16 products alone (torch.optim.Muon's `mm`/`addmm` calls "
        "at one step's shapes, in a loop): {rate:.0f} GFLOP/s",
        "sentence_sep": ". ",
        "sentence_end": ".",
        "prof_outside": "Outside the products, the largest operators of `{contender}` "
        "(self time): {ops}",
        "prof_ceiling": "torch's step in the first run, unprofiled: {torch} ms. The step's "
        "products take {kernel} ms at the rate alone and took {ours} ms in DMuon's profiled "
        "step, so a step doing nothing but them is at most **{kernel_x:.2f}x** or "
        "**{ours_x:.2f}x** torch's",
        "torch": "torch.optim.Muon + AdamW (ms)",
        "all": "all",
        "contender": "Contender",
        "accum": "Accumulation",
        "step": "Step (s)",
        "vs": "vs AdamW (same FSDP2 mode)",
        "units": "Muon traffic, counted (units)",
        "formula": "Formula (units)",
        "vs_plain": "vs AdamW",
        "optim_vs": "Optimizer step vs AdamW's",
        "matrix_units": "Matrix traffic over dp, counted (units)",
        "tp_units": "Over tp, rank 0 (units)",
        "machine": "Machine",
        "cpu_family": "family",
        "cpu_model": "model",
        "threads": "threads",
        "timed": "timed steps per contender after a warm-up",
        "load": "load average",
        "bf16_native": "native bfloat16",
        "bf16_emulated": "no native bfloat16",
        "step_range": "{lo} to {hi} ms at accumulation {accum}",
        "range_sep": ", ",
        "not_run": "Not run",
        "save": "Save (s)",
        "load_s": "Load (s)",
        "on_disk": "On disk (MiB)",
        "model_part": "Model part (MiB)",
        "optim_part": "Optimizer part (MiB)",
        "copies": "State-dict copies per rank (MiB)",
        "save_rss": "Save, extra RSS (MiB)",
        "load_rss": "Load, extra RSS (MiB)",
        "export": "Export: command / in process (s)",
        "ratio": "DMuon / AdamW",
        "muon_lr": "Muon learning rate",
        "val_whole": "validation loss, whole",
        "val_split": "validation loss, split",
        "split_minus_whole": "split − whole",
        "train_both": "training loss (last 10 steps), whole / split",
        "gate_up": "RMS of the gate half over the up half of each expert's whole update, "
        "at the best learning rate ({lr}) over all steps, layers and experts: median "
        "{median:.2f}, 5th to 95th percentile {p5:.2f} to {p95:.2f}",
        "split_settings": "{steps} steps, micro-batch {batch} × {seq} tokens, one process, "
        "seed 0; best learning rate per column in bold",
        "swept": "learning rate swept",
        "sweep": "validation loss at each rate",
        "on_muon": "share on Muon",
        "best_lr": "best rate",
        "best_val": "validation loss",
        "vs_adamw": "vs AdamW",
        "train_last": "training loss (last 10 steps)",
        "quality_settings": "{steps} steps of {batch} × {seq} tokens, one process, seed 0, "
        "warm-up {warmup} steps then cosine to {min_ratio:g} of the peak, clipping at "
        "{clip:g}; validation on {evals} fixed windows of the held-out files",
        "muon_lr_swept": "Muon ({adamw} AdamW)",
        "adamw_lr_swept": "AdamW ({muon} Muon)",
        "adamw_only": "AdamW",
        "figure": "Training and validation loss of the {what} at the best learning rate of each",
        "figure_what": {
            "moe_quality": "moe preset",
            "comm_dtype": "same run with float32 and with bfloat16 communication",
        },
        "figure_alt": {
            "qk_clip": "The largest attention logit and the training loss of a run made to "
            "blow up, without and with QK-clip",
        },
        "qk_run": "Run",
        "qk_tau": "tau",
        "qk_passes": "logit passes tau at step",
        "qk_first": "first clipped step",
        "qk_after": "largest logit after it (× tau)",
        "qk_largest": "largest logit",
        "qk_val": "final validation loss",
        "qk_none": "no clip",
        "qk_never": "never",
        "qk_cost": "Step time with the clip over without, {model} preset at the recipe's "
        "defaults, one process, {threads} threads: **{ratio:.3f}** (median of {rounds} "
        "alternating rounds: {rounds_list})",
        "comm_contender": "Communication",
        "comm_reduce": "Reduce",
        "comm_broadcast": "Broadcast",
        "comm_bytes": "Bytes per step, reduce / broadcast (MiB)",
        "comm_vs": "vs float32",
        "comm_val": "Final validation loss",
        "comm_val_diff": "vs float32",
        "comm_train_diff": "Training loss: largest step difference / last 10 steps",
        "comm_settings": "`{model}` preset, {mode}, 2 gloo ranks, {steps} steps of micro-batches "
        "of {batch} × {seq} tokens, seed 0; bytes of DMuon's collectives in step 2 on rank 0, "
        "counted by `dmuon.comm_audit`",
        "then": "; ",
        "end": ".",
        "scale_optimizer": "Optimizer",
        "scale_sweep": "Final validation loss at each rate (mean of the seeds)",
        "scale_best": "Best rate",
        "scale_val": "Best, per seed",
        "scale_ratio": "Steps to AdamW's best, per seed",
        "scale_spread": "Mean (min to max)",
        "scale_baseline": "baseline",
        "scale_never": "not reached",
        "scale_settings": "`{model}` preset, {steps} steps of {tokens} tokens, one process per "
        "run, seeds {seeds}; validation every {every} steps on {evals} fixed windows of the "
        "held-out files; the best rate in bold",
        "optim": "Optimizer step (s)",
        "vs_naive": "vs naive (optimizer step)",
        "optimizer": "Optimizer",
        "lr": "Learning rate",
        "final_val": "Final validation loss",
        "best": "best",
        "default": "centre of the sweep",
        "reach": (
            "DMuon's best run reaches AdamW's best final validation loss ({target:.4f}) at "
            "step **{steps}** of {total}: **{ratio}** of the steps."
        ),
        "never": (
            "DMuon's best run does not reach AdamW's best final validation loss ({target:.4f})."
        ),
        "model": "Model",
        "ranks": "Ranks",
        "elements": "Elements per rank (M)",
        "skipped": "Not run (time budget)",
        "target": "Target",
        "measured": "Measured",
        "verdict": "Met",
        "yes": "yes",
        "no": "**no**",
        "t_accum1": "{c} step time ≤ 1.00x FSDP2 + AdamW (same mode), accumulation 1",
        "t_accum8": "{c} step time ≤ 0.95x FSDP2 + AdamW (same mode), accumulation 8",
        "t_naive": "{c} optimizer step ≤ 0.5x naive's, every accumulation (worst shown)",
        "t_peer": "{c} faster than {p} with less traffic, every accumulation (worst shown)",
        "t_quality": "DMuon reaches AdamW's best final validation loss in ≤ 0.7x the steps",
        "peer_not_run": "not measured: the peer did not run",
        "not_reached": "not reached",
        "peak": "Peak tensor memory per rank (MiB)",
        "held": "Dedicated buffers after forward, counted / formula (MiB)",
        "forward": "Forward (s)",
        "backward": "Backward (s)",
        "comm": "of which blocked on communication (s)",
        "ns": "Newton-Schulz (s)",
        "optim_rest": "Rest of the optimizer step (s)",
        "wait": "Waiting for the other rank (s)",
        "total": "Total (s)",
        "cpu": "Process CPU time (s)",
        "vs_wall_cpu": "vs AdamW (same FSDP2 mode): wall / CPU",
        "extra": "Extra over AdamW, same mode: wall / CPU (s)",
        "ns_rank": "Newton-Schulz CPU time, rank {rank} (s)",
        "ns_rate": "Newton-Schulz rate per rank (GFLOP/s of CPU time)",
        "bmm_rate": "float32 bmm alone at the same shapes (GFLOP/s of CPU time)",
        "ns_share": "Newton-Schulz / extra CPU time",
        "without_ns": "Extra CPU time without Newton-Schulz (s)",
        "ns_floor": "Newton-Schulz at the bmm rate (s)",
        "allocations": "Allocations in step()",
        "allocated": "Allocated in step() (MiB)",
        "matmul_share": "Operator time in matrix products",
        "copy_share": "Operator time in copies",
    },
    "zh": {
        "matrices": "矩阵",
        "spread_preset": "预设",
        "spread_runs": "运行次数",
        "spread_each": "每次运行中 `dmuon-default` 的加速比",
        "spread_range": "最小 / 中位数 / 最大",
        "spread_same": "同一设置 `dmuon-bf16` 在同一批运行中",
        "spread_gap": "同一次运行中两者的最大差距",
        "prof_contender": "优化器步",
        "prof_total": "被剖析的一步（毫秒）",
        "prof_products": "矩阵乘积（毫秒）",
        "prof_rate": "乘积速率（GFLOP/s）",
        "prof_copies": "复制（毫秒）",
        "prof_other": "其他算子（毫秒）",
        "prof_rest": "Python 与分派（毫秒）",
        "prof_kernel": "同样的 bfloat16 乘积单独运行（torch.optim.Muon 的 `mm`/`addmm` 调用，"
        "一步的形状，循环计时）：{rate:.0f} GFLOP/s",
        "sentence_sep": "。",
        "sentence_end": "。",
        "prof_outside": "乘积之外，`{contender}` 用时最多的算子（自身耗时）：{ops}",
        "prof_ceiling": "第一次运行中 torch 未被剖析的一步：{torch} 毫秒。"
        "这一步的乘积按单独运行的速率需要 {kernel} 毫秒，"
        "在 DMuon 被剖析的一步中用了 {ours} 毫秒；"
        "所以一个只做这些乘积的优化器步至多是 torch 的 "
        "**{kernel_x:.2f}x** 或 **{ours_x:.2f}x**",
        "torch": "torch.optim.Muon + AdamW（毫秒）",
        "all": "全部",
        "contender": "参与者",
        "accum": "梯度累积",
        "step": "步时（秒）",
        "vs": "相对 AdamW（同一 FSDP2 模式）",
        "units": "Muon 通信量，实测（单位）",
        "formula": "公式（单位）",
        "vs_plain": "相对 AdamW",
        "optim_vs": "优化器步相对 AdamW",
        "matrix_units": "矩阵在 dp 上的通信量，实测（单位）",
        "tp_units": "tp 上，rank 0（单位）",
        "machine": "机器",
        "cpu_family": "系列",
        "cpu_model": "型号",
        "threads": "线程",
        "timed": "每个参与者在预热后计时的步数",
        "load": "负载均值",
        "bf16_native": "原生支持 bfloat16",
        "bf16_emulated": "不原生支持 bfloat16",
        "step_range": "梯度累积 {accum} 时 {lo} 至 {hi} 毫秒",
        "range_sep": "，",
        "not_run": "未运行",
        "save": "保存（秒）",
        "load_s": "加载（秒）",
        "on_disk": "磁盘占用（MiB）",
        "model_part": "模型部分（MiB）",
        "optim_part": "优化器部分（MiB）",
        "copies": "每个 rank 的 state dict 副本（MiB）",
        "save_rss": "保存时额外 RSS（MiB）",
        "load_rss": "加载时额外 RSS（MiB）",
        "export": "导出：命令 / 进程内（秒）",
        "ratio": "DMuon / AdamW",
        "muon_lr": "Muon 学习率",
        "val_whole": "验证损失，整体",
        "val_split": "验证损失，切分",
        "split_minus_whole": "切分 − 整体",
        "train_both": "训练损失（最后 10 步），整体 / 切分",
        "gate_up": "在最佳学习率（{lr}）下，对所有步、层和专家，整体正交化时每个专家更新中 gate "
        "半部分与 up 半部分的 RMS 之比：中位数 {median:.2f}，第 5 到第 95 百分位为 {p5:.2f} 到 "
        "{p95:.2f}",
        "split_settings": "{steps} 步，微批次 {batch} × {seq} 个 token，单进程，种子 0；"
        "每列的最佳学习率以粗体标出",
        "swept": "扫描的学习率",
        "sweep": "各学习率下的验证损失",
        "on_muon": "Muon 训练的参数占比",
        "best_lr": "最佳学习率",
        "best_val": "验证损失",
        "vs_adamw": "相对 AdamW",
        "train_last": "训练损失（最后 10 步）",
        "quality_settings": "{steps} 步，每步 {batch} × {seq} 个 token，单进程，种子 0，"
        "预热 {warmup} 步后余弦衰减到峰值的 {min_ratio:g}，梯度裁剪到 {clip:g}；"
        "在留出文件的 {evals} 个固定窗口上验证",
        "muon_lr_swept": "Muon（AdamW 为 {adamw}）",
        "adamw_lr_swept": "AdamW（Muon 为 {muon}）",
        "adamw_only": "AdamW",
        "figure": "{what}在各自最佳学习率下的训练损失和验证损失",
        "figure_what": {
            "moe_quality": "moe 预设",
            "comm_dtype": "同一次训练分别用 float32 和 bfloat16 通信",
        },
        "figure_alt": {
            "qk_clip": "一次被设计成会发散的训练在不裁剪和使用 QK-clip 时的"
            "最大注意力 logit 与训练损失",
        },
        "qk_run": "运行",
        "qk_tau": "tau",
        "qk_passes": "logit 超过 tau 的步",
        "qk_first": "第一次裁剪的步",
        "qk_after": "此后最大的 logit（× tau）",
        "qk_largest": "最大 logit",
        "qk_val": "最终验证损失",
        "qk_none": "不裁剪",
        "qk_never": "从未",
        "qk_cost": "使用裁剪与不使用时的步时之比，{model} 预设，训练配方的默认设置，单进程，"
        "{threads} 个线程：**{ratio:.3f}**（{rounds} 轮交替运行的中位数：{rounds_list}）",
        "comm_contender": "通信",
        "comm_reduce": "归约",
        "comm_broadcast": "广播",
        "comm_bytes": "每步字节数，归约 / 广播（MiB）",
        "comm_vs": "相对 float32",
        "comm_val": "最终验证损失",
        "comm_val_diff": "相对 float32",
        "comm_train_diff": "训练损失：单步最大差 / 最后 10 步",
        "comm_settings": "`{model}` 预设，{mode}，2 个 gloo rank，{steps} 步，微批次 {batch} × "
        "{seq} 个 token，随机种子 0；字节数为 rank 0 第 2 步中 DMuon 集合通信的字节数，"
        "由 `dmuon.comm_audit` 统计",
        "then": "；",
        "end": "。",
        "scale_optimizer": "优化器",
        "scale_sweep": "各学习率的最终验证损失（各种子的平均）",
        "scale_best": "最佳学习率",
        "scale_val": "最佳，各种子",
        "scale_ratio": "达到 AdamW 最佳损失所需步数，各种子",
        "scale_spread": "平均（最小到最大）",
        "scale_baseline": "基线",
        "scale_never": "未达到",
        "scale_settings": "`{model}` 预设，{steps} 步，每步 {tokens} 个 token，每次运行一个进程，"
        "随机种子 {seeds}；每 {every} 步在留出文件的 {evals} 个固定窗口上验证；最佳学习率加粗",
        "optim": "优化器步（秒）",
        "vs_naive": "相对 naive（优化器步）",
        "optimizer": "优化器",
        "lr": "学习率",
        "final_val": "最终验证损失",
        "best": "最佳",
        "default": "扫描的中心值",
        "reach": (
            "DMuon 的最佳运行在第 **{steps}** 步（共 {total} 步）达到 AdamW 的最佳最终验证损失"
            "（{target:.4f}）：用了 **{ratio}** 的步数。"
        ),
        "never": "DMuon 的最佳运行没有达到 AdamW 的最佳最终验证损失（{target:.4f}）。",
        "model": "模型",
        "ranks": "Rank 数",
        "elements": "每个 rank 的元素数（M）",
        "skipped": "未运行（时间预算）",
        "target": "目标",
        "measured": "实测",
        "verdict": "达成",
        "yes": "是",
        "no": "**否**",
        "t_accum1": "{c} 步时 ≤ 1.00x FSDP2 + AdamW（同一模式），梯度累积 1",
        "t_accum8": "{c} 步时 ≤ 0.95x FSDP2 + AdamW（同一模式），梯度累积 8",
        "t_naive": "{c} 优化器步 ≤ 0.5x naive，每个梯度累积（取最差值）",
        "t_peer": "{c} 比 {p} 更快且通信更少，每个梯度累积（取最差值）",
        "t_quality": "DMuon 以 ≤ 0.7x 的步数达到 AdamW 的最佳最终验证损失",
        "peer_not_run": "未测量：该同类实现没有运行",
        "not_reached": "未达到",
        "peak": "每个 rank 的张量内存峰值（MiB）",
        "held": "前向后的专属缓冲区，实测 / 公式（MiB）",
        "forward": "前向（秒）",
        "backward": "反向（秒）",
        "comm": "其中阻塞于通信（秒）",
        "ns": "Newton-Schulz（秒）",
        "optim_rest": "优化器步的其余部分（秒）",
        "wait": "等待另一个 rank（秒）",
        "total": "合计（秒）",
        "cpu": "进程 CPU 时间（秒）",
        "vs_wall_cpu": "相对 AdamW（同一 FSDP2 模式）：墙钟 / CPU",
        "extra": "比同一模式的 AdamW 多出：墙钟 / CPU（秒）",
        "ns_rank": "Newton-Schulz CPU 时间，rank {rank}（秒）",
        "ns_rate": "每个 rank 的 Newton-Schulz 速率（每 CPU 秒 GFLOP）",
        "bmm_rate": "相同形状下单独的 float32 bmm（每 CPU 秒 GFLOP）",
        "ns_share": "Newton-Schulz / 多出的 CPU 时间",
        "without_ns": "除去 Newton-Schulz 后多出的 CPU 时间（秒）",
        "ns_floor": "按 bmm 速率计算的 Newton-Schulz（秒）",
        "allocations": "step() 中的分配次数",
        "allocated": "step() 中分配的内存（MiB）",
        "matmul_share": "矩阵乘法占算子时间的比例",
        "copy_share": "复制占算子时间的比例",
    },
}


def _load(name: str) -> Any:
    return json.loads((RESULTS / f"{name}.json").read_text(encoding="utf-8"))


def _ms(seconds: float) -> str:
    """Milliseconds with three significant digits: CPU steps take hundreds, GPU steps one."""
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.3g}"


def _optimizer_step(name: str, labels: dict[str, str]) -> str:
    """One table per preset of the file, each headed by its preset when there are several."""
    results = _load(name)
    tables = [_optimizer_step_table(result, labels) for result in results]
    if len(results) == 1:
        return tables[0]
    return "\n\n".join(
        f"*`{result['preset']}`*\n\n{table}" for result, table in zip(results, tables, strict=True)
    )


def _optimizer_step_table(result: dict[str, Any], labels: dict[str, str]) -> str:
    names = list(next(iter(result["rows"].values()))["speedup_vs_torch"])
    lines = [
        f"| {labels['matrices']} | {labels['torch']} | "
        + " | ".join(f"`{n}`" for n in names)
        + " |",
        "|" + "---|" * (2 + len(names)),
    ]
    for label, row in result["rows"].items():
        shown = labels["all"] if label == "all" else label
        cells = [_ms(row["median_s"]["torch"])] + [
            f"{_ms(row['median_s'][n])} ms, **{row['speedup_vs_torch'][n]:.2f}x**" for n in names
        ]
        lines.append(f"| {shown} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def same_setting_gap(run: dict[str, float]) -> float:
    """How far apart ``dmuon-default`` and ``dmuon-bf16`` came out in one run, relative to
    the smaller: on a CPU with native bfloat16 they are the same setting, so this is noise."""
    a, b = run["dmuon-default"], run["dmuon-bf16"]
    return abs(a - b) / min(a, b)


def _optimizer_step_spread(name: str, labels: dict[str, str]) -> str:
    """Per preset: every run's whole-model speedup of ``dmuon-default`` and their range,
    beside ``dmuon-bf16``'s in the same runs and the largest gap between the two."""
    lines = [
        f"| {labels['spread_preset']} | {labels['spread_runs']} | {labels['spread_each']} | "
        f"{labels['spread_range']} | {labels['spread_same']} | {labels['spread_gap']} |",
        "|---|--:|---|---|---|--:|",
    ]
    for result in _load(name):
        runs = result["speedups_per_run"]
        each = " · ".join(f"{r['dmuon-default']:.2f}x" for r in runs)
        same = " · ".join(f"{r['dmuon-bf16']:.2f}x" for r in runs)
        gap = max(same_setting_gap(r) for r in runs)
        s = result["speedup_spread"]["dmuon-default"]
        lines.append(
            f"| `{result['preset']}` | {result['runs']} | {each} | "
            f"{s['min']:.2f}x / {s['median']:.2f}x / {s['max']:.2f}x | {same} | {gap:.0%} |"
        )
    return "\n".join(lines)


def _optimizer_profile(name: str, labels: dict[str, str]) -> str:
    """Per preset: the profiled step of torch and of ``dmuon-default``, split by kind."""
    parts = []
    for result in _load(name):
        profile = result["profile"]
        lines = [
            f"| {labels['prof_contender']} | {labels['prof_total']} | "
            f"{labels['prof_products']} | {labels['prof_rate']} | {labels['prof_copies']} | "
            f"{labels['prof_other']} | {labels['prof_rest']} |",
            "|---|--:|--:|--:|--:|--:|--:|",
        ]
        for contender, step in profile["steps"].items():
            t = step["seconds"]
            share = t["products"] / step["total_s"] * 100
            lines.append(
                f"| `{contender}` | {_ms(step['total_s'])} | {_ms(t['products'])} "
                f"({share:.0f} %) | {step['product_gflops_per_s']:.0f} | {_ms(t['copies'])} | "
                f"{_ms(t['other_ops'])} | {_ms(t['rest'])} |"
            )
        kernel = labels["prof_kernel"].format(rate=profile["kernel_gflops_per_s"])
        c = speedup_ceilings(result)
        ceiling = labels["prof_ceiling"].format(
            torch=_ms(c["torch_s"]),
            kernel=_ms(c["products_at_kernel_rate_s"]),
            ours=_ms(c["dmuon_products_s"]),
            kernel_x=c["at_kernel_rate"],
            ours_x=c["as_dmuon_ran_them"],
        )
        outside = [
            labels["prof_outside"].format(contender=contender, ops=_largest_operators(step))
            for contender, step in profile["steps"].items()
            if "operators_outside_products" in step
        ]
        parts.append(
            f"*`{result['preset']}`*\n\n"
            + "\n".join(lines)
            + f"\n\n{kernel}{labels['sentence_sep']}{ceiling}{labels['sentence_end']}"
            + "".join(f"\n\n{line}{labels['sentence_end']}" for line in outside)
        )
    return "\n\n".join(parts)


PROFILE_OPERATORS_SHOWN = 6
"""How many of a profiled step's operators outside the products the pages list."""


def _largest_operators(step: dict[str, Any]) -> str:
    """``aten::op`` and self time of a profiled step's largest operators outside the products."""
    shown = list(step["operators_outside_products"].items())[:PROFILE_OPERATORS_SHOWN]
    return " · ".join(f"`{op}` {_ms(seconds)} ms" for op, seconds in shown)


def speedup_ceilings(result: dict[str, Any]) -> dict[str, float]:
    """How far ahead of torch's step a step made of nothing but its matrix products could be.

    torch's unprofiled whole-model median (first run) over the time the step's products take
    at the kernel's rate (their FLOPs over the rate of the same calls alone), and over the
    time they took in DMuon's profiled step. Any time spent outside the products lowers the
    speedup below these.
    """
    profile = result["profile"]
    ours = profile["steps"]["dmuon-default"]
    torch_s = result["rows"]["all"]["median_s"]["torch"]
    at_kernel_rate = ours["product_flops"] / (profile["kernel_gflops_per_s"] * 1e9)
    dmuon_products = ours["seconds"]["products"]
    return {
        "torch_s": torch_s,
        "products_at_kernel_rate_s": at_kernel_rate,
        "dmuon_products_s": dmuon_products,
        "at_kernel_rate": torch_s / at_kernel_rate,
        "as_dmuon_ran_them": torch_s / dmuon_products,
    }


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _distributed(name: str, labels: dict[str, str]) -> str:
    result = _load(name)
    lines = [
        f"| {labels['contender']} | {labels['accum']} | {labels['step']} | {labels['vs']} | "
        f"{labels['optim']} | {labels['vs_naive']} | {labels['units']} | {labels['formula']} | "
        f"{labels['peak']} | {labels['held']} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| `{r['contender']}` | {r['accum']} | {r['median_step_s']:.3g} | "
            f"{_cell(r['vs_adamw_same_mode'], '.2f', 'x')} | "
            f"{r['median_optim_step_s']:.3g} | {_cell(r['optim_vs_naive'], '.2f', 'x')} | "
            f"{_cell(r['muon_units'], '.2f')} | {_cell(r['formula_units'], '.2f')} | "
            f"{_cell(_in_mib(_peak(r)), '.1f')} | {_held(r)} |"
        )
    for peer, info in result.get("peers", {}).items():
        for accum, why in info["not_run"].items():
            version = info.get("installed") or info["pinned"]
            shown = why.replace("|", "\\|")
            lines.append(
                f"| `{peer}` ({info['distribution']} {version}) | {accum} | - | - | - | - | - | "
                f"{labels['not_run']}: `{shown}` | - | - |"
            )
    return "\n".join(lines)


def _layouts(name: str, labels: dict[str, str]) -> str:
    result = _load(name)
    lines = [
        f"| {labels['contender']} | {labels['step']} | {labels['vs_plain']} | {labels['optim']} | "
        f"{labels['optim_vs']} | {labels['matrix_units']} | {labels['tp_units']} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| `{r['contender']}` | {r['median_step_s']:.3g} | {r['vs_adamw']:.2f}x | "
            f"{r['median_optim_step_s']:.3g} | {r['optim_vs_adamw']:.2f}x | "
            f"{_cell(r['matrix_units'], '.2f')} | {_cell(r['tp_units'], '.2f')} |"
        )
    return "\n".join(lines)


def _in_mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def _peak(row: dict[str, Any]) -> int | None:
    """The peak bytes, or None where the run recorded an impossible (negative) value."""
    peak = row.get("peak_memory_bytes")
    return peak if peak is None or peak >= 0 else None


def _held(row: dict[str, Any]) -> str:
    counted, formula = row.get("dedicated_bytes_after_forward"), row.get("dedicated_bytes_formula")
    if counted is None and formula is None:
        return "-"
    return f"{_cell(_in_mib(counted), '.2f')} / {_cell(_in_mib(formula), '.2f')}"


_PROFILE_PHASES = ("forward", "backward", "comm", "ns", "optim_rest", "wait", "total", "cpu")


def _profile(name: str, labels: dict[str, str]) -> str:
    result = _load(name)
    lines = [
        f"| {labels['contender']} | {labels['accum']} | "
        + " | ".join(labels[p] for p in _PROFILE_PHASES)
        + f" | {labels['vs_wall_cpu']} |",
        "|---|---|" + "---|" * (len(_PROFILE_PHASES) + 1),
    ]
    for r in result["rows"]:
        cells = " | ".join(f"{r['mean'][p]:.3f}" for p in _PROFILE_PHASES)
        lines.append(
            f"| `{r['contender']}` | {r['accum']} | {cells} | "
            f"{_cell(r['vs_adamw_same_mode'], '.2f', 'x')} / "
            f"{_cell(r['cpu_vs_adamw_same_mode'], '.2f', 'x')} |"
        )
    return "\n".join(lines)


def _profile_limit(name: str, labels: dict[str, str]) -> str:
    result = _load(name)
    rows = [r for r in result["rows"] if r["contender"].startswith("dmuon")]
    ranks = range(len(rows[0]["per_rank"]))
    lines = [
        f"| {labels['contender']} | {labels['accum']} | {labels['extra']} | "
        + " | ".join(labels["ns_rank"].format(rank=k) for k in ranks)
        + f" | {labels['without_ns']} | {labels['ns_rate']} | {labels['bmm_rate']} | "
        f"{labels['ns_floor']} |",
        "|---|---|---|" + "---|" * (len(ranks) + 4),
    ]
    for r in rows:
        per_rank = r["per_rank"]
        extra, extra_cpu = r["extra_over_adamw_s"], r["extra_cpu_over_adamw_s"]
        without = None if extra_cpu is None else extra_cpu - r["mean"]["ns_cpu"]
        rates = " / ".join(
            f"{p['ns_flops'] / p['ns_cpu'] / 1e9:.1f}" if p["ns_cpu"] else "-" for p in per_rank
        )
        bmm = " / ".join(
            f"{p['bmm_flops_per_s'] / 1e9:.1f}" if p["bmm_flops_per_s"] else "-" for p in per_rank
        )
        floor = " / ".join(
            f"{p['ns_flops'] / p['bmm_flops_per_s']:.3f}" if p["bmm_flops_per_s"] else "-"
            for p in per_rank
        )
        lines.append(
            f"| `{r['contender']}` | {r['accum']} | "
            f"{_cell(extra, '.3f')} / {_cell(extra_cpu, '.3f')} | "
            + " | ".join(f"{p['ns_cpu']:.3f}" for p in per_rank)
            + f" | {_cell(without, '+.3f')} | {rates} | {bmm} | {floor} |"
        )
    return "\n".join(lines)


def _profile_step(name: str, labels: dict[str, str]) -> str:
    result = _load(name)
    lines = [
        f"| {labels['contender']} | {labels['accum']} | {labels['allocations']} | "
        f"{labels['allocated']} | {labels['matmul_share']} | {labels['copy_share']} |",
        "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        inside = r["optimizer_step_profile_rank0"]
        lines.append(
            f"| `{r['contender']}` | {r['accum']} | {inside['allocations']} | "
            f"{inside['allocated_bytes'] / 2**20:.2f} | {inside['matmul_share'] * 100:.0f} % | "
            f"{inside['copy_share'] * 100:.0f} % |"
        )
    return "\n".join(lines)


def _quality(labels: dict[str, str]) -> str:
    result = _load("quality")
    lines = [
        f"| {labels['optimizer']} | {labels['lr']} | {labels['final_val']} |",
        "|---|---|---|",
    ]
    for r in result["runs"]:
        notes = []
        if result["best_lr"][r["optimizer"]] == r["lr"]:
            notes.append(labels["best"])
        if result["defaults"][r["optimizer"]] == r["lr"]:
            notes.append(labels["default"])
        lr = f"{r['lr']:g}" + (f" ({', '.join(notes)})" if notes else "")
        val = f"{r['final_val_loss']:.4f}"
        if labels["best"] in notes:
            val = f"**{val}**"
        lines.append(f"| `{r['optimizer']}` | {lr} | {val} |")
    target = result["best_final_val_loss"]["adamw"]
    reached = result["dmuon_steps_to_adamw_best"]
    if reached is None:
        summary = labels["never"].format(target=target)
    else:
        summary = labels["reach"].format(
            target=target,
            steps=f"{reached:.0f}",
            total=result["steps"],
            ratio=f"{result['dmuon_steps_ratio']:.2f}x",
        )
    return "\n".join(lines) + "\n\n" + summary


def _scaling(labels: dict[str, str]) -> str:
    result = _load("scaling")
    contenders = sorted({row["contender"] for r in result["runs"] for row in r["rows"]})
    lines = [
        f"| {labels['model']} | {labels['ranks']} | "
        + " | ".join(f"`{c}` {labels['step']}" for c in contenders)
        + f" | {labels['elements']} |",
        "|" + "---|" * (3 + len(contenders)),
    ]
    for r in result["runs"]:
        rows = {row["contender"]: row for row in r["rows"]}
        cells = [_cell(rows[c]["median_step_s"], ".3f") if c in rows else "-" for c in contenders]
        moved = ", ".join(
            f"{c}: {sum(rows[c]['elements_per_rank'].values()) / 1e6:.2f}"
            for c in contenders
            if c in rows
        )
        lines.append(f"| `{r['model']}` | {r['nproc']} | " + " | ".join(cells) + f" | {moved} |")
    for skip in result["skipped"]:
        lines.append(
            f"| `{skip['model']}` | {skip['nproc']} | "
            + " | ".join("-" for _ in contenders)
            + f" | {labels['skipped']} |"
        )
    return "\n".join(lines)


def _targets(name: str, labels: dict[str, str]) -> str:
    result = _load(name)
    rows = {(r["contender"], r["accum"]): r for r in result["rows"]}
    accums = sorted({a for _, a in rows})
    head = f"| {labels['target']} | {labels['measured']} | {labels['verdict']} |"
    lines = [head, "|---|---|---|"]

    def add(text: str, value: float | None, limit: float, shown: str | None = None) -> None:
        met = value is not None and value <= limit
        cell = shown or ("-" if value is None else f"{value:.2f}x")
        lines.append(f"| {text} | {cell} | {labels['yes'] if met else labels['no']} |")

    for c in ("dmuon-z2", "dmuon-z3"):
        for accum, key, limit in ((1, "t_accum1", 1.0), (8, "t_accum8", 0.95)):
            row = rows.get((c, accum))
            add(labels[key].format(c=f"`{c}`"), row and row["vs_adamw_same_mode"], limit)
    for c in ("dmuon-z2", "dmuon-z3"):
        ratios = [rows[(c, a)]["optim_vs_naive"] for a in accums if (c, a) in rows]
        add(labels["t_naive"].format(c=f"`{c}`"), max(ratios) if ratios else None, 0.5)
    for peer in ("muon-fsdp2-z3", "dtensor-muon-z3"):
        if peer not in result.get("contenders", ()):
            continue  # a run of DMuon's own contenders only
        for c in ("dmuon-z2", "dmuon-z3"):
            text = labels["t_peer"].format(c=f"`{c}`", p=f"`{peer}`")
            pairs = [(rows[(c, a)], rows[(peer, a)]) for a in accums if (peer, a) in rows]
            if not pairs:
                lines.append(f"| {text} | {labels['peer_not_run']} | - |")
                continue
            time_ratio = max(d["median_step_s"] / p["median_step_s"] for d, p in pairs)
            traffic_ratio = max(d["muon_units"] / p["muon_units"] for d, p in pairs)
            met = time_ratio < 1.0 and traffic_ratio < 1.0
            lines.append(
                f"| {text} | {time_ratio:.2f}x, {traffic_ratio:.2f}x | "
                f"{labels['yes'] if met else labels['no']} |"
            )
    quality = _load("quality")
    ratio = quality["dmuon_steps_ratio"]
    add(labels["t_quality"], ratio, 0.7, None if ratio is not None else labels["not_reached"])
    return "\n".join(lines)


def _mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def _checkpoint_io(labels: dict[str, str]) -> str:
    result = _load("checkpoint_io")
    keys = (
        "save",
        "load_s",
        "on_disk",
        "model_part",
        "optim_part",
        "copies",
        "save_rss",
        "load_rss",
    )
    lines = [
        f"| {labels['contender']} | " + " | ".join(labels[k] for k in (*keys, "export")) + " |",
        "|" + "---|" * (2 + len(keys)),
    ]
    for name, r in result["rows"].items():
        b = r["bytes"]
        cells = [
            f"{r['median_save_s']:.2f}",
            f"{r['median_load_s']:.2f}",
            f"{_mib(b['on_disk'])}<br>({b['on_disk']:,} B)",
            _mib(b["model_tensors"]),
            _mib(b["optim_tensors"]),
            _mib(r["max_state_dict_copied_bytes"]),
            _mib(r["max_save_extra_rss"]),
            _mib(r["max_load_extra_rss"]),
            f"{r['median_export_s']:.1f} / {r['median_export_in_process_s']:.1f}",
        ]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    q = result["dmuon_over_adamw"]
    ratios = [
        q["save_time"],
        q["load_time"],
        q["bytes_on_disk"],
        None,
        q["optim_bytes"],
        None,
        None,
        None,
        None,
    ]
    cells = ["-" if v is None else f"**{v:.2f}x**" for v in ratios]
    cells[-1] = f"**{q['export_time']:.2f}x** / **{q['export_in_process_time']:.2f}x**"
    lines.append(f"| {labels['ratio']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _bold_if(text: str, bold: bool) -> str:
    return f"**{text}**" if bold else text


def _moe_split(labels: dict[str, Any]) -> str:
    result = _load("moe_split")
    settings = result["settings"]
    by = {(r["split"], r["lr"]): r for r in result["runs"]}
    best = {label: result["best"][label]["lr"] for label in ("whole", "split")}
    lines = [
        f"| {labels['muon_lr']} | {labels['val_whole']} | {labels['val_split']} | "
        f"{labels['split_minus_whole']} | {labels['train_both']} |",
        "|--:|--:|--:|--:|--:|",
    ]
    for lr in settings["lrs"]:
        whole, split = by[("whole", lr)], by[("split", lr)]
        whole_val = _bold_if(f"{whole['val']:.3f}", lr == best["whole"])
        split_val = _bold_if(f"{split['val']:.3f}", lr == best["split"])
        lines.append(
            f"| {lr:g} | {whole_val} | {split_val} | {split['val'] - whole['val']:+.3f} | "
            f"{whole['train']:.3f} / {split['train']:.3f} |"
        )
    ratio = by[("whole", best["whole"])]
    lines += [
        "",
        labels["gate_up"].format(
            lr=f"{best['whole']:g}",
            median=ratio["ratio_median"],
            p5=ratio["ratio_p5"],
            p95=ratio["ratio_p95"],
        )
        + labels["then"]
        + labels["split_settings"].format(
            steps=settings["steps"], batch=settings["batch"], seq=settings["seq_len"]
        )
        + labels["end"],
    ]
    return "\n".join(lines)


def _moe_quality(labels: dict[str, Any]) -> str:
    result = _load("moe_quality")
    defaults = result["defaults"]
    lines = [
        f"| {labels['contender']} | {labels['on_muon']} | {labels['swept']} | "
        f"{labels['sweep']} | {labels['best_lr']} | {labels['best_val']} | "
        f"{labels['vs_adamw']} | {labels['train_last']} |",
        "|---|--:|---|---|--:|--:|--:|--:|",
    ]
    for contender, best in result["best"].items():
        swept = result["sweeps"][contender]["swept"]
        if contender == "adamw":
            what = labels["adamw_only"]
        elif swept == "muon_lr":
            what = labels["muon_lr_swept"].format(adamw=f"{defaults['adamw_lr']:g}")
        else:
            what = labels["adamw_lr_swept"].format(muon=f"{defaults['muon_lr']:g}")
        sweep = " · ".join(
            f"{float(lr):g}: " + _bold_if(f"{val:.3f}", float(lr) == best["lr"])
            for lr, val in result["sweep"][contender].items()
        )
        lines.append(
            f"| `{contender}` | {best['muon_share'] * 100:.0f} % | {what} | {sweep} | "
            f"{best['lr']:g} | {best['final_val_loss']:.3f} | {best['val_minus_adamw']:+.3f} | "
            f"{best['train_loss_last10']:.3f} |"
        )
    s = result["settings"]
    lines += [
        "",
        labels["quality_settings"].format(
            steps=s["steps"],
            batch=s["batch"],
            seq=s["seq_len"],
            warmup=s["warmup_steps"],
            min_ratio=s["min_lr_ratio"],
            clip=s["clip_grad"],
            evals=s["eval_sequences"],
        )
        + labels["end"],
    ]
    return "\n".join(lines)


def _quality_scale(name: str, labels: dict[str, Any]) -> str:
    result = _load(name)
    lines = [
        f"| {labels['scale_optimizer']} | {labels['scale_sweep']} | {labels['scale_best']} | "
        f"{labels['scale_val']} | {labels['scale_ratio']} | {labels['scale_spread']} |",
        "|---|---|--:|--:|--:|--:|",
    ]
    for optimizer, sweep in result["mean_final_val_loss"].items():
        best = result["best_lr"][optimizer]
        cells = " · ".join(
            f"{float(lr):g}: " + _bold_if(f"{val:.4f}", float(lr) == best)
            for lr, val in sweep.items()
        )
        per_seed = " / ".join(
            f"{r['final_val_loss']:.4f}"
            for r in result["runs"]
            if r["optimizer"] == optimizer and r["lr"] == best
        )
        if optimizer == "adamw":
            ratios = spread = labels["scale_baseline"]
        else:
            values = result["steps_ratio_to_adamw_best"][optimizer].values()
            ratios = " / ".join(labels["scale_never"] if v is None else f"{v:.2f}x" for v in values)
            s = result["steps_ratio_spread"][optimizer]
            spread = (
                labels["scale_never"]
                if s is None
                else f"{s['mean']:.2f}x ({s['min']:.2f}x – {s['max']:.2f}x)"
            )
        lines.append(f"| `{optimizer}` | {cells} | {best:g} | {per_seed} | {ratios} | {spread} |")
    lines += [
        "",
        labels["scale_settings"].format(
            model=result["model"],
            steps=result["steps"],
            tokens=result["tokens_per_step"],
            seeds=", ".join(str(s) for s in result["seeds"]),
            every=result["eval_every"],
            evals=result["eval_sequences"],
        )
        + labels["end"],
    ]
    return "\n".join(lines)


def _comm_dtype(labels: dict[str, Any]) -> str:
    result = _load("comm_dtype")
    lines = [
        f"| {labels['comm_contender']} | {labels['comm_reduce']} | "
        f"{labels['comm_broadcast']} | {labels['comm_bytes']} | {labels['comm_vs']} | "
        f"{labels['comm_val']} | {labels['comm_val_diff']} | {labels['comm_train_diff']} |",
        "|---|---|---|--:|--:|--:|--:|--:|",
    ]
    for name, run in result["runs"].items():
        summary = result["summary"][name]
        nbytes, ratio = summary["bytes"], summary["bytes_vs_float32"]
        mib = f"{nbytes['reduce'] / 2**20:.1f} / {nbytes['broadcast'] / 2**20:.1f}"
        vs = f"{ratio['reduce']:.2f} / {ratio['broadcast']:.2f}"
        lines.append(
            f"| `{name}` | {run['reduce_dtype']} | {run['broadcast_dtype']} | {mib} | {vs} | "
            f"{summary['final_val_loss']:.4f} | "
            f"{summary['final_val_loss_rel_diff'] * 100:.2f} % | "
            f"{summary['max_train_loss_rel_diff'] * 100:.1f} % / "
            f"{summary['last10_train_loss_rel_diff'] * 100:.2f} % |"
        )
    s = result["settings"]
    lines += [
        "",
        labels["comm_settings"].format(
            model=s["model"],
            mode=s["mode"].upper(),
            steps=s["steps"],
            batch=s["micro_batch_size"],
            seq=s["seq_len"],
        )
        + labels["end"],
    ]
    return "\n".join(lines)


def _figure(name: str, labels: dict[str, Any]) -> str:
    if not (RESULTS / f"{name}.png").is_file():
        raise OSError(f"no {RESULTS / name}.png")
    alt = labels["figure_alt"].get(name)
    if alt is None:
        alt = labels["figure"].format(what=labels["figure_what"].get(name, name))
    return f"![{alt}]({FIGURES}/{name}.png)"


def _qk_clip(labels: dict[str, Any]) -> str:
    result = _load("qk_clip")
    blow_up, cost = result["blow_up"], result["cost"]
    summary = blow_up["summary"]
    lines = [
        f"| {labels['qk_run']} | {labels['qk_largest']} | {labels['qk_passes']} | "
        f"{labels['qk_first']} | {labels['qk_after']} | {labels['qk_val']} |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for run in blow_up["runs"].values():
        clipped = run["tau"] is not None
        label = f"QK-clip, {labels['qk_tau']} {run['tau']:g}" if clipped else labels["qk_none"]
        passes = summary["unclipped_passes_tau_at_step"]
        first = summary["first_clipped_step"]
        after = summary["largest_after_over_tau"]
        never = labels["qk_never"]
        lines.append(
            f"| {label} | {max(run['max_logit']):.1f} | "
            f"{'' if clipped else (passes if passes is not None else never)} | "
            f"{(first if first is not None else never) if clipped else ''} | "
            f"{f'{after:.3f}' if clipped and after is not None else ''} | "
            f"{run['final_val_loss']:.4f} |"
        )
    s = cost["settings"]
    rounds = ", ".join(f"{r:.3f}" for r in cost["ratio_per_round"])
    lines += [
        "",
        labels["qk_cost"].format(
            model=s["model"],
            threads=s["threads"],
            ratio=cost["ratio"],
            rounds=s["rounds"],
            rounds_list=rounds,
        )
        + labels["end"],
    ]
    return "\n".join(lines)


def _machine(name: str, labels: dict[str, str]) -> str:
    data = _load(name)
    if isinstance(data, list):  # optimizer_step.json holds one record per preset
        data = data[0]
    m = data.get("machine", {})
    load = data.get("load_average") or m.get("load_average") or []
    cpu = m.get("cpu", "")
    if "cpu_family" in m:
        family = f"{labels['cpu_family']} {m['cpu_family']}"
        cpu += f" ({family}, {labels['cpu_model']} {m.get('cpu_model', '?')})"
    parts = [m.get("gpu", ""), cpu, m.get("cpu_capability", "")]
    if "native_bf16" in m:
        native = labels["bf16_native"] if m["native_bf16"] else labels["bf16_emulated"]
        parts.append(f"{native} ({m['bf16_unit']})" if m.get("bf16_unit") else native)
    parts.append(f"{m.get('cores', '?')} cores" if m else "")
    parts += [f"torch {m['torch']}" if "torch" in m else ""]
    if "threads" in data:
        parts.append(f"{data['threads']} {labels['threads']}")
    if "rows" in data and isinstance(data["rows"], list) and "steps" in data:
        parts.append(f"{labels['timed']}: {data['steps']}")
    if load:
        parts.append(f"{labels['load']} {load[0]:.1f}")
    return f"*{labels['machine']}:* " + ", ".join(p for p in parts if p)


def _step_range(name: str, labels: dict[str, str]) -> str:
    """``- `preset`: fastest to slowest median step, per accumulation`` of one run."""
    data = _load(name)
    by_accum: dict[int, list[float]] = {}
    for row in data["rows"]:
        if row.get("median_step_s"):
            by_accum.setdefault(row["accum"], []).append(row["median_step_s"])
    spans = [
        labels["step_range"].format(lo=_ms(min(times)), hi=_ms(max(times)), accum=accum)
        for accum, times in sorted(by_accum.items())
    ]
    return f"- `{data['model']}`: " + labels["range_sep"].join(spans)


def figure_sources(name: str) -> dict[str, Path]:
    """The PNG of figure ``name`` per language: ``NAME.png`` (English), ``NAME.zh.png``."""
    return {"en": RESULTS / f"{name}.png", "zh": RESULTS / f"{name}.zh.png"}


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add every figure of benchmarks/results/ to the site, in its own language's version."""
    for png in sorted(RESULTS.glob("*.png")):
        if png.name.endswith(".zh.png"):
            continue
        for lang, source in figure_sources(png.name.removesuffix(".png")).items():
            if not source.is_file():
                log.warning("no %s: draw it with benchmarks/plots.py", source)
                continue
            uri = f"{'zh/' if lang == 'zh' else ''}{FIGURES}/{png.name}"
            if files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(source)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Replace every benchmark marker of the page with its table or line."""
    if "<!-- benchmark:" not in markdown:
        return markdown
    lang = "zh" if page.file.src_uri.startswith("zh/") else "en"
    labels: dict[str, Any] = LABELS[lang]

    def render(match: re.Match[str]) -> str:
        kind, name = match["kind"], match["name"]
        try:
            if kind == "optimizer-step-spread":
                return _optimizer_step_spread(name or "optimizer_step", labels)
            if kind == "optimizer-profile":
                return _optimizer_profile(name or "optimizer_step", labels)
            if kind == "optimizer-step":
                return _optimizer_step(name or "optimizer_step", labels)
            if kind == "distributed" and name:
                return _distributed(name, labels)
            if kind == "layouts" and name:
                return _layouts(name, labels)
            if kind == "checkpoint-io":
                return _checkpoint_io(labels)
            if kind == "moe-split":
                return _moe_split(labels)
            if kind == "moe-quality":
                return _moe_quality(labels)
            if kind == "comm-dtype":
                return _comm_dtype(labels)
            if kind == "qk-clip":
                return _qk_clip(labels)
            if kind == "quality-scale" and name:
                return _quality_scale(name, labels)
            if kind == "figure" and name:
                return _figure(name, labels)
            if kind == "quality":
                return _quality(labels)
            if kind == "scaling":
                return _scaling(labels)
            if kind == "targets" and name:
                return _targets(name, labels)
            if kind == "profile" and name:
                return _profile(name, labels)
            if kind == "profile-limit" and name:
                return _profile_limit(name, labels)
            if kind == "profile-step" and name:
                return _profile_step(name, labels)
            if kind == "machine" and name:
                return _machine(name, labels)
            if kind == "step-range" and name:
                return _step_range(name, labels)
        except (OSError, ValueError, KeyError, IndexError) as e:
            log.warning("%s: cannot render %r: %s", page.file.src_uri, match[0], e)
            return match[0]
        log.warning("%s: unknown benchmark marker %r", page.file.src_uri, match[0])
        return match[0]

    return MARKER.sub(render, markdown)
