// A run's receipt (Result.usage): what it used, one figure per measured field. An unset
// field was not measured and shows nothing (a field set to 0 was measured). The gateway's
// proto3 JSON gives the 64-bit byte counts as strings, hence Number().

import { el } from "./dom.js";
import { byteSize } from "./format.js";

const secs = (value) => `${Number(value).toFixed(2)} s`;
const has = (usage, key) => usage[key] !== undefined && usage[key] !== null;

// [term, figure] pairs, in the order `stargrpc call` prints them.
export function usageFigures(usage) {
  const figures = [];
  if (has(usage, "wall_seconds")) figures.push(["wall", secs(usage.wall_seconds)]);
  // Queued time and child runs are always 0 in this version: like `stargrpc call`, the
  // receipt names them only when they are not, so every run does not repeat two zeros.
  if (Number(usage.queued_seconds)) figures.push(["queued", secs(usage.queued_seconds)]);
  const cpu = [];
  if (has(usage, "cpu_user_seconds")) cpu.push(`${secs(usage.cpu_user_seconds)} user`);
  if (has(usage, "cpu_system_seconds")) cpu.push(`${secs(usage.cpu_system_seconds)} system`);
  if (cpu.length) figures.push(["CPU", cpu.join(" / ")]);
  if (has(usage, "peak_rss_bytes")) figures.push(["peak memory", byteSize(usage.peak_rss_bytes)]);
  if (has(usage, "bytes_written")) figures.push(["wrote", byteSize(usage.bytes_written)]);
  const network = [];
  if (has(usage, "network_bytes_sent")) network.push(`${byteSize(usage.network_bytes_sent)} sent`);
  if (has(usage, "network_bytes_received")) {
    network.push(`${byteSize(usage.network_bytes_received)} received`);
  }
  if (network.length) figures.push(["network", network.join(" / ")]);
  if (Number(usage.child_runs)) figures.push(["child runs", String(Number(usage.child_runs))]);
  return figures;
}

// Fills the receipt's <dl> (in a labelled group, hidden when nothing was measured).
export function renderUsage(box, list, usage) {
  const figures = usageFigures(usage || {});
  box.hidden = !figures.length;
  list.replaceChildren(...figures.map(([term, figure]) => {
    const item = el("div");
    item.append(el("dt", "", term), el("dd", "", figure));
    return item;
  }));
}
