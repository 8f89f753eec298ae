// Compare: overlay the loss curves of several jobs against step and against tokens
// (tokens per step from the recipe's own summary, or from the server's dry run). While a
// job runs, each refresh fetches only the points after the last one it has.
import { allMetrics, api } from "../api.js";
import { lineChart, palette } from "../charts.js";
import { t } from "../i18n.js";
import { navigate } from "../ui.js";
import { TERMINAL, errorText, fmt, fmtDuration, fmtInt, h, jobLabel, num, stateBadge } from "../util.js";

const REFRESH_MS = 5000;

/** Tokens per step of a job: from the recipe's summary (exact) once the job wrote one,
 * else from the server's dry run of its spec. */
async function tokensPerStep(job) {
  const r = job.recipe_summary;
  if (hasTokens(r)) return r.tokens / r.steps;
  try {
    const plan = await api("POST", "/v1/jobs:validate", { body: { nproc_per_node: job.nproc_per_node, train: job.train } });
    return plan.global_batch_tokens;
  } catch {
    return null;
  }
}

function hasTokens(r) {
  return Boolean(r && typeof r.tokens === "number" && r.steps);
}

/** Align several [x, y] series on one x axis (uPlot's join), missing values as null. */
function joined(tables) {
  if (!tables.length) return [[]];
  return uPlot.join(tables.map(([x, y]) => [Float64Array.from(x), y]));
}

function renderPicker(main) {
  const list = h("ul", { class: "picker" });
  const go = h("button", { type: "button", class: "primary", id: "compare-go", disabled: true }, t("cmp.go"));
  const chosen = new Set();
  main.append(h("h1", {}, t("cmp.title")), h("p", {}, t("cmp.pick")), list, h("div", { class: "actions" }, go));
  go.addEventListener("click", () => navigate(`#/compare?ids=${[...chosen].join(",")}`));
  api("GET", "/v1/jobs?limit=100")
    .then((page) => {
      list.replaceChildren(
        ...page.items.map((job) => {
          const id = `pick-${job.id}`;
          const box = h("input", { type: "checkbox", id });
          box.addEventListener("change", () => {
            if (box.checked) chosen.add(job.id);
            else chosen.delete(job.id);
            go.disabled = chosen.size < 2;
          });
          return h("li", {}, box, " ", h("label", { for: id }, jobLabel(job), " "), stateBadge(job.state));
        }),
      );
    })
    .catch((err) => list.replaceChildren(h("li", { class: "error" }, errorText(err))));
  return () => {};
}

export function renderCompare(main, params) {
  const ids = (params.get("ids") || "").split(",").filter(Boolean);
  if (ids.length < 2) return renderPicker(main);
  let closed = false;
  let timer = 0;
  const error = h("p", { class: "error", role: "alert", hidden: true });
  const logScale = h("input", { type: "checkbox", id: "cmp-log" });
  const stepEl = h("div", { class: "chart", id: "chart-cmp-step" });
  const tokenEl = h("div", { class: "chart", id: "chart-cmp-tokens" });
  const finals = h("tbody");
  main.append(
    h("h1", {}, t("cmp.title")),
    error,
    h("div", { class: "toolbar" }, h("label", {}, logScale, " ", t("job.log"))),
    h("h2", {}, t("cmp.vs_step")),
    stepEl,
    h("h2", {}, t("cmp.vs_tokens")),
    tokenEl,
    h("h2", {}, t("cmp.final")),
    h("div", { class: "table-wrap" }, h("table", { id: "compare-table" },
      h("thead", {}, h("tr", {}, ["col.name", "col.state", "col.optimizer", "col.step", "col.final_loss", "col.final_val",
        "col.tokens", "col.tps", "col.wall"].map((k) => h("th", { scope: "col" }, t(k))))),
      finals)),
  );
  const colors = palette();
  let stepChart = null;
  let tokenChart = null;
  // Per job: the points fetched so far, whether the job had ended when they were, its
  // attempts then (a new attempt replaces the points after its checkpoint: fetch again),
  // and its tokens per step.
  const known = new Map();

  async function pointsOf(job) {
    let entry = known.get(job.id);
    const attempts = (job.attempts || []).length;
    if (!entry || entry.attempts !== attempts) {
      entry = { points: [], complete: false, attempts, perStep: undefined, exact: false };
      known.set(job.id, entry);
    }
    if (!entry.complete) {
      const ended = TERMINAL.has(job.state); // its points were all stored before it ended
      const last = entry.points.length ? entry.points[entry.points.length - 1].step : -1;
      entry.points.push(...(await allMetrics(job.id, last)));
      entry.complete = ended;
    }
    if (entry.perStep === undefined || (!entry.exact && hasTokens(job.recipe_summary))) {
      entry.perStep = await tokensPerStep(job);
      entry.exact = hasTokens(job.recipe_summary);
    }
    return entry;
  }

  async function load() {
    try {
      const jobs = await Promise.all(ids.map((id) => api("GET", `/v1/jobs/${encodeURIComponent(id)}`)));
      const entries = await Promise.all(jobs.map(pointsOf));
      const points = entries.map((e) => e.points);
      const perStep = entries.map((e) => e.perStep);
      if (closed) return;
      const series = jobs.map((job, i) => ({ label: jobLabel(job), color: colors[i % colors.length], spanGaps: true }));
      const curves = points.map((pts) => pts.filter((p) => num(p.loss) !== null));
      const byStep = joined(curves.map((pts) => [pts.map((p) => p.step), pts.map((p) => num(p.loss))]));
      const byTokens = joined(
        curves.map((pts, i) => [pts.map((p) => p.step * (perStep[i] || 0)), pts.map((p) => (perStep[i] ? num(p.loss) : null))]),
      );
      if (!stepChart) {
        stepChart = lineChart(stepEl, { xLabel: t("job.step"), series, log: logScale.checked });
        tokenChart = lineChart(tokenEl, { xLabel: t("job.tokens"), series, log: logScale.checked });
      }
      stepChart.setData(byStep);
      tokenChart.setData(byTokens);
      finals.replaceChildren(
        ...jobs.map((job, i) => {
          const r = job.recipe_summary || {};
          const last = points[i].filter((p) => p.val_loss !== undefined).pop();
          return h("tr", { dataset: { jobId: job.id } },
            h("td", {}, h("a", { href: `#/job/${job.id}` }, jobLabel(job))),
            h("td", {}, stateBadge(job.state)),
            h("td", {}, job.train.optimizer),
            h("td", { class: "num" }, `${job.summary.last_step ?? 0} / ${job.summary.steps}`),
            h("td", { class: "num" }, fmt(r.final_loss ?? job.summary.last_loss)),
            h("td", { class: "num" }, fmt(last ? last.val_loss : job.summary.last_val_loss)),
            h("td", { class: "num" }, perStep[i] ? fmtInt(perStep[i] * (job.summary.last_step ?? 0)) : t("none")),
            h("td", { class: "num" }, fmt(r.tokens_per_s ?? job.summary.tokens_per_s, 3)),
            h("td", { class: "num" }, fmtDuration(r.wall_time_s ?? job.summary.elapsed_s)));
        }),
      );
      error.hidden = true;
      if (jobs.some((job) => !TERMINAL.has(job.state))) timer = setTimeout(load, REFRESH_MS);
    } catch (err) {
      if (closed) return;
      error.textContent = errorText(err);
      error.hidden = false;
    }
  }

  logScale.addEventListener("change", () => {
    if (!stepChart) return;
    stepChart.rebuild({ log: logScale.checked });
    tokenChart.rebuild({ log: logScale.checked });
    clearTimeout(timer);
    load();
  });
  load();
  return () => {
    closed = true;
    clearTimeout(timer);
    if (stepChart) stepChart.destroy();
    if (tokenChart) tokenChart.destroy();
  };
}
