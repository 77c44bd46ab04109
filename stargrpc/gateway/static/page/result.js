// A run's Result: outcome, duration, what the run used, error, output, structured output,
// and what the tool wrote back (files, injected tools, rich messages).

import { $, el } from "./dom.js";
import { base64Bytes, outcomeName, seconds } from "./format.js";
import { richMessage } from "./messages.js";
import { tree } from "./tree.js";
import { renderUsage } from "./usage.js";

// `streamed` is the stdout the steps streamed (already on the page); `chunks` the streamed
// files' bytes by file_id.
export function renderResult(result, { streamed, chunks }) {
  const outcome = outcomeName(result.outcome);
  const section = $("result");
  section.hidden = false;
  section.dataset.outcome = outcome;
  $("result-outcome").textContent = outcome;
  $("result-outcome").dataset.state = outcome;
  $("result-duration").textContent = `in ${seconds(result.duration).toFixed(2)} s`;
  renderUsage($("usage-box"), $("result-usage"), result.usage);
  $("result-error").textContent = result.error
    ? `${result.error.code}: ${result.error.message}` : "";
  // The output the steps streamed is shown there, once; the Result's own text (what the
  // model reads, which may repeat it) stays folded away.
  const output = result.output || "";
  const shownOutput = streamed.trim();
  const repeated = shownOutput !== "" && output.includes(shownOutput);
  $("result-output").textContent = repeated ? "" : output;
  $("result-text").hidden = !repeated;
  $("result-output-full").textContent = repeated ? output : "";
  const structured = $("result-structured");
  structured.replaceChildren();
  $("result-structured-box").hidden = result.structured_output === undefined;
  if (result.structured_output !== undefined) {
    structured.append(tree(result.structured_output, "structured_output", true));
  }
  const writeback = result.writeback || {};
  renderFiles(writeback.sent_files || [], chunks);
  $("files-box").hidden = !(writeback.sent_files || []).length;
  const tools = writeback.injected_tools || [];
  $("tools-box").hidden = !tools.length;
  $("result-tools").replaceChildren(...tools.map((t) => el("li", "", `${t.name}: ${t.description || ""}`)));
  const messages = writeback.sent_rich_messages || [];
  $("messages-box").hidden = !messages.length;
  $("result-messages").replaceChildren(...messages.map(richMessage));
}

function renderFiles(files, chunks) {
  const list = $("result-files");
  list.replaceChildren();
  if (!files.length) list.append(el("li", "muted", "none"));
  for (const file of files) {
    const item = el("li");
    const parts = file.streamed ? chunks.get(file.file_id) : [base64Bytes(file.content)];
    if (parts) {
      // Never the tool's own type: a blob URL opened in a tab (a middle click) is a page of
      // this origin, and a tool's text/html or SVG would render there as one.
      const blob = new Blob(parts, { type: "application/octet-stream" });
      const link = el("a", "download", file.name);
      link.href = URL.createObjectURL(blob);
      link.download = file.name;
      item.append(link);
    } else {
      item.append(el("span", "", `${file.name} (not delivered to this page)`));
    }
    item.append(el("span", "muted", ` ${file.mime_type || ""}, ${file.size || 0} bytes`));
    list.append(item);
  }
}
