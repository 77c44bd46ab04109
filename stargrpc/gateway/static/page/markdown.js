// Markdown, the safe subset: headings, paragraphs, lists, code blocks, **bold**, *italic*,
// `code` and [links](https://…). Built as DOM nodes: tool text is never parsed as HTML,
// and a link is kept only when its URL is http(s).

import { el, safeUrl } from "./dom.js";

function inline(text) {
  const nodes = [];
  const pattern = /(\*\*([^*]+)\*\*|\*([^*]+)\*|`([^`]+)`|\[([^\]]+)\]\(([^)\s]+)\))/g;
  let at = 0;
  for (const match of text.matchAll(pattern)) {
    if (match.index > at) nodes.push(document.createTextNode(text.slice(at, match.index)));
    if (match[2]) nodes.push(el("strong", "", match[2]));
    else if (match[3]) nodes.push(el("em", "", match[3]));
    else if (match[4]) nodes.push(el("code", "", match[4]));
    else {
      const href = safeUrl(match[6], false);
      if (href) {
        const link = el("a", "", match[5]);
        link.href = href;
        link.rel = "noopener noreferrer";
        nodes.push(link);
      } else nodes.push(document.createTextNode(match[5]));
    }
    at = match.index + match[0].length;
  }
  if (at < text.length) nodes.push(document.createTextNode(text.slice(at)));
  return nodes;
}

export function markdown(source) {
  const box = el("div", "markdown");
  const lines = String(source).split("\n");
  let list = null;
  for (let i = 0; i < lines.length; i += 1) {
    const line = lines[i];
    if (line.startsWith("```")) {
      const code = [];
      for (i += 1; i < lines.length && !lines[i].startsWith("```"); i += 1) code.push(lines[i]);
      box.append(el("pre", "", code.join("\n")));
      list = null;
      continue;
    }
    const heading = /^(#{1,4})\s+(.*)$/.exec(line);
    const bullet = /^\s*[-*]\s+(.*)$/.exec(line);
    if (heading) {
      const node = el(`h${Math.min(6, heading[1].length + 3)}`);
      node.append(...inline(heading[2]));
      box.append(node);
      list = null;
    } else if (bullet) {
      if (!list) box.append((list = el("ul")));
      const item = el("li");
      item.append(...inline(bullet[1]));
      list.append(item);
    } else if (line.trim()) {
      const para = el("p");
      para.append(...inline(line));
      box.append(para);
      list = null;
    } else list = null;
  }
  return box;
}
