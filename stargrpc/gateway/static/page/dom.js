// DOM helpers every part of the page uses. Text goes in as text (textContent), never as
// HTML: whatever a tool or the server sends cannot become markup.

export const $ = (id) => document.getElementById(id);

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// New events are announced to screen readers, a few at a time.
export function announce(text) {
  const region = $("announcer");
  region.append(el("p", "", text));
  while (region.childElementCount > 5) region.firstElementChild.remove();
}

// An http(s) URL from untrusted text, or (allowData) an image data URL; null for anything
// else (javascript:, other data: types, garbage).
export function safeUrl(text, allowData) {
  try {
    const url = new URL(String(text), location.href);
    if (url.protocol === "https:" || url.protocol === "http:") return url.href;
    if (allowData && url.protocol === "data:" && /^data:image\/(png|jpeg|gif|webp);/.test(url.href)) {
      return url.href;
    }
  } catch {
    return null;
  }
  return null;
}
