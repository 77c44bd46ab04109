// Talking to the gateway: the caller's key, the headers that carry it, error bodies, and
// the arguments a run was started with from this tab.

const TOKEN_KEY = "stargrpc.token";
const ARGS_KEY = "stargrpc.args.";  // + run id: the arguments a run was started with here

export const savedToken = () => sessionStorage.getItem(TOKEN_KEY) || "";
export const saveToken = (token) => sessionStorage.setItem(TOKEN_KEY, token);

export function authHeaders(extra = {}) {
  const headers = { ...extra };
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers["Authorization"] = `Bearer ${token}`;
  return headers;
}

export async function errorMessage(response) {
  try {
    const body = await response.json();
    return `${body.error.status}: ${body.error.message}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

export function saveRunArgs(runId, args) {
  sessionStorage.setItem(`${ARGS_KEY}${runId}`, JSON.stringify(args));
}

// The arguments saved for a run, or null when it was not started from this tab.
export function savedRunArgs(runId) {
  const saved = sessionStorage.getItem(`${ARGS_KEY}${runId}`);
  return saved ? JSON.parse(saved) : null;
}
