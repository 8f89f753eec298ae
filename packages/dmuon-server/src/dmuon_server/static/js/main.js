// Entry point: theme, language, token dialog and the hash router (#/jobs, #/job/<id>,
// #/compare?ids=a,b, #/submit?from=<id>).
import { api, onTokenNeeded, setToken, token } from "./api.js";
import { applyStaticText, lang, setLang, t } from "./i18n.js";
import { renderCompare } from "./pages/compare.js";
import { renderJob } from "./pages/job.js";
import { renderJobs } from "./pages/jobs.js";
import { renderSubmit } from "./pages/submit.js";

const THEME_KEY = "dmuon.theme";
let cleanup = null;

function currentTheme() {
  const saved = localStorage.getItem(THEME_KEY);
  if (saved === "light" || saved === "dark") return saved;
  return matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light";
}

function applyTheme() {
  const theme = currentTheme();
  document.documentElement.dataset.theme = theme;
  const button = document.getElementById("theme-switch");
  button.setAttribute("aria-pressed", String(theme === "dark"));
  button.textContent = t(theme === "dark" ? "theme.light" : "theme.dark");
}

function applyLanguage() {
  applyStaticText();
  const button = document.getElementById("lang-switch");
  const other = lang() === "zh" ? "en" : "zh";
  button.textContent = other === "zh" ? "中文" : "English";
  button.lang = other === "zh" ? "zh-CN" : "en";
  applyTheme();
}

/** Ask for the token in the dialog; resolves to the token or null when cancelled. */
function askToken(problem) {
  const dialog = document.getElementById("token-dialog");
  const input = document.getElementById("token-input");
  const error = document.getElementById("token-error");
  const hadToken = Boolean(token());
  error.hidden = !hadToken;
  if (hadToken) error.textContent = t("token.wrong", { detail: (problem && problem.detail) || "401" });
  input.value = "";
  return new Promise((resolve) => {
    dialog.addEventListener(
      "close",
      () => {
        const value = dialog.returnValue === "ok" ? input.value.trim() : "";
        resolve(value || null);
      },
      { once: true },
    );
    dialog.showModal();
    input.focus();
  });
}

function parseHash() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, query = ""] = raw.split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  return { parts, params: new URLSearchParams(query) };
}

function route() {
  if (cleanup) cleanup();
  cleanup = null;
  const { parts, params } = parseHash();
  const main = document.getElementById("main");
  main.replaceChildren();
  const page = parts[0] || "jobs";
  for (const link of document.querySelectorAll("[data-nav]")) {
    if (link.dataset.nav === page) link.setAttribute("aria-current", "page");
    else link.removeAttribute("aria-current");
  }
  if (page === "job" && parts[1]) cleanup = renderJob(main, parts[1]);
  else if (page === "compare") cleanup = renderCompare(main, params);
  else if (page === "submit") cleanup = renderSubmit(main, params);
  else cleanup = renderJobs(main, params);
}

/** The banner naming the limits on jobs this server does not hold (`GET /v1/server`):
 * started with --allow-unenforced-limits, or defaults the machine cannot hold. */
async function showUnheldLimits() {
  const banner = document.getElementById("limits-banner");
  let info;
  try {
    info = await api("GET", "/v1/server");
  } catch {
    banner.hidden = true; // an older server, or no token yet
    return;
  }
  const off = info.limits.filter((limit) => !limit.held);
  const names = off.map((limit) => (limit.asked_by ? `${limit.name} (${limit.asked_by})` : limit.name));
  banner.textContent = off.length ? t("limits.off", { names: names.join(", ") }) : "";
  banner.hidden = off.length === 0;
}

/** `#token=...`, the address the server prints at start-up: keep the token for this tab
 * and take it out of the address bar and the history. */
function takeTokenFromAddress() {
  const match = /^#token=([\x21-\x7e]+)$/.exec(location.hash);
  if (!match) return;
  setToken(decodeURIComponent(match[1]));
  history.replaceState(null, "", location.pathname + location.search);
}

function start() {
  takeTokenFromAddress();
  onTokenNeeded(askToken);
  applyLanguage();
  document.getElementById("lang-switch").addEventListener("click", () => {
    setLang(lang() === "zh" ? "en" : "zh");
    applyLanguage();
    route();
    showUnheldLimits();
  });
  document.getElementById("theme-switch").addEventListener("click", () => {
    localStorage.setItem(THEME_KEY, currentTheme() === "dark" ? "light" : "dark");
    applyTheme();
    route();
  });
  document.getElementById("token-switch").addEventListener("click", async () => {
    const value = await askToken(null);
    if (value) {
      setToken(value);
      route();
      showUnheldLimits();
    }
  });
  window.addEventListener("hashchange", () => {
    route();
    document.getElementById("main").focus({ preventScroll: true });
  });
  route();
  showUnheldLimits();
}

if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
else start();
