// The form's error box: a refused call, with every field violation and what to do.

import { $, el } from "./dom.js";

export function hideError() {
  $("form-error").hidden = true;
  $("form-error").replaceChildren();
}

export function showError(message, violations = [], hint = "") {
  const box = $("form-error");
  box.replaceChildren(el("strong", "", message));
  if (violations.length) {
    const list = el("ul");
    for (const v of violations) {
      const item = el("li");
      item.append(el("code", "", v.field || "request"), ` ${v.description || ""}`);
      list.append(item);
    }
    box.append(list);
  }
  if (hint) box.append(el("p", "", hint));
  box.hidden = false;
}

// A refused call: the status, every field violation with its description, and what to do.
export async function showRefusal(what, response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  const error = (body && body.error) || {};
  const violations = [];
  for (const detail of error.details || []) {
    for (const v of detail.fieldViolations || detail.field_violations || []) violations.push(v);
  }
  let hint = "";
  if (response.status === 401) {
    hint = "No valid API key was sent: paste one under Credentials above.";
    $("credentials").open = true;
  } else if (response.status === 403) {
    hint = "Your key may not do this; ask for a role that allows it.";
  }
  const status = error.status ? `${error.status}: ` : `HTTP ${response.status}: `;
  showError(`${what}. ${status}${error.message || ""}`, violations, hint);
}
