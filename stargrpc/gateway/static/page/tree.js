// A JSON value as a tree of nested <details>, the top levels open.

import { el } from "./dom.js";

export function tree(value, label, open) {
  if (value === null || typeof value !== "object") {
    const leaf = el("div");
    leaf.append(el("span", "key", `${label}: `), el("span", "value", JSON.stringify(value)));
    return leaf;
  }
  const entries = Array.isArray(value) ? value.map((v, i) => [String(i), v]) : Object.entries(value);
  const node = el("details");
  node.open = open;
  node.append(el("summary", "key",
    `${label} ${Array.isArray(value) ? `[${entries.length}]` : `{${entries.length}}`}`));
  const list = el("ul");
  for (const [key, item] of entries) {
    const li = el("li");
    li.append(tree(item, key, false));
    list.append(li);
  }
  node.append(list);
  return node;
}
