// The arguments form's fields, one builder per kind of schema. A field is
// { node, read() -> value | undefined (left out), write(value) }; read() throws an Error
// naming the field when its text cannot be a value.
//
// Every builder gets the resolved schema and a `spec`: the field's name, label, id, path
// (data-path on its control, e.g. "limits.rows" or "tags[0]"), whether it is required, its
// help paragraph, and `form` ({ root schema, nextId() }) for building nested fields.

import { el } from "./dom.js";
import { resolve, typeOf } from "./schema.js";

// Multi-line code fields get a code editor rather than a one-line input.
const CODE_FIELDS = new Set(["code", "command", "script", "source"]);

// A fresh form: ids count from 1 in each one, so re-rendering gives the same ids.
export function newForm(root) {
  let count = 0;
  return { root, nextId: () => `arg-${(count += 1)}` };
}

export function buildField(name, rawSchema, form, required, path) {
  const schema = resolve(rawSchema, form.root);
  const kind = typeOf(schema);
  const id = form.nextId();
  const label = schema.title || name;
  const help = schema.description ? el("p", "help", schema.description) : null;
  if (help) help.id = `${id}-help`;
  const spec = { name, kind, id, label, help, required, path, form };
  if (kind === "object" && schema.properties) return objectField(schema, spec);
  if (kind === "array" && schema.items && typeOf(resolve(schema.items, form.root)) !== "json") {
    return arrayField(schema, spec);
  }
  const builder = LEAVES[kind] || jsonField;
  return leaf(builder(schema, spec), spec);
}

// -- what the builders share ----------------------------------------------------------------

function labelFor(spec, forId) {
  const node = el("label", "", spec.label);
  node.htmlFor = forId;
  if (spec.required) {
    const mark = el("span", "required-mark", "*");
    mark.setAttribute("aria-hidden", "true");
    node.append(mark, el("span", "visually-hidden", " (required)"));
  }
  return node;
}

// The control of a one-control field, tied to its help, path and id.
function control(tag, spec) {
  const node = el(tag);
  if (spec.help) node.setAttribute("aria-describedby", spec.help.id);
  if (spec.required) node.required = true;
  node.dataset.path = spec.path;
  node.id = spec.id;
  return node;
}

function fieldset(spec) {
  const box = el("fieldset");
  box.dataset.path = spec.path;
  const legend = el("legend", "", spec.label);
  if (spec.required) legend.append(el("span", "visually-hidden", " (required)"));
  box.append(legend);
  if (spec.help) box.append(spec.help);
  return box;
}

// A one-control field: what the builder made, then the help, showing the default.
function leaf({ nodes, read, write }, spec) {
  const wrap = el("div", "field");
  wrap.append(...nodes);
  if (spec.help) wrap.append(spec.help);
  write(undefined);
  return { node: wrap, read, write };
}

const shownValue = (value, schema) => (value === undefined ? schema.default : value);

// -- one builder per kind -------------------------------------------------------------------

function booleanField(schema, spec) {
  const box = control("input", spec);
  box.type = "checkbox";
  const line = el("div", "check");
  const text = labelFor(spec, spec.id);
  text.style.margin = "0";
  line.append(box, text);
  return {
    nodes: [line],
    read: () => box.checked,
    write: (value) => { box.checked = value === undefined ? schema.default === true : !!value; },
  };
}

function enumField(schema, spec) {
  const select = control("select", spec);
  if (!spec.required) select.append(Object.assign(el("option", "", "—"), { value: "" }));
  schema.enum.forEach((choice, index) => {
    const option = el("option", "", String(choice));
    option.value = String(index);
    select.append(option);
  });
  return {
    nodes: [labelFor(spec, spec.id), select],
    read: () => (select.value === "" ? undefined : schema.enum[Number(select.value)]),
    write: (value) => {
      const chosen = shownValue(value, schema);
      const index = schema.enum.findIndex((choice) => choice === chosen);
      select.value = index >= 0 ? String(index) : (spec.required ? "0" : "");
    },
  };
}

function numberField(schema, spec) {
  const input = control("input", spec);
  input.type = "number";
  input.step = spec.kind === "integer" ? "1" : "any";
  if (schema.minimum !== undefined) input.min = schema.minimum;
  if (schema.maximum !== undefined) input.max = schema.maximum;
  return {
    nodes: [labelFor(spec, spec.id), input],
    read: () => (input.value.trim() === "" ? (spec.required ? null : undefined)
      : Number(input.value)),
    write: (value) => {
      const shown = shownValue(value, schema);
      input.value = shown === undefined || shown === null ? "" : String(shown);
    },
  };
}

// Tab indents in the code editor; Escape, then Tab, leaves it (keyboard users).
function indentOnTab(editor) {
  editor.addEventListener("keydown", (event) => {
    if (event.key === "Escape") editor.dataset.leave = "1";
    if (event.key === "Tab" && !event.shiftKey && !editor.dataset.leave) {
      event.preventDefault();
      editor.setRangeText("    ", editor.selectionStart, editor.selectionEnd, "end");
    }
    if (event.key !== "Escape" && event.key !== "Tab") delete editor.dataset.leave;
  });
}

function stringField(schema, spec) {
  const code = CODE_FIELDS.has(spec.name) || schema.format === "multiline";
  const input = control(code ? "textarea" : "input", spec);
  const nodes = [labelFor(spec, spec.id), input];
  if (code) {
    input.className = "code";
    input.rows = 8;
    input.spellcheck = false;
    indentOnTab(input);
    nodes.push(el("p", "help", "Tab indents; press Escape, then Tab, to move on."));
  } else {
    input.type = "text";
  }
  return {
    nodes,
    read: () => (input.value === "" && !spec.required ? undefined : input.value),
    write: (value) => {
      const shown = shownValue(value, schema);
      input.value = shown === undefined || shown === null ? "" : String(shown);
    },
  };
}

// Anything else (free-form objects, mixed types) is edited as JSON.
function jsonField(schema, spec) {
  const text = control("textarea", spec);
  text.rows = 3;
  text.spellcheck = false;
  return {
    nodes: [labelFor(spec, spec.id), text,
            el("p", "help", spec.kind === "object" ? "A JSON object." : "JSON.")],
    read: () => {
      const source = text.value.trim();
      if (!source) return spec.required ? {} : undefined;
      try {
        return JSON.parse(source);
      } catch (error) {
        throw new Error(`${spec.label}: not valid JSON (${error.message})`);
      }
    },
    write: (value) => {
      const shown = shownValue(value, schema);
      text.value = shown === undefined ? "" : JSON.stringify(shown, null, 2);
    },
  };
}

const LEAVES = {
  boolean: booleanField,
  enum: enumField,
  integer: numberField,
  number: numberField,
  string: stringField,
};

function objectField(schema, spec) {
  const box = fieldset(spec);
  const needed = new Set(schema.required || []);
  const children = Object.entries(schema.properties).map(([key, sub]) =>
    [key, buildField(key, sub, spec.form, needed.has(key), spec.path ? `${spec.path}.${key}` : key)]);
  for (const [, child] of children) box.append(child.node);
  return {
    node: box,
    read() {
      const value = {};
      for (const [key, child] of children) {
        const item = child.read();
        if (item !== undefined) value[key] = item;
      }
      return value;
    },
    write(value) {
      const given = value && typeof value === "object" ? value : {};
      for (const [key, child] of children) child.write(given[key]);
    },
  };
}

// A list of fields of the item schema, with Add and Remove buttons.
function arrayField(schema, spec) {
  const { label, path, form } = spec;
  const box = fieldset(spec);
  const list = el("div", "array-items");
  const add = el("button", "small", `Add ${label.toLowerCase()} item`);
  add.type = "button";
  let items = [];
  const addItem = (value) => {
    const index = items.length;
    const field = buildField(`${label} ${index + 1}`, schema.items, form, false, `${path}[${index}]`);
    const row = el("div", "array-item");
    const remove = el("button", "small", "Remove");
    remove.type = "button";
    remove.setAttribute("aria-label", `Remove ${label} item ${index + 1}`);
    const entry = { field, row };
    remove.addEventListener("click", () => {
      items = items.filter((other) => other !== entry);
      row.remove();
      add.focus();
    });
    row.append(field.node, remove);
    list.append(row);
    items.push(entry);
    field.write(value);
    return field;
  };
  add.addEventListener("click", () => {
    addItem(undefined);
    const last = list.lastElementChild.querySelector("input, select, textarea");
    if (last) last.focus();
  });
  box.append(list, add);
  return {
    node: box,
    read() {
      const value = items.map((entry) => entry.field.read()).filter((v) => v !== undefined);
      return value.length || spec.required ? value : undefined;
    },
    write(value) {
      items = [];
      list.replaceChildren();
      const given = shownValue(value, schema);
      for (const item of Array.isArray(given) ? given : []) addItem(item);
    },
  };
}
