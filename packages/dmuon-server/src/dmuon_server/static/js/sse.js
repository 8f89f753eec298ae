// Server-Sent Events over fetch, so that the stream can carry the Authorization header
// (EventSource cannot). Reconnects with Last-Event-ID after a drop, as EventSource would,
// and after an `end` event whose reason is `server_shutdown` (the job goes on; the server
// is restarting). Any other `end`, or a 204 answer to a reconnect, is final.
import { authHeaders, requestToken } from "./api.js";

/** `reason` of the `end` event a stopping server sends to every open stream. */
export const SHUTDOWN_REASON = "server_shutdown";

/**
 * Follow the event stream at `path`.
 * handlers: onEvent(type, data, id), onStatus(status, detail), onEnd().
 * Status is one of "connecting", "open", "reconnecting", "ended", "failed".
 * Returns an object with close().
 */
export function followEvents(path, handlers) {
  const controller = new AbortController();
  let lastEventId = null;
  let retryMs = 3000;
  let ended = false;
  const status = (s, detail) => handlers.onStatus && handlers.onStatus(s, detail);

  function dispatch(block) {
    let type = "message";
    const data = [];
    let sawField = false;
    for (const line of block) {
      if (line.startsWith(":")) continue;
      const colon = line.indexOf(":");
      const field = colon < 0 ? line : line.slice(0, colon);
      let value = colon < 0 ? "" : line.slice(colon + 1);
      if (value.startsWith(" ")) value = value.slice(1);
      sawField = true;
      if (field === "event") type = value;
      else if (field === "data") data.push(value);
      else if (field === "id" && !value.includes("\0")) lastEventId = value;
      else if (field === "retry" && /^\d+$/.test(value)) retryMs = Number(value);
    }
    if (!sawField || data.length === 0) return;
    let parsed = data.join("\n");
    try {
      parsed = JSON.parse(parsed);
    } catch {
      /* keep the text */
    }
    if (type === "end" && !(parsed && parsed.reason === SHUTDOWN_REASON)) ended = true;
    handlers.onEvent(type, parsed, lastEventId);
  }

  async function readStream(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let block = [];
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      const lines = buffer.split(/\r\n|\r|\n/);
      buffer = lines.pop();
      for (const line of lines) {
        if (line === "") {
          dispatch(block);
          block = [];
          if (ended) {
            controller.abort();
            return;
          }
        } else {
          block.push(line);
        }
      }
    }
  }

  async function run() {
    status("connecting");
    while (!controller.signal.aborted) {
      try {
        const headers = authHeaders({ Accept: "text/event-stream" });
        if (lastEventId !== null) headers["Last-Event-ID"] = lastEventId;
        const response = await fetch(path, { headers, cache: "no-store", signal: controller.signal });
        if (response.status === 204) {
          ended = true;
        } else if (response.status === 401) {
          const problem = await response.json().catch(() => null);
          if (!(await requestToken(problem))) {
            status("failed", (problem && problem.detail) || "401");
            return;
          }
          continue;
        } else if (!response.ok) {
          const problem = await response.json().catch(() => null);
          status("failed", (problem && (problem.detail || problem.title)) || String(response.status));
          return;
        } else {
          status("open");
          await readStream(response.body);
        }
      } catch (err) {
        if (controller.signal.aborted && !ended) return;
      }
      if (ended) {
        status("ended");
        if (handlers.onEnd) handlers.onEnd();
        return;
      }
      status("reconnecting");
      await new Promise((resolve) => setTimeout(resolve, retryMs));
    }
  }

  run();
  return {
    close() {
      controller.abort();
    },
  };
}
