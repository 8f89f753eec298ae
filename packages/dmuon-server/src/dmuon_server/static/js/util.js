// Small helpers: building elements, formatting numbers and durations.
import { lang, t } from "./i18n.js";

/** Create an element: h("td", {class: "num"}, "1.0", child, ...). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (value === true) el.setAttribute(key, "");
    else el.setAttribute(key, String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

/** A metric value as a number for a chart: null for missing or non-finite ("NaN", ...). */
export function num(value) {
  return typeof value === "number" && Number.isFinite(value) ? value : null;
}

/** A metric value as text: numbers with 4 significant digits, encoded non-finite as sent. */
export function fmt(value, digits = 4) {
  if (value === null || value === undefined) return t("none");
  if (typeof value === "string") return value;
  if (!Number.isFinite(value)) return String(value);
  if (Math.abs(value) >= 1e5) return Math.round(value).toLocaleString(lang() === "zh" ? "zh-CN" : "en");
  return Number(value.toPrecision(digits)).toString();
}

/** A whole number with digit grouping. */
export function fmtInt(value) {
  if (value === null || value === undefined) return t("none");
  return Number(value).toLocaleString(lang() === "zh" ? "zh-CN" : "en");
}

/** A rate (tokens/s): a whole number with digit grouping from 1,000 up ("8,780"), three
 * significant digits below. */
export function fmtRate(value) {
  if (typeof value !== "number" || !Number.isFinite(value)) return fmt(value);
  return Math.abs(value) >= 1000 ? fmtInt(Math.round(value)) : fmt(value, 3);
}

/** The heading of an API field's column: its text in the reader's language, else the
 * field's name in words ("exit_code" gives "Exit code"). */
export function columnTitle(key) {
  const text = t(`field.${key}`);
  if (text !== `field.${key}`) return text;
  const words = key.replaceAll("_", " ");
  return words.charAt(0).toUpperCase() + words.slice(1);
}

/** Seconds as "1h 02m", "3m 07s" or "12.3s". */
export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return t("none");
  if (seconds < 60) return `${seconds.toFixed(1)}s`;
  const s = Math.round(seconds);
  const hours = Math.floor(s / 3600);
  const minutes = Math.floor((s % 3600) / 60);
  const secs = s % 60;
  return hours ? `${hours}h ${String(minutes).padStart(2, "0")}m` : `${minutes}m ${String(secs).padStart(2, "0")}s`;
}

/** An ISO timestamp in the reader's local time. */
export function fmtTime(iso) {
  if (!iso) return t("none");
  const date = new Date(iso);
  return Number.isNaN(date.getTime()) ? iso : date.toLocaleString(lang() === "zh" ? "zh-CN" : "en");
}

/** A state badge; `data-state` keeps the API's name whatever the language. */
export function stateBadge(state) {
  return h("span", { class: "state", dataset: { state } }, t(`state.${state}`));
}

/** The label of a job: its name, else the start of its id. */
export function jobLabel(job) {
  return job.name || job.id.slice(0, 8);
}

/** Show a short message in the status area (read out by screen readers). */
export function notify(message) {
  const box = document.getElementById("status");
  box.textContent = message;
  clearTimeout(notify.timer);
  notify.timer = setTimeout(() => {
    box.textContent = "";
  }, 5000);
}

/** A readable message for an error thrown by `api()` or by fetch. */
export function errorText(err) {
  if (err && err.problem) {
    return t("err.generic", { status: err.status, detail: err.problem.detail || err.problem.title });
  }
  return t("err.offline");
}

export const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
export const STATES = ["queued", "starting", "running", "succeeded", "failed", "cancelled"];

/** Log lines that say nothing about the job: torch's warning, on every rank of a host whose
 * name lookup lacks an IPv6 loopback entry, that "the hostname of the client socket cannot
 * be retrieved". */
export const LOG_NOISE = [/hostname of the client socket cannot be retrieved/];

/** ``{shown, hidden}``: the lines without `LOG_NOISE`, and how many were left out. */
export function withoutNoise(lines) {
  const shown = lines.filter((line) => !LOG_NOISE.some((pattern) => pattern.test(line)));
  return { shown, hidden: lines.length - shown.length };
}
