// The REST API under /v1, called with the bearer token kept in session storage.
const TOKEN_KEY = "dmuon.token";

/** An error answer of the API, with its problem details (RFC 9457) when it sent them. */
export class ApiError extends Error {
  constructor(status, problem) {
    super((problem && (problem.detail || problem.title)) || `HTTP ${status}`);
    this.status = status;
    this.problem = problem || { status, title: `HTTP ${status}` };
  }
}

let askForToken = null;
let pendingAsk = null;

/** Register the function that asks the user for a token (returns a promise of it or null). */
export function onTokenNeeded(fn) {
  askForToken = fn;
}

/** The token of this tab, or null. */
export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

/** Keep (or, with null, forget) the token of this tab. */
export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

/** Ask the user once, however many requests are waiting for a token at the same time. */
export function requestToken(problem) {
  if (!askForToken) return Promise.resolve(null);
  if (!pendingAsk) {
    pendingAsk = askForToken(problem).then((value) => {
      pendingAsk = null;
      if (value) setToken(value);
      return value;
    });
  }
  return pendingAsk;
}

/** Headers for a request: `extra` plus the Authorization header when a token is known. */
export function authHeaders(extra = {}) {
  const headers = { ...extra };
  const value = token();
  if (value) headers.Authorization = `Bearer ${value}`;
  return headers;
}

async function problemOf(response) {
  try {
    return await response.json();
  } catch {
    return { status: response.status, title: response.statusText };
  }
}

/** Call the API; resolves to the JSON body (null for 204; a Blob with `raw`), rejects
 * with ApiError. */
export async function api(method, path, { body, headers = {}, signal, raw = false } = {}) {
  for (let attempt = 0; ; attempt += 1) {
    const init = {
      method,
      signal,
      cache: "no-store",
      headers: authHeaders({ Accept: raw ? "*/*" : "application/json", ...headers }),
    };
    if (body !== undefined) {
      init.body = JSON.stringify(body);
      init.headers["Content-Type"] = "application/json";
    }
    const response = await fetch(path, init);
    if (response.status === 401 && attempt < 5) {
      const problem = await problemOf(response);
      if (await requestToken(problem)) continue;
      throw new ApiError(401, problem);
    }
    if (!response.ok) throw new ApiError(response.status, await problemOf(response));
    if (response.status === 204) return null;
    return raw ? response.blob() : response.json();
  }
}

let schemaPromise = null;

/** The server's OpenAPI document (fetched once per page load). */
export function openapi() {
  if (!schemaPromise) {
    schemaPromise = api("GET", "/openapi.json").catch((err) => {
      schemaPromise = null;
      throw err;
    });
  }
  return schemaPromise;
}

/** True when the server's API has a route `path` (with `{job_id}` as in OpenAPI). */
export async function hasRoute(path, method = "get") {
  const doc = await openapi();
  return Boolean(doc.paths && doc.paths[path] && doc.paths[path][method]);
}

/** Every metric point of a job after step `after` (all of them by default), following the
 * `next` cursor. */
export async function allMetrics(jobId, after = -1) {
  const points = [];
  for (;;) {
    const page = await api("GET", `/v1/jobs/${encodeURIComponent(jobId)}/metrics?after_step=${after}&limit=10000`);
    points.push(...page.items);
    if (page.next === null || page.next === undefined) return points;
    after = page.next;
  }
}

/** A random Idempotency-Key (works outside secure contexts too). */
export function newIdempotencyKey() {
  const bytes = new Uint8Array(16);
  crypto.getRandomValues(bytes);
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}
