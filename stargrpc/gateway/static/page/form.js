// The run form: the tool list, and the tool's arguments as a form generated from its JSON
// Schema or as JSON text (the two views round-trip).

import { authHeaders } from "./api.js";
import { $, el } from "./dom.js";
import { hideError, showError, showRefusal } from "./errors.js";
import { buildField, newForm } from "./fields.js";
import { catalog, shown } from "./state.js";

// The arguments field of the tool shown, and the view in use ("form" or "json").
const args = { field: null, view: "form" };

function renderForm(entry, values) {
  const schema = (entry && entry.input_schema) || { type: "object", properties: {} };
  const root = { type: "object", ...schema };
  args.field = buildField("arguments", root, newForm(root), true, "");
  const node = args.field.node;
  const legend = node.querySelector(":scope > legend");
  if (legend) legend.textContent = "Arguments";
  if (!Object.keys(schema.properties || {}).length) {
    node.append(el("p", "help", "This tool takes no arguments."));
  }
  $("arguments-form").replaceChildren(node);
  if (values !== undefined) args.field.write(values);
  $("arguments").value = JSON.stringify(args.field.read(), null, 2);
}

// The arguments as the view in use shows them; throws an Error saying what is wrong.
export function currentArguments() {
  if (args.view === "json") {
    const parsed = JSON.parse($("arguments").value || "{}");
    if (!parsed || typeof parsed !== "object" || Array.isArray(parsed)) {
      throw new Error("the arguments must be a JSON object");
    }
    return parsed;
  }
  return args.field ? args.field.read() : {};
}

export function setView(view) {
  try {
    if (view === "json" && args.view === "form") {
      $("arguments").value = JSON.stringify(currentArguments(), null, 2);
    } else if (view === "form" && args.view === "json") {
      args.field.write(currentArguments());
    }
  } catch (error) {
    showError(`Cannot switch views: ${error.message}`);
    return;
  }
  hideError();
  args.view = view;
  $("arguments-form").hidden = view !== "form";
  $("json-view").hidden = view !== "json";
  $("view-form").setAttribute("aria-pressed", String(view === "form"));
  $("view-json").setAttribute("aria-pressed", String(view === "json"));
}

// Puts a tool's description and form on the page, filled with `values` when given.
export function showTool(name, values) {
  const entry = catalog.get(name);
  $("tool-description").textContent = entry ? entry.description || "" : "";
  renderForm(entry, values);
}

// Lists the tools (in the form and the runs filter); false when the server refused.
export async function loadTools() {
  const response = await fetch("/v1/tools", { headers: authHeaders() });
  if (!response.ok) {
    await showRefusal("Cannot list the tools", response);
    return false;
  }
  const body = await response.json();
  const select = $("tool");
  const filter = $("filter-tool");
  const chosenFilter = filter.value;
  select.replaceChildren();
  filter.replaceChildren(Object.assign(el("option", "", "any"), { value: "" }));
  catalog.clear();
  for (const entry of body.tools || []) {
    catalog.set(entry.name, entry);
    const option = el("option", "", entry.name);
    option.value = entry.name;
    if (entry.permissions && entry.permissions.callable === false) option.disabled = true;
    select.append(option);
    filter.append(Object.assign(el("option", "", entry.name), { value: entry.name }));
  }
  filter.value = chosenFilter;
  hideError();
  const runTool = $("run-title").textContent;  // a run re-joined before the list came
  if (runTool && catalog.has(runTool)) select.value = runTool;
  showTool(select.value, shown.runArgs || undefined);
  return true;
}
