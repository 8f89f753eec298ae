// Submit: a form built from the server's OpenAPI schema of the job spec (fields, bounds,
// defaults, descriptions), the dry run (/v1/jobs:validate) as the user types, the API's
// validation errors next to their fields, and a "DMuon vs AdamW" pair. A job runs the
// recipe (`train`) or a script of the user's (`script`): a switch shows one group.
import { api, newIdempotencyKey, openapi } from "../api.js";
import { t } from "../i18n.js";
import { navigate } from "../ui.js";
import { errorText, fmtInt, h, jobLabel } from "../util.js";

const DRY_RUN_DELAY_MS = 400;

function resolve(doc, schema) {
  let s = schema || {};
  while (s.$ref) s = s.$ref.split("/").slice(1).reduce((node, key) => node[key], doc);
  return s;
}

/** Describe the leaf fields of `schema` (an object schema), recursing into nested objects. */
function leaves(doc, schema, prefix = []) {
  const out = [];
  const required = new Set(schema.required || []);
  for (const [name, raw] of Object.entries(schema.properties || {})) {
    const prop = resolve(doc, raw);
    const variants = (prop.anyOf || [prop]).map((v) => resolve(doc, v));
    const base = variants.find((v) => v.type !== "null") || {};
    const path = [...prefix, name];
    if (base.type === "object" && base.properties) {
      out.push({ group: path, title: base.title || name, fields: leaves(doc, base, path) });
      continue;
    }
    // A choice or an object (train.model: a preset, or {"path": ...}): the choice, then
    // the object's fields, optional; a filled-in object field wins in body().
    const alternative = variants.find((v) => v !== base && v.type === "object" && v.properties);
    const extra = alternative ? leaves(doc, alternative, path).map((f) => ({ ...f, optional: true })) : [];
    out.push({
      path,
      key: path.join("."),
      id: `field-${path.join("-")}`,
      type: base.type || "string",
      choices: base.enum || (base.const !== undefined ? [base.const] : null) || (base.type === "boolean" ? [true, false] : null),
      maxLength: base.maxLength,
      min: base.minimum ?? base.exclusiveMinimum,
      max: base.maximum ?? base.exclusiveMaximum,
      exclusiveMin: base.exclusiveMinimum !== undefined,
      optional: !required.has(name) || variants.some((v) => v.type === "null") || Boolean(alternative),
      default: prop.default ?? raw.default,
      description: prop.description || raw.description || "",
      // Only the dmuon optimizer takes it (the server refuses it with adamw).
      muonOnly: Boolean(prop["x-muon-only"] || raw["x-muon-only"]),
    });
    out.push(...extra);
  }
  return out;
}

/** Text with `code` spans (as in the schema's descriptions) as <code> elements. */
function withCode(text) {
  return (text || "").split("`").map((part, i) => (i % 2 ? h("code", {}, part) : part));
}

/** The legend of a group of fields: its own text where the page has one, else the
 * schema's title, with the spec's field name in brackets. */
function groupLegend(group) {
  const name = group.group[group.group.length - 1];
  const key = `submit.group.${name}`;
  const text = t(key);
  return text === key ? `${group.title} (${name})` : text;
}

function flatten(items) {
  return items.flatMap((item) => (item.fields ? flatten(item.fields) : [item]));
}

export function renderSubmit(main, params) {
  let closed = false;
  let timer = 0;
  let key = newIdempotencyKey();
  let fields = [];
  const controls = new Map();
  const errors = new Map();
  const form = h("form", { id: "submit-form", novalidate: true });
  const formError = h("p", { class: "error", role: "alert", id: "form-error", hidden: true });
  const note = h("p", { class: "muted", id: "prefill-note", hidden: true });
  const plan = h("section", { class: "plan", id: "dry-run", "aria-live": "polite" });
  main.append(h("h1", {}, t("submit.title")), note, formError, form);

  // Which program the job runs ("train" or "script"), and the groups only one of them has.
  let kind = "train";
  let pairButton = null;
  const kindOnly = { train: ["train", "init_from"], script: ["script"] };
  const groupBoxes = new Map();

  function setKind(value) {
    kind = value;
    for (const [name, box] of groupBoxes) {
      box.hidden = Object.entries(kindOnly).some(([k, names]) => k !== kind && names.includes(name));
    }
    const radio = document.getElementById(`kind-${kind}`);
    if (radio) radio.checked = true;
    if (pairButton) pairButton.hidden = kind !== "train"; // the pair compares optimizers
    const pairHelp = document.getElementById("pair-help");
    if (pairHelp) pairHelp.hidden = kind !== "train"; // and its hint goes with it
  }

  function inKind(f) {
    return !Object.entries(kindOnly).some(([k, names]) => k !== kind && names.includes(f.path[0]));
  }

  function setValues(values) {
    for (const f of fields) {
      const value = f.path.reduce((node, k) => (node == null ? undefined : node[k]), values);
      const input = controls.get(f.key);
      if (Array.isArray(value)) {
        input.value = value.join("\n");
      } else {
        const plain = value === undefined || value === null || typeof value === "object";
        input.value = plain ? "" : String(value);
      }
    }
    if (groupBoxes.has("script")) setKind(values && values.script ? "script" : "train");
  }

  function defaults() {
    const out = {};
    for (const f of fields) {
      if (f.default === undefined || f.default === null) continue;
      let node = out;
      for (const k of f.path.slice(0, -1)) node = node[k] ??= {};
      node[f.path[f.path.length - 1]] = f.default;
    }
    return out;
  }

  /** The body the form describes: empty fields are left out (the server's default). */
  function body() {
    const out = {};
    for (const f of fields) {
      if (!inKind(f)) continue;
      const raw = controls.get(f.key).value.trim();
      if (raw === "") continue;
      let value = raw;
      if (f.type === "array") {
        value = controls.get(f.key).value.split("\n").map((line) => line.trim()).filter(Boolean);
      } else if (f.type === "integer" || f.type === "number") {
        const n = Number(raw);
        if (raw !== "" && Number.isFinite(n)) value = n;
      } else if (f.type === "boolean") {
        value = raw === "true";
      }
      let node = out;
      for (const k of f.path.slice(0, -1)) {
        if (node[k] === null || typeof node[k] !== "object") node[k] = {};  // a path wins over a choice
        node = node[k];
      }
      node[f.path[f.path.length - 1]] = value;
    }
    return out;
  }

  function clearErrors() {
    for (const [k, el] of errors) {
      el.hidden = true;
      el.textContent = "";
      controls.get(k).removeAttribute("aria-invalid");
    }
    formError.hidden = true;
  }

  function showErrors(err) {
    clearErrors();
    const list = (err.problem && err.problem.errors) || [];
    const other = [];
    for (const e of list) {
      const loc = (e.loc || []).slice(e.loc && e.loc[0] === "body" ? 1 : 0).map(String);
      const k = loc.join(".");
      if (errors.has(k)) {
        const el = errors.get(k);
        el.textContent = el.textContent ? `${el.textContent}; ${e.message}` : e.message;
        el.hidden = false;
        controls.get(k).setAttribute("aria-invalid", "true");
      } else {
        other.push(`${e.field}: ${e.message}`);
      }
    }
    if (other.length || !list.length) {
      formError.textContent = other.length ? other.join("; ") : errorText(err);
      formError.hidden = false;
    }
  }

  function showPlan(p) {
    const rows = [
      ["plan.world", p.world_size],
      ["plan.seqs", fmtInt(p.global_batch_sequences)],
      ["plan.tokens_step", fmtInt(p.global_batch_tokens)],
      ["plan.tokens", fmtInt(p.total_tokens)],
    ];
    for (const name of ["parameters", "params", "num_params"]) {
      if (typeof p[name] === "number") rows.push(["plan.params", fmtInt(p[name])]);
    }
    if (Array.isArray(p.warnings) && p.warnings.length) rows.push(["plan.warnings", p.warnings.join(" · ")]);
    if (Array.isArray(p.torchrun_argv)) rows.push(["plan.cmd", p.torchrun_argv.join(" ")]);
    plan.replaceChildren(
      h("h2", {}, t("submit.plan")),
      h("p", { id: "dry-run-ok" }, t("submit.valid")),
      h("dl", {}, rows.flatMap(([k, v]) => [h("dt", {}, t(k)), h("dd", { dataset: { plan: k } }, v)])),
    );
  }

  async function dryRun() {
    try {
      const p = await api("POST", "/v1/jobs:validate", { body: body() });
      if (closed) return;
      clearErrors();
      showPlan(p);
    } catch (err) {
      if (closed) return;
      showErrors(err);
      plan.replaceChildren(h("h2", {}, t("submit.plan")), h("p", { class: "error" }, t("submit.invalid")));
    }
  }

  function changed() {
    key = newIdempotencyKey();
    clearTimeout(timer);
    timer = setTimeout(dryRun, DRY_RUN_DELAY_MS);
  }

  async function submitOne(spec, idempotencyKey) {
    return api("POST", "/v1/jobs", { body: spec, headers: { "Idempotency-Key": idempotencyKey } });
  }

  function field(f) {
    const hintId = `hint-${f.id}`;
    const errId = `err-${f.id}`;
    let input;
    if (f.type === "array") {
      input = h("textarea", { id: f.id, name: f.key, rows: "3", placeholder: t("submit.args") });
    } else if (f.choices) {
      input = h("select", { id: f.id, name: f.key },
        f.optional ? h("option", { value: "" }, "") : null,
        f.choices.map((c) => h("option", { value: String(c) }, String(c))));
    } else {
      const numeric = f.type === "integer" || f.type === "number";
      input = h("input", {
        id: f.id, name: f.key, type: numeric ? "number" : "text",
        inputmode: f.type === "integer" ? "numeric" : f.type === "number" ? "decimal" : null,
        step: f.type === "integer" ? "1" : numeric ? "any" : null,
        min: numeric && f.min !== undefined ? f.min : null,
        max: numeric && f.max !== undefined ? f.max : null,
        "aria-required": f.optional ? null : "true",
      });
    }
    input.setAttribute("aria-describedby", `${hintId} ${errId}`);
    input.addEventListener("input", changed);
    input.addEventListener("change", changed);
    controls.set(f.key, input);
    const bits = [];
    if (f.min !== undefined || f.max !== undefined) {
      const lo = f.min === undefined ? "" : `${f.exclusiveMin ? ">" : ""}${f.min}`;
      bits.push(t("submit.range", { lo, hi: f.max ?? "" }));
    }
    if (f.default !== undefined && f.default !== null) bits.push(t("submit.default", { v: f.default }));
    if (f.optional) bits.push(t("submit.optional"));
    const error = h("p", { class: "error", id: errId, hidden: true });
    errors.set(f.key, error);
    return [
      h("label", { for: f.id }, f.path.slice(f.path[0] === "train" ? 1 : 0).join(".")),
      h("div", { class: "field" }, input,
        h("p", { class: "hint", id: hintId }, withCode(f.description), f.description && bits.length ? " — " : "", bits.join(" · ")),
        error),
    ];
  }

  /** The job the form starts from: `?from=<id>`, else the newest job; null for none. */
  async function prefillSource(from) {
    try {
      return from
        ? await api("GET", `/v1/jobs/${encodeURIComponent(from)}`)
        : (await api("GET", "/v1/jobs?limit=1")).items[0] || null;
    } catch {
      return null;
    }
  }

  async function build() {
    // Both requests finish before any field exists: a value typed into the form is never
    // overwritten by a prefill that arrives later.
    const from = params.get("from");
    const [doc, source] = await Promise.all([openapi(), prefillSource(from)]);
    if (closed) return;
    const schema = resolve(doc, doc.components.schemas.JobCreate);
    const tree = leaves(doc, schema);
    fields = flatten(tree);
    const top = tree.filter((item) => !item.fields);
    const groups = tree.filter((item) => item.fields);
    const submit = h("button", { type: "submit", class: "primary", id: "submit-job" }, t("submit.submit"));
    const reset = h("button", { type: "button", id: "reset-defaults" }, t("submit.reset"));
    const optimizer = fields.find((f) => f.key === "train.optimizer");
    const canPair = optimizer && optimizer.choices && ["dmuon", "adamw"].every((c) => optimizer.choices.includes(c));
    const pair = canPair ? h("button", { type: "button", id: "submit-pair", "aria-describedby": "pair-help" }, t("submit.pair")) : null;
    pairButton = pair;
    const hasScript = groups.some((g) => g.group[0] === "script");
    const kindSwitch = hasScript
      ? h("fieldset", { id: "kind" }, h("legend", {}, t("submit.kind")),
        ...["train", "script"].map((k) => h("label", {},
          h("input", { type: "radio", name: "kind", id: `kind-${k}`, value: k, checked: k === kind,
            onchange: () => { setKind(k); changed(); } }), " ", t(`submit.kind.${k}`))))
      : null;
    form.append(
      h("fieldset", {}, h("legend", {}, t("submit.job")), h("div", { class: "form-grid" }, top.flatMap(field))),
      kindSwitch,
      ...groups.map((g) => {
        const box = h("fieldset", { id: `group-${g.group[0]}` }, h("legend", {}, groupLegend(g)),
          h("div", { class: "form-grid" }, g.fields.flatMap(field)));
        groupBoxes.set(g.group[0], box);
        return box;
      }),
      h("div", { class: "actions" }, submit, pair, reset),
      pair ? h("p", { class: "hint muted", id: "pair-help" }, t("submit.pair_help")) : null,
      plan,
    );
    setKind(kind);
    reset.addEventListener("click", () => {
      setValues(defaults());
      note.hidden = true;
      changed();
    });
    form.addEventListener("submit", async (event) => {
      event.preventDefault();
      submit.disabled = true;
      try {
        const job = await submitOne(body(), key);
        key = newIdempotencyKey();
        navigate(`#/job/${job.id}`);
      } catch (err) {
        showErrors(err);
      } finally {
        submit.disabled = false;
      }
    });
    if (pair) {
      pair.addEventListener("click", async () => {
        pair.disabled = true;
        const base = body();
        // Both names must stay within the schema's limit with the suffix added.
        const nameField = fields.find((f) => f.key === "name");
        const room = ((nameField && nameField.maxLength) || 128) - " dmuon".length;
        const name = (base.name || "run").slice(0, room).trimEnd() || "run";
        try {
          const ids = [];
          for (const opt of ["dmuon", "adamw"]) {
            const train = { ...(base.train || {}), optimizer: opt };
            // Settings of Muon's matrices alone, which the AdamW run refuses.
            if (opt === "adamw") for (const f of fields) if (f.muonOnly && f.path[0] === "train") delete train[f.path[1]];
            const spec = { ...base, name: `${name} ${opt}`, train };
            ids.push((await submitOne(spec, `${key}-${opt}`)).id);
          }
          key = newIdempotencyKey();
          navigate(`#/compare?ids=${ids.join(",")}`);
        } catch (err) {
          showErrors(err);
        } finally {
          pair.disabled = false;
        }
      });
    }
    // Every field of the form takes the source job's value (the job record holds the whole
    // spec next to its status; the form reads only the spec's fields).
    setValues(source || defaults());
    if (source) {
      note.textContent = t("submit.from", { name: jobLabel(source) });
      note.hidden = false;
      dryRun();
    }
  }

  build().catch((err) => {
    formError.textContent = errorText(err);
    formError.hidden = false;
  });
  return () => {
    closed = true;
    clearTimeout(timer);
  };
}
