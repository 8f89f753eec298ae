// Jobs page: newest first, filter by state (and, for an admin of a server with users, by
// user), pages of 25, live from the event streams of the running jobs on the page (and a
// list refresh for new jobs and state changes). A queued job shows why it waits.
import { api } from "../api.js";
import { t } from "../i18n.js";
import { followEvents } from "../sse.js";
import { navigate } from "../ui.js";
import {
  STATES,
  TERMINAL,
  errorText,
  fmt,
  fmtDuration,
  fmtRate,
  h,
  jobLabel,
  stateBadge,
} from "../util.js";

const PAGE = 25;
const REFRESH_MS = 3000;
/** Browsers keep about 6 connections per server: stream at most this many jobs at once. */
const MAX_STREAMS = 3;

export function renderJobs(main, params) {
  const state = params.get("state") || "";
  const owner = params.get("user") || "";
  const cursors = (params.get("at") || "").split(",").filter(Boolean);
  const selected = new Set();
  const rows = new Map();
  const streams = new Map();
  let timer = 0;
  let closed = false;

  const filter = h(
    "select",
    { id: "state-filter" },
    h("option", { value: "" }, t("jobs.all")),
    STATES.map((s) => h("option", { value: s, selected: s === state }, t(`state.${s}`))),
  );
  filter.addEventListener("change", () => navigate(listHash(filter.value, owner)));
  const userFilter = h("select", { id: "user-filter", hidden: true }, h("option", { value: "" }, t("jobs.all_users")));
  const userLabel = h("label", { for: "user-filter", hidden: true }, t("jobs.user"));
  userFilter.addEventListener("change", () => navigate(listHash(state, userFilter.value)));
  let showUser = false;
  const compare = h("button", { type: "button", id: "compare-selected", disabled: true }, t("jobs.compare"));
  compare.addEventListener("click", () => navigate(`#/compare?ids=${[...selected].join(",")}`));
  const body = h("tbody");
  const error = h("p", { class: "error", role: "alert", hidden: true });
  const empty = h("p", { class: "muted", hidden: true }, t("jobs.empty"));
  const pager = h("div", { class: "pager" });
  const cols = [
    ["", ""], ["col.name", ""], ["col.user", "user"], ["col.state", ""], ["col.step", "num"],
    ["col.loss", "num"], ["col.val", "num"], ["col.tps", "num opt"], ["col.elapsed", "num opt"],
    ["col.eta", "num opt"],
  ];
  const head = h("tr", {}, cols.map(([key, cls]) => h("th", { class: cls, scope: "col" }, key ? t(key) : "")));
  main.append(
    h("h1", {}, t("jobs.title")),
    h("div", { class: "toolbar" }, h("label", { for: "state-filter" }, t("jobs.filter")), filter,
      userLabel, userFilter, compare),
    error,
    h(
      "div",
      { class: "table-wrap" },
      h(
        "table",
        { id: "jobs-table" },
        h("thead", {}, head),
        body,
      ),
    ),
    empty,
    pager,
  );

  function listHash(stateValue, userValue) {
    const query = new URLSearchParams();
    if (stateValue) query.set("state", stateValue);
    if (userValue) query.set("user", userValue);
    const text = query.toString();
    return text ? `#/jobs?${text}` : "#/jobs";
  }

  /** Show the user column on a server with users, and the user filter to its admins. */
  async function setUpUsers() {
    let me;
    try {
      me = await api("GET", "/v1/me");
    } catch {
      return;
    }
    showUser = me.name !== null;
    for (const cell of main.querySelectorAll(".user")) cell.hidden = !showUser;
    if (!showUser || !me.admin) return;
    try {
      const users = await api("GET", "/v1/users");
      userFilter.append(...users.items.map((u) => h("option", { value: u.name, selected: u.name === owner }, u.name)));
      userFilter.hidden = userLabel.hidden = false;
    } catch {
      /* not an admin after all */
    }
  }

  function pageHash(list) {
    const query = new URLSearchParams();
    if (state) query.set("state", state);
    if (owner) query.set("user", owner);
    if (list.length) query.set("at", list.join(","));
    const text = query.toString();
    return text ? `#/jobs?${text}` : "#/jobs";
  }

  function cells(job) {
    const s = job.summary;
    const stepText = `${s.last_step ?? 0} / ${s.steps}`;
    return {
      step: stepText,
      loss: fmt(s.last_loss),
      val: fmt(s.last_val_loss),
      tps: fmtRate(s.tokens_per_s),
      elapsed: fmtDuration(s.elapsed_s),
      eta: TERMINAL.has(job.state) ? t("none") : fmtDuration(s.eta_s),
    };
  }

  function upsert(job) {
    let row = rows.get(job.id);
    if (!row) {
      const box = h("input", { type: "checkbox", "aria-label": t("jobs.select", { name: jobLabel(job) }) });
      box.addEventListener("change", () => {
        if (box.checked) selected.add(job.id);
        else selected.delete(job.id);
        compare.disabled = selected.size < 2;
      });
      const tds = {
        pick: h("td", {}, box),
        name: h("td", {}, h("a", { href: `#/job/${job.id}` }, jobLabel(job))),
        user: h("td", { class: "user", hidden: !showUser }),
        state: h("td", {}),
        step: h("td", { class: "num" }),
        loss: h("td", { class: "num" }),
        val: h("td", { class: "num" }),
        tps: h("td", { class: "num opt" }),
        elapsed: h("td", { class: "num opt" }),
        eta: h("td", { class: "num opt" }),
      };
      row = { tr: h("tr", { dataset: { jobId: job.id } }, Object.values(tds)), tds, job };
      rows.set(job.id, row);
    }
    row.job = job;
    row.tr.dataset.state = job.state;
    row.tds.state.replaceChildren(stateBadge(job.state));
    if (job.state === "queued" && job.queue_reason) {
      row.tds.state.append(h("span", { class: "queue-reason muted" }, job.queue_reason));
    }
    row.tds.user.textContent = job.user || t("none");
    for (const [key, text] of Object.entries(cells(job))) row.tds[key].textContent = text;
    return row;
  }

  function stream(job) {
    if (streams.has(job.id) || streams.size >= MAX_STREAMS) return;
    const handle = followEvents(`/v1/jobs/${encodeURIComponent(job.id)}/events?after_step=${job.summary.last_step ?? -1}`, {
      onEvent(type, data) {
        const row = rows.get(job.id);
        if (!row) return;
        const next = structuredClone(row.job);
        if (type === "metric") {
          next.summary.last_step = data.step;
          if (data.loss !== undefined) next.summary.last_loss = data.loss;
          if (data.val_loss !== undefined) next.summary.last_val_loss = data.val_loss;
          if (data.tokens_per_s !== undefined) next.summary.tokens_per_s = data.tokens_per_s;
        } else if (type === "state" || type === "end") {
          if (data.state) next.state = data.state;
          if (data.queue_reason !== undefined) next.queue_reason = data.queue_reason;
        }
        upsert(next);
      },
      onEnd() {
        streams.delete(job.id);
      },
      onStatus(s) {
        if (s === "failed") streams.delete(job.id);
      },
    });
    streams.set(job.id, handle);
  }

  async function load() {
    const query = new URLSearchParams({ limit: String(PAGE) });
    if (state) query.set("state", state);
    if (owner) query.set("user", owner);
    const cursor = cursors[cursors.length - 1];
    if (cursor) query.set("cursor", cursor);
    try {
      const page = await api("GET", `/v1/jobs?${query}`);
      if (closed) return;
      error.hidden = true;
      const ids = new Set(page.items.map((j) => j.id));
      for (const id of [...rows.keys()]) {
        if (!ids.has(id)) {
          rows.get(id).tr.remove();
          rows.delete(id);
        }
      }
      const trs = page.items.map((job) => upsert(job).tr);
      // Re-insert rows only when the order changed: moving a row would drop the focus.
      const same = trs.length === body.children.length && trs.every((tr, i) => body.children[i] === tr);
      if (!same) body.replaceChildren(...trs);
      empty.hidden = page.items.length > 0;
      for (const job of page.items) {
        if (job.state === "running" || job.state === "starting") stream(job);
      }
      pager.replaceChildren(
        cursors.length
          ? h("a", { href: pageHash(cursors.slice(0, -1)), id: "page-newer" }, t("jobs.newer"))
          : "",
        page.next ? h("a", { href: pageHash([...cursors, page.next]), id: "page-older" }, t("jobs.older")) : "",
      );
    } catch (err) {
      if (closed) return;
      error.textContent = errorText(err);
      error.hidden = false;
    }
    if (!closed) timer = setTimeout(load, REFRESH_MS);
  }

  setUpUsers().finally(load);
  for (const cell of head.querySelectorAll(".user")) cell.hidden = true;
  return () => {
    closed = true;
    clearTimeout(timer);
    for (const handle of streams.values()) handle.close();
  };
}
