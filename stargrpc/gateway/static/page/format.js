// The gateway's protobuf JSON, read for display: durations, enum names, bytes, byte counts.

// "1.500s" (protobuf JSON Duration) -> 1.5
export const seconds = (duration) => (duration ? parseFloat(duration) : 0);
export const outcomeName = (outcome) => (outcome || "OUTCOME_UNSPECIFIED").replace("OUTCOME_", "");
export const phaseName = (phase) => (phase || "").replace("STEP_PHASE_", "");
export const statusName = (status) => (status || "STEP_STATUS_RUNNING").replace("STEP_STATUS_", "");

// A count of bytes (a number, or a 64-bit integer as proto3 JSON's string) for people:
// 512 B, 12.0 KiB, 58.0 MiB, 1.5 GiB (as `stargrpc call` writes them).
export function byteSize(count) {
  let value = Number(count);
  if (value < 1024) return `${value} B`;
  for (const unit of ["KiB", "MiB", "GiB"]) {
    value /= 1024;
    if (value < 1024 || unit === "GiB") return `${value.toFixed(1)} ${unit}`;
  }
  return "";
}

export function base64Bytes(text) {
  const binary = atob(text || "");
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i += 1) bytes[i] = binary.charCodeAt(i);
  return bytes;
}
