// The gateway's protobuf JSON, read for display: durations, enum names, bytes.

// "1.500s" (protobuf JSON Duration) -> 1.5
export const seconds = (duration) => (duration ? parseFloat(duration) : 0);
export const outcomeName = (outcome) => (outcome || "OUTCOME_UNSPECIFIED").replace("OUTCOME_", "");
export const phaseName = (phase) => (phase || "").replace("STEP_PHASE_", "");
export const statusName = (status) => (status || "STEP_STATUS_RUNNING").replace("STEP_STATUS_", "");

export function base64Bytes(text) {
  const binary = atob(text || "");
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i += 1) bytes[i] = binary.charCodeAt(i);
  return bytes;
}
