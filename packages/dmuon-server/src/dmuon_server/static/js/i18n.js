// UI text in English and Chinese. `t(key, vars)` looks a key up in the current language.
const TEXT = {
  en: {
    skip: "Skip to content", loading: "Loading…", nav: "Main", "nav.jobs": "Jobs",
    "nav.submit": "Submit", "nav.compare": "Compare", ok: "OK", cancel: "Cancel", keep: "Keep",
    "theme.dark": "Dark", "theme.light": "Light",
    "token.button": "Token", "token.title": "Access token",
    "token.help": "This server needs a bearer token. It is kept in this tab only (session storage).",
    "token.label": "Token", "token.wrong": "The server refused this token: {detail}",
    "field.number": "#", "field.cause": "Cause", "field.resumed_from_step": "Resumed from step",
    "field.started_at": "Started", "field.finished_at": "Finished", "field.exit_code": "Exit code",
    "field.reason": "Reason", "field.slurm_job_id": "Slurm job",
    "limits.off": "Limits this server does not hold: {names}. A job that goes past them is not stopped.",
    "jobs.title": "Jobs", "jobs.filter": "State", "jobs.all": "All states",
    "jobs.compare": "Compare selected", "jobs.empty": "No jobs yet.", "jobs.newer": "Newer",
    "jobs.older": "Older", "jobs.select": "Select {name} for comparison",
    "col.name": "Name", "col.state": "State", "col.step": "Step", "col.loss": "Loss",
    "col.val": "Val loss", "col.tps": "Tokens/s", "col.elapsed": "Elapsed", "col.eta": "ETA",
    "col.reason": "Reason", "col.at": "At", "col.exit": "Exit code",
    "col.optimizer": "Optimizer", "col.tokens": "Tokens", "col.wall": "Wall time",
    "col.final_loss": "Final loss", "col.final_val": "Final val loss",
    "state.queued": "queued", "state.starting": "starting", "state.running": "running",
    "state.succeeded": "succeeded", "state.failed": "failed", "state.cancelled": "cancelled",
    "job.cancel": "Cancel job", "job.cancel_q": "Cancel this job?",
    "job.cancel_text": "Its processes get SIGTERM, then SIGKILL after the grace period. This cannot be undone.",
    "job.cancel_ok": "Cancel job", "job.cancelled": "Cancel requested.", "job.resume": "Resume",
    "job.resumed": "Resume requested.", "job.copy": "Submit a copy", "job.loss": "Loss",
    "job.log": "Log scale", "job.smooth": "Smoothing", "job.lr": "Learning rate",
    "job.grad": "Grad norm", "job.tps": "Tokens/s", "job.spec": "Spec", "job.history": "State history",
    "job.logs": "Last log lines", "job.failure": "Failure", "job.checkpoints": "Checkpoints",
    "job.export": "Hugging Face export", "job.export_help": "Load it with AutoModelForCausalLM.from_pretrained and AutoTokenizer.from_pretrained once downloaded.", "job.export_tar": "Download the folder (.tar)",
    "job.attempts": "Attempts", "job.events": "Recipe events", "job.warning": "Warning", "job.summary": "Recipe summary", "job.nproc": "Processes",
    "job.created": "Created", "job.started": "Started", "job.finished": "Finished",
    "job.train": "train loss", "job.train_raw": "train loss (raw)", "job.val": "val loss",
    "job.step": "step", "job.tokens": "tokens", "job.data": "Chart data (last {n} points)",
    "stream.open": "live", "stream.connecting": "connecting…", "stream.reconnecting": "reconnecting…",
    "stream.ended": "finished", "stream.failed": "stream failed: {detail}",
    "cmp.title": "Compare", "cmp.pick": "Pick at least two jobs.", "cmp.go": "Compare",
    "cmp.vs_step": "Loss against step", "cmp.vs_tokens": "Loss against tokens",
    "cmp.final": "Final values",
    "submit.title": "Submit a job", "submit.submit": "Submit", "submit.pair": "Submit DMuon vs AdamW",
    "submit.pair_help": "Submits this spec twice, once with each optimizer, and opens the comparison.",
    "submit.reset": "Server defaults", "submit.from": "Prefilled from job {name}.",
    "submit.plan": "Dry run", "submit.valid": "The server accepts this spec.",
    "submit.invalid": "Fix the fields marked below.", "submit.optional": "optional",
    "submit.default": "default {v}", "submit.range": "{lo} … {hi}",
    "submit.group.train": "Recipe settings (train)",
    "submit.group.init_from": "Start from another job's checkpoint (init_from)", "submit.job": "Job",
    "submit.group.script": "Your own training script (script)", "submit.kind": "Runs",
    "submit.kind.train": "the recipe (train)", "submit.kind.script": "your own script (script)",
    "submit.args": "one argument per line",
    "col.user": "User", "jobs.user": "User", "jobs.all_users": "All users", "job.user": "user", "job.runs_as": "runs as", "job.log_hidden": "{n} lines of torch's socket warnings hidden.", "job.log_show_all": "Show every line", "series.lr": "Muon (lr)", "series.adamw_lr": "AdamW (adamw_lr)",
    "job.gpus": "GPUs", "job.priority": "priority", "job.queue": "Queue position {n}: {reason}",
    "job.more": "Other series", "job.samples": "Samples (greedy, from the weights of each step)",
    "series.max_logit": "Largest attention logit (QK-clip)", "series.qk_clipped_heads": "Heads clipped (QK-clip)",
    "series.mfu": "Model FLOPs utilization",
    "plan.world": "World size", "plan.seqs": "Sequences per step", "plan.tokens_step": "Tokens per step",
    "plan.tokens": "Tokens in total", "plan.params": "Parameters", "plan.queue": "Jobs ahead",
    "plan.warnings": "Warnings", "plan.cmd": "torchrun command",
    "err.generic": "Request failed ({status}): {detail}", "err.offline": "The server cannot be reached.",
    "none": "—",
  },
  zh: {
    skip: "跳到正文", loading: "加载中…", nav: "主导航", "nav.jobs": "作业",
    "nav.submit": "提交", "nav.compare": "对比", ok: "确定", cancel: "取消", keep: "保留",
    "theme.dark": "深色", "theme.light": "浅色",
    "token.button": "令牌", "token.title": "访问令牌",
    "token.help": "此服务器需要 Bearer 令牌。令牌只保存在当前标签页（会话存储）中。",
    "token.label": "令牌", "token.wrong": "服务器拒绝了该令牌：{detail}",
    "field.number": "#", "field.cause": "原因类型", "field.resumed_from_step": "续训起点步",
    "field.started_at": "开始", "field.finished_at": "结束", "field.exit_code": "退出码",
    "field.reason": "原因", "field.slurm_job_id": "Slurm 作业",
    "limits.off": "本服务未执行的限制：{names}。作业超出这些限制时不会被终止。",
    "jobs.title": "作业", "jobs.filter": "状态", "jobs.all": "全部状态",
    "jobs.compare": "对比所选", "jobs.empty": "还没有作业。", "jobs.newer": "较新",
    "jobs.older": "较早", "jobs.select": "选择 {name} 进行对比",
    "col.name": "名称", "col.state": "状态", "col.step": "步数", "col.loss": "损失",
    "col.val": "验证损失", "col.tps": "词元/秒", "col.elapsed": "已用时间", "col.eta": "预计剩余",
    "col.reason": "原因", "col.at": "时间", "col.exit": "退出码",
    "col.optimizer": "优化器", "col.tokens": "词元数", "col.wall": "总用时",
    "col.final_loss": "最终损失", "col.final_val": "最终验证损失",
    "state.queued": "排队中", "state.starting": "启动中", "state.running": "运行中",
    "state.succeeded": "已成功", "state.failed": "已失败", "state.cancelled": "已取消",
    "job.cancel": "取消作业", "job.cancel_q": "确定取消这个作业？",
    "job.cancel_text": "其进程会先收到 SIGTERM，宽限期过后收到 SIGKILL。此操作无法撤销。",
    "job.cancel_ok": "取消作业", "job.cancelled": "已请求取消。", "job.resume": "恢复",
    "job.resumed": "已请求恢复。", "job.copy": "以此为模板提交", "job.loss": "损失",
    "job.log": "对数坐标", "job.smooth": "平滑", "job.lr": "学习率",
    "job.grad": "梯度范数", "job.tps": "词元/秒", "job.spec": "作业描述", "job.history": "状态历史",
    "job.logs": "最新日志", "job.failure": "失败信息", "job.checkpoints": "检查点",
    "job.export": "Hugging Face 导出", "job.export_help": "下载后可用 AutoModelForCausalLM.from_pretrained 和 AutoTokenizer.from_pretrained 加载。", "job.export_tar": "下载整个目录（.tar）",
    "job.attempts": "尝试次数", "job.events": "训练脚本事件", "job.warning": "警告", "job.summary": "训练总结", "job.nproc": "进程数",
    "job.created": "创建于", "job.started": "开始于", "job.finished": "结束于",
    "job.train": "训练损失", "job.train_raw": "训练损失（原始）", "job.val": "验证损失",
    "job.step": "步", "job.tokens": "词元", "job.data": "图表数据（最近 {n} 个点）",
    "stream.open": "实时", "stream.connecting": "连接中…", "stream.reconnecting": "重新连接中…",
    "stream.ended": "已结束", "stream.failed": "事件流出错：{detail}",
    "cmp.title": "对比", "cmp.pick": "请至少选择两个作业。", "cmp.go": "对比",
    "cmp.vs_step": "损失随步数变化", "cmp.vs_tokens": "损失随词元数变化",
    "cmp.final": "最终数值",
    "submit.title": "提交作业", "submit.submit": "提交", "submit.pair": "提交 DMuon 与 AdamW 对照",
    "submit.pair_help": "用两种优化器各提交一次此描述，然后打开对比页。",
    "submit.reset": "服务器默认值", "submit.from": "已按作业 {name} 预填。",
    "submit.plan": "预检（dry run）", "submit.valid": "服务器接受此描述。",
    "submit.invalid": "请修正下面标出的字段。", "submit.optional": "可选",
    "submit.default": "默认 {v}", "submit.range": "{lo} … {hi}",
    "submit.group.train": "训练设置（train）",
    "submit.group.init_from": "从另一个作业的检查点开始（init_from）", "submit.job": "作业",
    "submit.group.script": "你自己的训练脚本（script）", "submit.kind": "运行",
    "submit.kind.train": "训练脚本（train）", "submit.kind.script": "你自己的脚本（script）",
    "submit.args": "每行一个参数",
    "col.user": "用户", "jobs.user": "用户", "jobs.all_users": "全部用户", "job.user": "用户", "job.runs_as": "运行账户", "job.log_hidden": "已隐藏 {n} 行 torch 套接字警告。", "job.log_show_all": "显示全部行", "series.lr": "Muon（lr）", "series.adamw_lr": "AdamW（adamw_lr）",
    "job.gpus": "GPU", "job.priority": "优先级", "job.queue": "队列位置 {n}：{reason}",
    "job.more": "其他曲线", "job.samples": "生成样例（贪心解码，取自各步的权重）",
    "series.max_logit": "最大注意力 logit（QK-clip）", "series.qk_clipped_heads": "被裁剪的头数（QK-clip）",
    "series.mfu": "模型 FLOPs 利用率",
    "plan.world": "进程总数", "plan.seqs": "每步序列数", "plan.tokens_step": "每步词元数",
    "plan.tokens": "总词元数", "plan.params": "参数量", "plan.queue": "前面的作业",
    "plan.warnings": "警告", "plan.cmd": "torchrun 命令",
    "err.generic": "请求失败（{status}）：{detail}", "err.offline": "无法连接服务器。",
    "none": "—",
  },
};

const LANG_KEY = "dmuon.lang";

/** The current UI language: "en" or "zh". */
export function lang() {
  const saved = localStorage.getItem(LANG_KEY);
  if (saved === "en" || saved === "zh") return saved;
  return (navigator.language || "en").toLowerCase().startsWith("zh") ? "zh" : "en";
}

/** Switch the UI language (remembered in local storage). */
export function setLang(value) {
  localStorage.setItem(LANG_KEY, value);
}

/** The text of `key` in the current language, with `{name}` placeholders filled from `vars`. */
export function t(key, vars = {}) {
  const table = TEXT[lang()] || TEXT.en;
  const text = table[key] ?? TEXT.en[key] ?? key;
  return text.replace(/\{(\w+)\}/g, (_, name) => (name in vars ? String(vars[name]) : `{${name}}`));
}

/** Translate the static parts of the page: `data-i18n` (text) and `data-i18n-aria` (label). */
export function applyStaticText(root = document) {
  document.documentElement.lang = lang() === "zh" ? "zh-CN" : "en";
  for (const el of root.querySelectorAll("[data-i18n]")) el.textContent = t(el.dataset.i18n);
  for (const el of root.querySelectorAll("[data-i18n-aria]")) {
    el.setAttribute("aria-label", t(el.dataset.i18nAria));
  }
}
