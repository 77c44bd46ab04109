// Rich messages a tool sent, by kind: markdown (or text), table, image, link card; any
// other kind shows its payload as a tree.

import { el, safeUrl } from "./dom.js";
import { markdown } from "./markdown.js";
import { tree } from "./tree.js";

function table(box, payload) {
  const node = el("table");
  if (payload.title) node.append(el("caption", "", String(payload.title)));
  const columns = payload.columns || [];
  const head = el("tr");
  for (const column of columns) head.append(Object.assign(el("th", "", String(column)), { scope: "col" }));
  const thead = el("thead");
  thead.append(head);
  const tbody = el("tbody");
  for (const row of payload.rows || []) {
    const tr = el("tr");
    for (const cell of Array.isArray(row) ? row : columns.map((c) => row[c])) {
      tr.append(el("td", "", cell === undefined || cell === null ? "" : String(cell)));
    }
    tbody.append(tr);
  }
  node.append(thead, tbody);
  box.append(node);
}

function image(box, payload) {
  // https or image data only: the page's Content-Security-Policy refuses plain http.
  const src = safeUrl(payload.url || payload.src || "", true);
  if (src && !src.startsWith("http:")) {
    const node = el("img");
    node.src = src;
    node.alt = String(payload.alt || payload.caption || "image from the tool");
    box.append(node);
  } else box.append(el("p", "muted", "An image the page cannot show (not an https or image data URL)."));
  if (payload.caption) box.append(el("figcaption", "", String(payload.caption)));
}

function linkCard(box, payload) {
  const href = safeUrl(payload.url || "", false);
  const title = String(payload.title || payload.url || "link");
  box.classList.add("link-card");
  if (href) {
    const link = el("a", "", title);
    link.href = href;
    link.rel = "noopener noreferrer";
    box.append(link);
  } else box.append(el("strong", "", title));
  if (payload.description) box.append(el("p", "", String(payload.description)));
  if (href) box.append(el("p", "muted", new URL(href).host));
}

function markdownMessage(box, payload) {
  box.append(markdown(payload.markdown ?? payload.text ?? ""));
}

const RENDERERS = {
  markdown: markdownMessage,
  text: markdownMessage,
  table,
  image,
  link: linkCard,
  link_card: linkCard,
  card: linkCard,
};

export function richMessage(message) {
  const payload = message.payload || {};
  const kind = (message.kind || "").toLowerCase();
  const box = el("figure", `message message-${kind || "unknown"}`);
  box.style.margin = "0";
  const render = Object.hasOwn(RENDERERS, kind) ? RENDERERS[kind] : null;
  if (render) render(box, payload);
  else box.append(el("figcaption", "", `${message.kind || "message"}`), tree(payload, "payload", true));
  return box;
}
