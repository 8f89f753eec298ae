// Search a built site the way its pages do: run the theme's own search worker (Material's
// lunr integration, as shipped in assets/javascripts/workers/) on a language's index.
//
//   node material_search.js SITE LANG_ROOT QUERY...
//
// LANG_ROOT is "." for English or "zh". Prints one JSON line per query:
// {"query": ..., "pages": [{"page", "best", "score"}, ...]}, pages best first, as the
// search box lists them (one group per page; "best" is the group's top section).
"use strict";
const fs = require("fs");
const path = require("path");
const vm = require("vm");

const [site, langRoot, ...queries] = process.argv.slice(2);
const scripts = path.join(site, "assets", "javascripts");
const workers = path.join(scripts, "workers");
const worker = fs.readdirSync(workers).find((f) => /^search\.[0-9a-f]+\.min\.js$/.test(f));
if (!worker) throw new Error(`no search worker in ${workers}`);

// The worker's global scope: it registers a message listener, posts its replies, and
// loads the lunr language scripts with importScripts (paths relative to the worker).
const replies = [];
const scope = {
  console,
  setTimeout,
  postMessage: (message) => replies.push(message),
  addEventListener: (type, listener) => {
    if (type === "message") scope.listener = listener;
  },
  importScripts: (...urls) => {
    for (const url of urls) {
      const file = path.join(workers, url);
      vm.runInContext(fs.readFileSync(file, "utf8"), scope, { filename: file });
    }
  },
};
scope.self = scope;
vm.createContext(scope);
vm.runInContext(fs.readFileSync(path.join(workers, worker), "utf8"), scope, { filename: worker });

async function send(message) {
  const before = replies.length;
  await scope.listener({ data: message });
  while (replies.length === before) await new Promise((resolve) => setImmediate(resolve));
  return replies[replies.length - 1];
}

// Message types of Material's search worker: SETUP, READY, QUERY, RESULT.
const SETUP = 0;
const QUERY = 2;

(async () => {
  const file = path.join(site, langRoot, "search", "search_index.json");
  const index = JSON.parse(fs.readFileSync(file, "utf8"));
  await send({ type: SETUP, data: { ...index, options: { suggest: false } } });
  for (const query of queries) {
    const reply = await send({ type: QUERY, data: query });
    const pages = reply.data.items.map((group) => ({
      page: group[0].location.split("#")[0],
      best: group[0].location,
      score: group[0].score,
    }));
    process.stdout.write(JSON.stringify({ query, pages }) + "\n");
  }
})().catch((error) => {
  console.error(error);
  process.exit(1);
});
