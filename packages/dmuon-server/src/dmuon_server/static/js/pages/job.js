// Job page: live loss curves from the event stream, lr / grad norm / tokens/s panels,
// state history, spec, last log lines, cancel (with confirmation), and the sections the
// server has (checkpoints, resume, attempts) when its API offers them.
import { api, hasRoute } from "../api.js";
import { lineChart, palette, smooth } from "../charts.js";
import { t } from "../i18n.js";
import { followEvents } from "../sse.js";
import { confirmDialog, navigate } from "../ui.js";
import {
  TERMINAL,
  columnTitle,
  errorText,
  fmt,
  fmtDuration,
  fmtInt,
  fmtRate,
  fmtTime,
  h,
  jobLabel,
  notify,
  num,
  stateBadge,
  withoutNoise,
} from "../util.js";

const LOG_LINES = 40;
/** Keys of a metric point drawn in the panels above; any other number is a series of its own. */
const KNOWN = new Set(["step", "loss", "val_loss", "lr", "adamw_lr", "grad_norm", "tokens_per_s", "time"]);
/** At most this many extra series get a chart. */
const MAX_EXTRA = 8;
const LOG_REFRESH_MS = 4000;
const DATA_ROWS = 50;

export function renderJob(main, jobId) {
  const path = `/v1/jobs/${encodeURIComponent(jobId)}`;
  let job = null;
  let stream = null;
  let logTimer = 0;
  let closed = false;
  const charts = [];
  // One entry per step, in step order: the arrays the charts draw.
  const series = { step: [], loss: [], val: [], lr: [], adamwLr: [], grad: [], tps: [] };

  const title = h("h1", {}, jobId.slice(0, 8));
  const badge = h("span", { id: "job-state" });
  const streamStatus = h("span", { class: "stream-status muted", id: "stream-status", role: "status" });
  const error = h("p", { class: "error", role: "alert", hidden: true });
  const cancel = h("button", { type: "button", class: "danger", id: "cancel-job", hidden: true }, t("job.cancel"));
  const resume = h("button", { type: "button", id: "resume-job", hidden: true }, t("job.resume"));
  const copy = h("button", { type: "button", id: "copy-job" }, t("job.copy"));
  const tiles = h("dl", { class: "tiles", id: "job-tiles" });
  const meta = h("p", { class: "muted", id: "job-meta" });
  const queue = h("p", { id: "job-queue", hidden: true });
  const extra = h("div", { class: "charts-3", id: "job-extra" });
  const extraTitle = h("h2", { hidden: true }, t("job.more"));
  // Extra numeric series (a script's own keys): name -> {values, chart}.
  const extras = new Map();
  const logScale = h("input", { type: "checkbox", id: "log-scale" });
  const smoothing = h("input", { type: "range", id: "smoothing", min: "0", max: "0.99", step: "0.01", value: "0" });
  const smoothingOut = h("output", { for: "smoothing", id: "smoothing-value" }, "0");
  const lossEl = h("div", { class: "chart", id: "chart-loss", "aria-describedby": "chart-loss-data" });
  const lrEl = h("div", { class: "chart", id: "chart-lr" });
  const gradEl = h("div", { class: "chart", id: "chart-grad" });
  const tpsEl = h("div", { class: "chart", id: "chart-tps" });
  const dataTable = h("tbody");
  const dataSummary = h("summary", {}, t("job.data", { n: DATA_ROWS }));
  const failure = h("section", { id: "job-failure", hidden: true });
  const history = h("tbody");
  const checkpoints = h("section", { id: "job-checkpoints", hidden: true });
  const artifacts = h("section", { id: "job-artifacts", hidden: true });
  const attempts = h("section", { id: "job-attempts", hidden: true });
  const events = h("section", { id: "job-events", hidden: true });
  const samples = h("section", { id: "job-samples", hidden: true });
  const recipe = h("section", { id: "job-recipe", hidden: true });
  const logs = h("pre", { id: "job-logs", tabindex: "0" });
  const showAllLogs = h("input", { type: "checkbox", id: "log-show-all" });
  const hiddenLogs = h("p", { class: "muted", id: "log-hidden", hidden: true },
    h("span", { id: "log-hidden-count" }), " ", h("label", {}, showAllLogs, " ", t("job.log_show_all")));
  const spec = h("pre", { id: "job-spec", tabindex: "0" });

  main.append(
    h("div", { class: "toolbar" }, title, badge, streamStatus),
    error,
    meta,
    queue,
    h("div", { class: "toolbar" }, cancel, resume, copy),
    tiles,
    failure,
    events,
    samples,
    h("h2", {}, t("job.loss")),
    h(
      "div",
      { class: "toolbar" },
      h("label", {}, logScale, " ", t("job.log")),
      h("label", { for: "smoothing" }, t("job.smooth")),
      smoothing,
      smoothingOut,
    ),
    lossEl,
    h(
      "details",
      { id: "chart-loss-data" },
      dataSummary,
      h("div", { class: "table-wrap" }, h("table", {},
        h("thead", {}, h("tr", {}, h("th", { class: "num" }, t("job.step")), h("th", { class: "num" }, t("job.train")),
          h("th", { class: "num" }, t("job.val")))),
        dataTable)),
    ),
    h(
      "div",
      { class: "charts-3" },
      h("section", {}, h("h3", {}, t("job.lr")), lrEl),
      h("section", {}, h("h3", {}, t("job.grad")), gradEl),
      h("section", {}, h("h3", {}, t("job.tps")), tpsEl),
    ),
    extraTitle,
    extra,
    checkpoints,
    artifacts,
    attempts,
    h("h2", {}, t("job.history")),
    h(
      "div",
      { class: "table-wrap" },
      h("table", { id: "job-history" },
        h("thead", {}, h("tr", {}, ["col.state", "col.reason", "col.at", "col.exit"].map((k) => h("th", { scope: "col" }, t(k))))),
        history),
    ),
    recipe,
    h("h2", {}, t("job.logs")),
    hiddenLogs,
    logs,
    h("h2", {}, t("job.spec")),
    spec,
  );

  const colors = palette();
  const lossChart = lineChart(lossEl, {
    xLabel: t("job.step"),
    series: [
      { label: t("job.train"), color: colors[0] },
      { label: t("job.val"), color: colors[1], points: true, spanGaps: true, width: 2 },
    ],
  });
  const small = (el, label, color) => lineChart(el, { xLabel: t("job.step"), height: 170, series: [{ label, color }] });
  // Both optimizers' rates on one chart: Muon's (lr) and AdamW's (adamw_lr, under dmuon).
  const lrChart = lineChart(lrEl, {
    xLabel: t("job.step"),
    height: 170,
    series: [
      { label: t("series.lr"), color: colors[2] },
      { label: t("series.adamw_lr"), color: colors[5 % colors.length], spanGaps: true },
    ],
  });
  const gradChart = small(gradEl, t("job.grad"), colors[3]);
  const tpsChart = small(tpsEl, t("job.tps"), colors[4]);
  charts.push(lossChart, lrChart, gradChart, tpsChart);

  function drawLoss() {
    const w = Number(smoothing.value);
    if (w > 0) {
      lossChart.setData([series.step, smooth(series.loss, w), series.val]);
    } else {
      lossChart.setData([series.step, series.loss, series.val]);
    }
  }

  function draw() {
    drawLoss();
    lrChart.setData([series.step, series.lr, series.adamwLr]);
    gradChart.setData([series.step, series.grad]);
    tpsChart.setData([series.step, series.tps]);
    for (const e of extras.values()) e.chart.setData([series.step, e.values]);
  }

  /** The series of a key no panel above draws: created on its first value. */
  function extraSeries(key) {
    if (extras.has(key)) return extras.get(key);
    if (extras.size >= MAX_EXTRA) return null;
    const el = h("div", { class: "chart", id: `chart-extra-${key}` });
    const known = t(`series.${key}`);
    const label = known === `series.${key}` ? key : known; // the recipe's keys have names
    extra.append(h("section", {}, h("h3", {}, label), el));
    extraTitle.hidden = false;
    const entry = { values: new Array(series.step.length - 1).fill(null), chart: small(el, label, colors[(extras.size + 5) % colors.length]) };
    charts.push(entry.chart);
    extras.set(key, entry);
    return entry;
  }

  let frame = 0;
  function scheduleDraw() {
    if (frame) return;
    frame = requestAnimationFrame(() => {
      frame = 0;
      draw();
      show();
    });
  }

  function addPoint(p) {
    const last = series.step.length ? series.step[series.step.length - 1] : -Infinity;
    if (typeof p.step !== "number" || p.step <= last) return; // already drawn
    series.step.push(p.step);
    series.loss.push(num(p.loss));
    series.val.push(num(p.val_loss));
    series.lr.push(num(p.lr));
    series.adamwLr.push(num(p.adamw_lr));
    series.grad.push(num(p.grad_norm));
    series.tps.push(num(p.tokens_per_s));
    for (const [key, value] of Object.entries(p)) {
      if (!KNOWN.has(key) && typeof value === "number") extraSeries(key);
    }
    for (const [key, e] of extras) e.values.push(num(p[key]));
    const row = h("tr", {}, h("td", { class: "num" }, p.step), h("td", { class: "num" }, fmt(p.loss)),
      h("td", { class: "num" }, fmt(p.val_loss)));
    dataTable.prepend(row);
    while (dataTable.children.length > DATA_ROWS) dataTable.lastChild.remove();
    if (job) {
      job.summary.last_step = p.step;
      if (p.loss !== undefined) job.summary.last_loss = p.loss;
      if (p.val_loss !== undefined) job.summary.last_val_loss = p.val_loss;
      if (p.tokens_per_s !== undefined) job.summary.tokens_per_s = p.tokens_per_s;
    }
  }

  logScale.addEventListener("change", () => {
    lossChart.rebuild({ log: logScale.checked });
    drawLoss();
  });
  smoothing.addEventListener("input", () => {
    smoothingOut.textContent = smoothing.value;
    drawLoss();
  });
  copy.addEventListener("click", () => navigate(`#/submit?from=${encodeURIComponent(jobId)}`));
  cancel.addEventListener("click", async () => {
    const ok = await confirmDialog(t("job.cancel_q"), t("job.cancel_text"), t("job.cancel_ok"));
    if (!ok) return;
    try {
      job = await api("POST", `${path}/cancel`);
      notify(t("job.cancelled"));
      show();
    } catch (err) {
      notify(errorText(err));
    }
  });
  resume.addEventListener("click", async () => {
    try {
      await api("POST", `${path}/resume`);
      notify(t("job.resumed"));
      await refresh();
      startStream();
    } catch (err) {
      notify(errorText(err));
    }
  });

  function tile(label, value, id) {
    return [h("div", { class: "tile", id }, h("dt", {}, label), h("dd", {}, value))];
  }

  function show() {
    if (!job) return;
    const s = job.summary;
    title.textContent = jobLabel(job);
    document.title = `${jobLabel(job)} · DMuon`;
    badge.replaceChildren(stateBadge(job.state));
    cancel.hidden = TERMINAL.has(job.state);
    cancel.disabled = Boolean(job.cancel_requested);
    meta.textContent = [
      `id ${job.id}`,
      job.user ? `${t("job.user")} ${job.user}` : "",
      job.runs_as ? `${t("job.runs_as")} ${job.runs_as}` : "",
      `${t("job.nproc")} ${job.nproc_per_node}`,
      job.gpus && job.gpus.length ? `${t("job.gpus")} ${job.gpus.join(",")}` : "",
      job.priority ? `${t("job.priority")} ${job.priority}` : "",
      `${t("job.created")} ${fmtTime(job.created_at)}`,
      job.started_at ? `${t("job.started")} ${fmtTime(job.started_at)}` : "",
      job.finished_at ? `${t("job.finished")} ${fmtTime(job.finished_at)}` : "",
    ].filter(Boolean).join(" · ");
    queue.hidden = !(job.state === "queued" && job.queue_reason);
    queue.textContent = queue.hidden ? "" : t("job.queue", { n: job.queue_position ?? "—", reason: job.queue_reason });
    tiles.replaceChildren(
      ...tile(t("col.step"), s.steps ? `${s.last_step ?? 0} / ${s.steps}` : `${s.last_step ?? 0}`, "tile-step"),
      ...tile(t("col.loss"), fmt(s.last_loss), "tile-loss"),
      ...tile(t("col.val"), fmt(s.last_val_loss), "tile-val"),
      ...tile(t("col.tps"), fmtRate(s.tokens_per_s), "tile-tps"),
      ...tile(t("col.elapsed"), fmtDuration(s.elapsed_s), "tile-elapsed"),
      // A finished job has nothing left to wait for: no estimate, not "0.0s".
      ...tile(t("col.eta"), TERMINAL.has(job.state) ? t("none") : fmtDuration(s.eta_s), "tile-eta"),
    );
    history.replaceChildren(
      ...job.history.map((tr, i) =>
        h("tr", {}, h("td", {}, stateBadge(tr.state)), h("td", { class: "wrap" }, tr.reason),
          h("td", {}, fmtTime(tr.at)),
          h("td", { class: "num" }, i === job.history.length - 1 && TERMINAL.has(tr.state) ? fmt(job.exit_code) : "")),
      ),
    );
    if (job.failure) {
      const f = job.failure;
      failure.hidden = false;
      failure.replaceChildren(
        h("h2", {}, t("job.failure")),
        h("p", { class: "error" }, [f.message, f.rank !== null ? `rank ${f.rank}` : "", f.signal || "",
          f.exit_code !== null ? `exit ${f.exit_code}` : ""].filter(Boolean).join(" · ")),
        f.log_tail && f.log_tail.length ? h("pre", { tabindex: "0" }, f.log_tail.join("\n")) : "",
      );
    } else {
      failure.hidden = true;
    }
    const written = Array.isArray(job.events) ? job.events.filter((e) => e.kind === "sample") : [];
    samples.hidden = !written.length;
    if (written.length) {
      // The newest first: what the model writes now, then how it got there.
      samples.replaceChildren(h("h2", {}, t("job.samples")), ...written.slice().reverse().map((e) =>
        h("figure", { class: "sample", "data-step": e.step },
          h("figcaption", { class: "muted" }, `${t("job.step")} ${e.step} · #${e.attempt}`),
          h("pre", { tabindex: "0" }, e.message))));
    }
    const others = Array.isArray(job.events) ? job.events.filter((e) => e.kind !== "sample") : [];
    if (others.length) {
      events.hidden = false;
      events.replaceChildren(
        h("h2", {}, t("job.events")),
        h("ul", { class: "events" }, ...others.map((e) =>
          h("li", { class: e.level === "warning" ? "warning" : "", "data-kind": e.kind },
            h("strong", {}, e.level === "warning" ? t("job.warning") : e.kind), " ",
            e.message, " ", h("span", { class: "muted" },
              [e.step !== null ? `${t("job.step")} ${e.step}` : "", `#${e.attempt}`, fmtTime(e.at)]
                .filter(Boolean).join(" · "))))),
      );
    } else {
      events.hidden = true;
    }
    if (Array.isArray(job.attempts) && job.attempts.length) {
      attempts.hidden = false;
      attempts.replaceChildren(h("h2", {}, t("job.attempts")), genericTable(job.attempts));
    }
    if (job.recipe_summary) {
      const r = job.recipe_summary;
      recipe.hidden = false;
      recipe.replaceChildren(
        h("h2", {}, t("job.summary")),
        h("dl", { class: "tiles" }, ...Object.entries(r).filter(([, v]) => typeof v !== "object" || v === null)
          .flatMap(([k, v]) => tile(k, typeof v === "number" ? fmt(v, 6) : String(v), null))),
      );
    }
    const { name, nproc_per_node, train, script, priority, gpus_per_node } = job;
    const shown = { name, nproc_per_node, priority, gpus_per_node, ...(script ? { script } : { train }) };
    spec.textContent = JSON.stringify(shown, null, 2);
  }

  function genericTable(items) {
    const keys = [...new Set(items.flatMap((item) => Object.keys(item)))];
    const cell = (k, v) => {
      if (v !== null && typeof v === "object") return JSON.stringify(v);
      return k.endsWith("_at") && typeof v === "string" ? fmtTime(v) : fmt(v, 6);
    };
    return h("div", { class: "table-wrap" }, h("table", {},
      h("thead", {}, h("tr", {}, keys.map((k) => h("th", { scope: "col", "data-key": k }, columnTitle(k))))),
      h("tbody", {}, items.map((item) => h("tr", {}, keys.map((k) => h("td", {}, cell(k, item[k]))))))));
  }

  async function refresh() {
    job = await api("GET", path);
    if (!closed) show();
  }

  let logLines = [];
  /** The last log lines, less torch's noise unless asked; at the newest line, following it
   * unless the reader scrolled up. */
  function renderLogs() {
    const following = !logs.textContent || logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    const { shown, hidden } = showAllLogs.checked ? { shown: logLines, hidden: 0 } : withoutNoise(logLines);
    logs.textContent = shown.join("\n");
    hiddenLogs.hidden = !hidden && !showAllLogs.checked;
    hiddenLogs.querySelector("#log-hidden-count").textContent = hidden ? t("job.log_hidden", { n: hidden }) : "";
    if (following) logs.scrollTop = logs.scrollHeight;
  }
  showAllLogs.addEventListener("change", renderLogs);

  async function loadLogs() {
    try {
      const out = await api("GET", `${path}/logs?tail=${LOG_LINES}`);
      if (!closed) {
        logLines = out.lines;
        renderLogs();
      }
    } catch (err) {
      if (!closed) logs.textContent = errorText(err);
    }
    if (!closed && job && !TERMINAL.has(job.state)) logTimer = setTimeout(loadLogs, LOG_REFRESH_MS);
  }

  async function loadOptional() {
    if (await hasRoute("/v1/jobs/{job_id}/checkpoints")) {
      try {
        const out = await api("GET", `${path}/checkpoints`);
        const items = Array.isArray(out) ? out : out.items || [];
        checkpoints.hidden = false;
        checkpoints.replaceChildren(h("h2", {}, t("job.checkpoints")),
          items.length ? genericTable(items) : h("p", { class: "muted" }, t("none")));
      } catch {
        checkpoints.hidden = true;
      }
    }
    if (await hasRoute("/v1/jobs/{job_id}/artifacts")) {
      try {
        const out = await api("GET", `${path}/artifacts?under=export&limit=1000`);
        const exported = (out.items || []).filter((a) => a.kind === "export");
        artifacts.hidden = !exported.length;
        const whole = h("a", { href: "#", id: "export-archive",
          onclick: (event) => download(event, "export", "archive", `${jobId.slice(0, 8)}-export.tar`) },
        t("job.export_tar"));
        artifacts.replaceChildren(h("h2", {}, t("job.export")),
          h("p", { class: "muted" }, t("job.export_help"), " ", whole),
          h("ul", { id: "export-files" }, exported.map((a) => h("li", {},
            h("a", { href: "#", dataset: { path: a.path }, onclick: (event) => download(event, a.path) }, a.shown),
            ` (${fmtInt(a.bytes)} B)`))));
      } catch {
        artifacts.hidden = true;
      }
    }
    resume.hidden = !(await hasRoute("/v1/jobs/{job_id}/resume", "post")) || !job || !["failed", "cancelled"].includes(job.state);
  }

  /** Fetch an artifact with the token and hand it to the browser as a download. */
  async function download(event, file, route = "artifacts", name = file.split("/").pop()) {
    event.preventDefault();
    try {
      const blob = await api("GET", `${path}/${route}/${file.split("/").map(encodeURIComponent).join("/")}`, { raw: true });
      const link = h("a", { href: URL.createObjectURL(blob), download: name });
      link.click();
      setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
    } catch (err) {
      error.textContent = errorText(err);
      error.hidden = false;
    }
  }

  function startStream() {
    if (stream) stream.close();
    const after = series.step.length ? series.step[series.step.length - 1] : -1;
    let seenEvents = 0;
    stream = followEvents(`${path}/events?after_step=${after}`, {
      onEvent(type, data) {
        if (type === "metric") {
          addPoint(data);
          scheduleDraw();
        } else if ((type === "warning" || type === "info") && job) {
          // Each connection sends the stored events first: refresh only for a new one.
          seenEvents += 1;
          if (seenEvents > (job.events || []).length) refresh().catch(() => {});
        } else if (type === "state" && job && data.state && data.state !== job.state) {
          refresh().catch(() => {});
        } else if (type === "state" && job && data.state === "queued") {
          job.queue_position = data.queue_position;
          job.queue_reason = data.queue_reason;
          show();
        }
      },
      // The stream is over: its last `end` event, or a reconnect answered 204 because the
      // job ended while the page was away (a server restart). Show the final state.
      onEnd() {
        refresh().then(loadLogs).then(loadOptional).catch(() => {});
      },
      onStatus(s, detail) {
        streamStatus.textContent = s === "failed" ? t("stream.failed", { detail }) : t(`stream.${s}`);
        streamStatus.dataset.status = s;
      },
    });
  }

  (async () => {
    try {
      await refresh();
    } catch (err) {
      error.textContent = errorText(err);
      error.hidden = false;
      return;
    }
    startStream();
    loadLogs();
    loadOptional().catch(() => {});
  })();

  return () => {
    closed = true;
    clearTimeout(logTimer);
    cancelAnimationFrame(frame);
    if (stream) stream.close();
    for (const chart of charts) chart.destroy();
  };
}
