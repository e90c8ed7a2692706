// HTTP to the server: JSON calls with OpenAI-shaped errors turned into ApiError, and the streamed
// POST of a session turn (fetch + SSE). All URLs are relative to the page, so the client also
// works when the server sits behind a path prefix.

export class ApiError extends Error {
  constructor(message, status = 0, type = 'error', code = null) {
    super(message);
    this.status = status;
    this.type = type;
    this.code = code;
  }
}

let currentApiKey = () => '';

export function setApiKeySource(fn) {
  currentApiKey = fn;
}

export function apiUrl(path) {
  return new URL(path, document.baseURI).toString();
}

export function authHeaders(extra = {}) {
  const headers = { ...extra };
  const key = currentApiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  return headers;
}

// The session a call concerns, as X-Session-Id: a router in front of several replicas
// (vllm-router's sticky_least_loaded / consistent_hash) keeps a session's calls on one replica by it.
export function sessionHeader(sessionId) {
  return sessionId ? { 'X-Session-Id': sessionId } : {};
}

function sessionIdOf(path) {
  const m = /^v1\/sessions\/([^/?]+)/.exec(path);
  return m ? decodeURIComponent(m[1]) : null;
}

export async function api(path, { method = 'GET', body, sessionId } = {}) {
  let res;
  try {
    res = await fetch(apiUrl(path), {
      method,
      headers: authHeaders({
        ...(body === undefined ? {} : { 'Content-Type': 'application/json' }),
        ...sessionHeader(sessionId ?? sessionIdOf(path)),
      }),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    throw networkError(err);
  }
  if (!res.ok) throw await errorFromResponse(res);
  return res.status === 204 ? null : res.json();
}

export function networkError(err) {
  return new ApiError(`Network error: the server could not be reached (${err.message}).`, 0, 'network_error');
}

// Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}; cope with anything else.
export async function errorFromResponse(res) {
  let message = `HTTP ${res.status}${res.statusText ? ` ${res.statusText}` : ''}`;
  let type = 'http_error';
  let code = null;
  let text = '';
  try {
    text = await res.text();
  } catch {
    // body unreadable: keep the status line
  }
  try {
    const body = JSON.parse(text);
    if (body && body.error && typeof body.error === 'object') {
      message = String(body.error.message || message);
      type = String(body.error.type || type);
      code = body.error.code ?? null;
    } else if (body && typeof body.detail === 'string') {
      message = body.detail;
    }
  } catch {
    if (text.trim()) message = `${message}: ${text.trim().slice(0, 300)}`;
  }
  message = `${message} (HTTP ${res.status})`;
  if (res.status === 401) message += ' Set the API key in Settings.';
  return new ApiError(message, res.status, type, code);
}

export function newRequestId() {
  // crypto.randomUUID needs a secure context; getRandomValues works on plain http too.
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return `web-${Date.now().toString(36)}-${Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('')}`;
}

// Every session the server lists (newest first), a page of 100 at a time, at most `maxPages`.
export async function listAllSessions(maxPages = 10) {
  const all = [];
  let after = null;
  for (let page = 0; page < maxPages; page += 1) {
    const query = after ? `?limit=100&after=${encodeURIComponent(after)}` : '?limit=100';
    const list = await api(`v1/sessions${query}`);
    const data = Array.isArray(list && list.data) ? list.data : [];
    all.push(...data);
    if (!list.has_more || data.length === 0) return { sessions: all, hasMore: false };
    after = data[data.length - 1].id;
  }
  return { sessions: all, hasMore: true };
}
