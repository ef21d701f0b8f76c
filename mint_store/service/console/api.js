// The public JSON API, with the token from this tab's session storage (never in a URL).

const KEY = "mint.token";
// relative to the console (/ui/), so it also works behind a proxy that mounts the service under a prefix
const BASE = new URL("../", document.baseURI);

export const session = {
  get token() { return sessionStorage.getItem(KEY); },
  set(token) { sessionStorage.setItem(KEY, token); },
  clear() { sessionStorage.removeItem(KEY); },
};

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export const enc = encodeURIComponent;

/** fetch a path of the API ("v1/tenants"); JSON in and out; errors as ApiError. */
export async function api(path, { method = "GET", body, signal, raw = false } = {}) {
  const headers = { Accept: "application/json" };
  const token = session.token;
  if (token) headers.Authorization = `Bearer ${token}`;
  let payload;
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    payload = JSON.stringify(body);
  }
  const resp = await fetch(new URL(path, BASE), { method, headers, body: payload, signal, cache: "no-store",
                                                  credentials: "omit", referrerPolicy: "no-referrer" });
  if (!resp.ok) {
    let err = {};
    try { err = await resp.json(); } catch { /* not JSON: keep the status */ }
    throw new ApiError(resp.status, err.error || `http_${resp.status}`, err.message || resp.statusText);
  }
  return raw ? resp : resp.json();
}
