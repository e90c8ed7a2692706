// chatserve web client: a session sidebar, streaming replies over fetch + SSE, Stop, per-reply stats.
//
// No build step and no dependencies. All URLs are relative to the page, so it also works when the
// server sits behind a path prefix. NOTE: model and user text reach the DOM only as text
// (textContent / createTextNode, via markdown.js for replies); never through innerHTML.

import { SSEParser } from './sse.js';
import { renderMarkdown } from './markdown.js';

const SETTINGS_KEY = 'chatserve.settings.v1';
const DEFAULT_SETTINGS = { systemPrompt: '', temperature: '', maxTokens: '', apiKey: '' };
const STOP_GRACE_MS = 5000; // after a cancel, drop the connection if the stream has not ended by then

const $ = (selector) => document.querySelector(selector);

const els = {
  app: $('#app'),
  sidebar: $('#sidebar'),
  scrim: $('#scrim'),
  sidebarOpen: $('#sidebar-open'),
  sidebarClose: $('#sidebar-close'),
  sessionList: $('#session-list'),
  newChat: $('[data-testid="new-chat"]'),
  status: $('#server-status'),
  statusText: $('#status-text'),
  title: $('#chat-title'),
  model: $('#model-name'),
  notice: $('#notice'),
  noticeText: $('#notice-text'),
  noticeClose: $('#notice-close'),
  conversation: $('#conversation'),
  empty: $('#empty-state'),
  messages: $('#messages'),
  form: $('#composer'),
  input: $('[data-testid="message-input"]'),
  send: $('[data-testid="send-button"]'),
  stop: $('[data-testid="stop-button"]'),
  settingsButton: $('#settings-button'),
  settings: $('#settings'),
  settingsForm: $('#settings-form'),
  settingsCancel: $('#settings-cancel'),
  settingsError: $('#settings-error'),
  setSystemPrompt: $('#set-system-prompt'),
  setTemperature: $('#set-temperature'),
  setMaxTokens: $('#set-max-tokens'),
  setApiKey: $('#set-api-key'),
};

const state = {
  settings: loadSettings(),
  sessions: [], // as last listed by the server, newest first
  currentId: null, // the open session; null while a new chat has no session yet
  viewToken: 0, // bumped on every navigation, so late answers for an old view are dropped
  creating: false, // the first message of a new chat is creating its session
  streams: new Map(), // session id -> the turn streaming in it
};

// ---------------------------------------------------------------------------------------------
// Settings

function loadSettings() {
  try {
    const saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || '{}');
    return { ...DEFAULT_SETTINGS, ...(saved && typeof saved === 'object' ? saved : {}) };
  } catch {
    return { ...DEFAULT_SETTINGS };
  }
}

function saveSettings(settings) {
  state.settings = settings;
  try {
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
  } catch {
    showNotice('Settings could not be saved in this browser (localStorage unavailable); they last until reload.');
  }
}

function openSettings() {
  const s = state.settings;
  els.setSystemPrompt.value = s.systemPrompt;
  els.setTemperature.value = s.temperature;
  els.setMaxTokens.value = s.maxTokens;
  els.setApiKey.value = s.apiKey;
  els.settingsError.hidden = true;
  els.settings.showModal();
}

function submitSettings(event) {
  event.preventDefault();
  const temperature = els.setTemperature.value.trim();
  const maxTokens = els.setMaxTokens.value.trim();
  let problem = '';
  if (temperature !== '' && !(Number(temperature) >= 0 && Number(temperature) <= 2)) {
    problem = 'Temperature must be a number from 0 to 2 (or empty for the server default).';
  } else if (maxTokens !== '' && !(Number.isInteger(Number(maxTokens)) && Number(maxTokens) >= 1)) {
    problem = 'Max tokens must be a whole number of at least 1 (or empty for the server default).';
  }
  if (problem) {
    els.settingsError.textContent = problem;
    els.settingsError.hidden = false;
    return;
  }
  const keyChanged = els.setApiKey.value.trim() !== state.settings.apiKey;
  saveSettings({
    systemPrompt: els.setSystemPrompt.value,
    temperature,
    maxTokens,
    apiKey: els.setApiKey.value.trim(),
  });
  els.settings.close();
  if (keyChanged) {
    hideNotice();
    loadModels();
    refreshSessions();
  }
}

// ---------------------------------------------------------------------------------------------
// HTTP

class ApiError extends Error {
  constructor(message, status = 0, type = 'error', code = null) {
    super(message);
    this.status = status;
    this.type = type;
    this.code = code;
  }
}

function apiUrl(path) {
  return new URL(path, document.baseURI).toString();
}

function authHeaders(extra = {}) {
  const headers = { ...extra };
  if (state.settings.apiKey) headers.Authorization = `Bearer ${state.settings.apiKey}`;
  return headers;
}

async function api(path, { method = 'GET', body } = {}) {
  let res;
  try {
    res = await fetch(apiUrl(path), {
      method,
      headers: authHeaders(body === undefined ? {} : { 'Content-Type': 'application/json' }),
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    throw networkError(err);
  }
  if (!res.ok) throw await errorFromResponse(res);
  return res.status === 204 ? null : res.json();
}

function networkError(err) {
  return new ApiError(`Network error: the server could not be reached (${err.message}).`, 0, 'network_error');
}

// Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}; cope with anything else.
async function errorFromResponse(res) {
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

function newRequestId() {
  // crypto.randomUUID needs a secure context; getRandomValues works on plain http too.
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return `web-${Date.now().toString(36)}-${Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('')}`;
}

// ---------------------------------------------------------------------------------------------
// Server status and sessions sidebar

async function loadModels() {
  try {
    const models = await api('v1/models');
    const name = models && models.data && models.data[0] ? String(models.data[0].id) : '';
    els.model.textContent = name;
    els.model.title = name;
    setStatus('ok', name ? 'Connected' : 'Connected (no model listed)');
  } catch (err) {
    if (err.status === 401) {
      setStatus('warn', 'API key needed');
      showNotice('This server requires an API key. Open Settings (bottom left) and enter it.');
    } else {
      setStatus('error', 'Server unreachable');
      showNotice(err.message);
    }
  }
}

function setStatus(kind, text) {
  els.status.dataset.state = kind;
  els.statusText.textContent = text;
}

async function refreshSessions() {
  try {
    const list = await api('v1/sessions?limit=50');
    state.sessions = Array.isArray(list && list.data) ? list.data : [];
    renderSessionList();
  } catch (err) {
    if (err.status !== 401) showNotice(`Could not load chats: ${err.message}`);
  }
}

function sessionTitle(session) {
  const title = session && session.metadata && session.metadata.title;
  return typeof title === 'string' && title.trim() ? title.trim() : 'Untitled chat';
}

function renderSessionList() {
  const items = state.sessions.map((session) => {
    const li = document.createElement('li');
    li.className = 'session-item';
    li.dataset.testid = 'session-item';
    li.dataset.sessionId = session.id;
    if (session.id === state.currentId) li.setAttribute('aria-current', 'page');

    const open = document.createElement('button');
    open.type = 'button';
    open.className = 'session-open';
    const title = document.createElement('span');
    title.className = 'session-title';
    title.textContent = sessionTitle(session);
    const meta = document.createElement('span');
    meta.className = 'session-meta';
    const turns = Number(session.num_turns) || 0;
    meta.textContent = `${relativeTime(session.updated_at || session.created_at)} · ${turns} ${turns === 1 ? 'turn' : 'turns'}`;
    open.title = sessionTitle(session);
    open.append(title, meta);

    const del = document.createElement('button');
    del.type = 'button';
    del.className = 'session-delete';
    del.dataset.testid = 'delete-session';
    del.setAttribute('aria-label', 'Delete chat');
    del.title = 'Delete chat';
    del.append(svgIcon('M5 7h14M10 7V5h4v2M7 7l1 12h8l1-12'));

    li.append(open, del);
    return li;
  });
  if (items.length === 0) {
    const li = document.createElement('li');
    li.className = 'session-empty';
    li.textContent = 'No chats yet';
    items.push(li);
  }
  els.sessionList.replaceChildren(...items);
}

function markCurrentInList() {
  for (const li of els.sessionList.querySelectorAll('.session-item')) {
    if (li.dataset.sessionId === state.currentId) li.setAttribute('aria-current', 'page');
    else li.removeAttribute('aria-current');
  }
}

function onSessionListClick(event) {
  const li = event.target.closest('.session-item');
  if (!li) return;
  const del = event.target.closest('.session-delete');
  if (del) {
    deleteSession(li.dataset.sessionId, del);
  } else {
    navigateTo(li.dataset.sessionId);
  }
}

// Two clicks delete: the first arms the button for a few seconds.
async function deleteSession(id, button) {
  if (button.dataset.armed !== '1') {
    button.dataset.armed = '1';
    button.title = 'Click again to delete';
    button.setAttribute('aria-label', 'Click again to delete this chat');
    setTimeout(() => {
      button.dataset.armed = '';
      button.title = 'Delete chat';
      button.setAttribute('aria-label', 'Delete chat');
    }, 3000);
    return;
  }
  const turn = state.streams.get(id);
  if (turn) await stopTurn(turn);
  try {
    await api(`v1/sessions/${encodeURIComponent(id)}`, { method: 'DELETE' });
  } catch (err) {
    if (err.status !== 404) {
      showNotice(`Could not delete the chat: ${err.message}`);
      return;
    }
  }
  state.sessions = state.sessions.filter((s) => s.id !== id);
  renderSessionList();
  if (state.currentId === id) navigateTo(null);
}

// ---------------------------------------------------------------------------------------------
// Navigation: the open session lives in the URL hash (#session=<id>), so reload and Back work.

function hashSessionId() {
  const m = location.hash.match(/^#session=(.+)$/);
  return m ? decodeURIComponent(m[1]) : null;
}

function navigateTo(id) {
  const hash = id ? `#session=${encodeURIComponent(id)}` : '';
  if (location.hash !== hash) {
    history.pushState(null, '', hash || `${location.pathname}${location.search}`);
  }
  showView(id);
  closeSidebar();
}

function showView(id) {
  if (id) openSession(id);
  else newChat();
}

function newChat() {
  state.viewToken += 1;
  state.currentId = null;
  els.title.textContent = 'New chat';
  els.messages.replaceChildren();
  els.empty.hidden = false;
  markCurrentInList();
  updateComposer();
  els.input.focus();
}

async function openSession(id) {
  const token = ++state.viewToken;
  state.currentId = id;
  const known = state.sessions.find((s) => s.id === id);
  els.title.textContent = known ? sessionTitle(known) : 'Loading…';
  els.empty.hidden = true;
  els.messages.replaceChildren(loadingRow());
  markCurrentInList();
  updateComposer();

  let session;
  try {
    session = await api(`v1/sessions/${encodeURIComponent(id)}`);
  } catch (err) {
    if (token !== state.viewToken) return;
    els.messages.replaceChildren(errorRow(err.status === 404 ? 'This chat no longer exists (deleted or expired).' : err.message));
    if (err.status === 404) {
      state.sessions = state.sessions.filter((s) => s.id !== id);
      renderSessionList();
    }
    return;
  }
  if (token !== state.viewToken) return;

  els.title.textContent = sessionTitle(session);
  const nodes = [];
  if (session.system_prompt) nodes.push(systemNote(session.system_prompt));
  const live = state.streams.get(id);
  const history = [...(session.messages || [])];
  const tail = history[history.length - 1];
  if (live && tail && tail.role === 'user' && tail.content === live.text) history.pop(); // shown live below
  for (const msg of history) {
    if (msg.role === 'user') nodes.push(userMessage(msg.content || ''));
    else if (msg.role === 'assistant') nodes.push(historyReply(msg));
  }
  if (live) nodes.push(live.userEl, live.view.el); // a reply still streaming in this chat
  els.messages.replaceChildren(...nodes);
  updateComposer();
  scrollToBottom(true);
}

// ---------------------------------------------------------------------------------------------
// Messages

function userMessage(text) {
  const el = document.createElement('article');
  el.className = 'msg user';
  el.dataset.testid = 'user-message';
  const body = document.createElement('div');
  body.className = 'msg-body';
  body.textContent = text;
  el.append(body);
  return el;
}

function systemNote(text) {
  const el = document.createElement('details');
  el.className = 'system-note';
  const summary = document.createElement('summary');
  summary.textContent = 'System prompt';
  const body = document.createElement('div');
  body.className = 'system-body';
  body.textContent = text;
  el.append(summary, body);
  return el;
}

function loadingRow() {
  const el = document.createElement('div');
  el.className = 'loading-row';
  el.append(typingDots());
  return el;
}

function errorRow(message) {
  const el = document.createElement('div');
  el.className = 'msg-error';
  el.setAttribute('role', 'alert');
  el.textContent = message;
  return el;
}

function typingDots() {
  const el = document.createElement('span');
  el.className = 'typing';
  el.setAttribute('aria-label', 'Waiting for the reply');
  for (let i = 0; i < 3; i += 1) el.append(document.createElement('i'));
  return el;
}

function historyReply(msg) {
  const view = new ReplyView();
  view.text = msg.content || '';
  view.render();
  view.finish({ finishReason: msg.finish_reason, usage: msg.usage });
  return view.el;
}

// One assistant reply: its text (rendered as safe Markdown), a status badge and a stats line.
class ReplyView {
  constructor() {
    this.text = '';
    this.el = document.createElement('article');
    this.el.className = 'msg assistant';
    this.el.dataset.testid = 'assistant-message';
    this.body = document.createElement('div');
    this.body.className = 'msg-body';
    this.foot = document.createElement('div');
    this.foot.className = 'msg-foot';
    this.foot.hidden = true;
    this.el.append(this.body, this.foot);
    this.renderedLength = -1;
  }

  waiting() {
    this.el.classList.add('streaming');
    this.body.replaceChildren(typingDots());
  }

  render() {
    if (this.text.length === this.renderedLength) return;
    this.renderedLength = this.text.length;
    renderMarkdown(this.text, this.body);
  }

  // finishReason: "stop" | "length" | "abort" | null; error: an Error shown under the text.
  finish({ finishReason = null, usage = null, timing = null, error = null }) {
    this.el.classList.remove('streaming');
    this.renderedLength = -1;
    this.render();
    if (finishReason) this.el.dataset.finishReason = finishReason;
    const parts = [];
    if (finishReason === 'abort') {
      this.el.classList.add('stopped');
      parts.push(badge('Stopped', 'stopped'));
    } else if (finishReason === 'length') {
      parts.push(badge('Max tokens reached', 'length'));
    }
    if (error) {
      this.el.classList.add('failed');
      if (!this.text) this.body.replaceChildren();
      this.el.insertBefore(errorRow(error.message), this.foot);
    }
    const stats = error && !this.text ? '' : statsText(usage, timing);
    if (stats) {
      const span = document.createElement('span');
      span.className = 'reply-stats';
      span.dataset.testid = 'reply-stats';
      span.textContent = stats;
      span.title = 'TTFT: time to first token. tok/s: decode speed after the first token. '
        + 'Cached: prompt tokens served from the prefix cache instead of being recomputed.';
      parts.push(span);
    }
    if (!this.text && !error && finishReason === 'abort') {
      this.body.replaceChildren(emptyNote('(stopped before any text)'));
    }
    this.foot.replaceChildren(...parts);
    this.foot.hidden = parts.length === 0;
  }
}

function badge(text, kind) {
  const el = document.createElement('span');
  el.className = `badge badge-${kind}`;
  el.textContent = text;
  return el;
}

function emptyNote(text) {
  const el = document.createElement('p');
  el.className = 'empty-note';
  el.textContent = text;
  return el;
}

function statsText(usage, timing) {
  const parts = [];
  if (timing && timing.ttftMs != null) {
    parts.push(timing.ttftMs < 1000 ? `TTFT ${Math.round(timing.ttftMs)} ms` : `TTFT ${(timing.ttftMs / 1000).toFixed(2)} s`);
  }
  const completion = usage && Number.isFinite(usage.completion_tokens) ? usage.completion_tokens : timing && timing.deltas;
  if (timing && timing.decodeMs > 0 && completion > 1) {
    parts.push(`${((completion - 1) / (timing.decodeMs / 1000)).toFixed(1)} tok/s`);
  }
  if (Number.isFinite(completion)) parts.push(`${completion} ${completion === 1 ? 'token' : 'tokens'}`);
  if (usage && Number.isFinite(usage.prompt_tokens)) {
    const details = usage.prompt_tokens_details || {};
    const cached = Number.isFinite(details.cached_tokens) ? details.cached_tokens : 0;
    parts.push(`cached ${cached}/${usage.prompt_tokens} prompt`);
  }
  return parts.join(' · ');
}

function svgIcon(path) {
  const ns = 'http://www.w3.org/2000/svg';
  const svg = document.createElementNS(ns, 'svg');
  svg.setAttribute('viewBox', '0 0 24 24');
  svg.setAttribute('aria-hidden', 'true');
  const p = document.createElementNS(ns, 'path');
  p.setAttribute('d', path);
  svg.append(p);
  return svg;
}

function relativeTime(value) {
  let ms;
  if (typeof value === 'number') ms = value < 1e12 ? value * 1000 : value;
  else if (typeof value === 'string') ms = Date.parse(value);
  if (!Number.isFinite(ms)) return '';
  const seconds = Math.round((ms - Date.now()) / 1000);
  const abs = Math.abs(seconds);
  const fmt = new Intl.RelativeTimeFormat(undefined, { numeric: 'auto' });
  if (abs < 45) return 'just now';
  if (abs < 3600) return fmt.format(Math.round(seconds / 60), 'minute');
  if (abs < 86400) return fmt.format(Math.round(seconds / 3600), 'hour');
  if (abs < 86400 * 7) return fmt.format(Math.round(seconds / 86400), 'day');
  return new Date(ms).toLocaleDateString();
}

function titleFrom(text) {
  const words = text.trim().split(/\s+/).slice(0, 8).join(' ');
  return words.length > 60 ? `${words.slice(0, 59)}…` : words;
}

// ---------------------------------------------------------------------------------------------
// Sending and streaming a turn

function isBusy() {
  return state.creating || (state.currentId !== null && state.streams.has(state.currentId));
}

function updateComposer() {
  const busy = isBusy();
  els.input.disabled = busy;
  els.send.hidden = busy;
  els.send.disabled = busy || els.input.value.trim() === '';
  els.stop.hidden = !busy;
  const turn = state.streams.get(state.currentId);
  els.stop.disabled = Boolean(turn && turn.stopping) || state.creating;
  els.app.classList.toggle('busy', busy);
}

async function sendMessage() {
  const text = els.input.value;
  if (!text.trim() || isBusy()) return;
  const token = state.viewToken;

  els.empty.hidden = true;
  const userEl = userMessage(text);
  const view = new ReplyView();
  view.waiting();
  els.messages.append(userEl, view.el);
  els.input.value = '';
  autoresize();
  scrollToBottom(true);

  let sessionId = state.currentId;
  if (sessionId === null) {
    state.creating = true;
    updateComposer();
    try {
      sessionId = await createSession(text, token);
    } catch (err) {
      view.finish({ error: err });
      if (token === state.viewToken && !els.input.value) els.input.value = text; // let the user retry
      return;
    } finally {
      state.creating = false;
      updateComposer();
    }
  }

  const turn = {
    sessionId,
    text,
    requestId: newRequestId(),
    controller: new AbortController(),
    userEl,
    view,
    stopping: false,
    stopTimer: null,
  };
  state.streams.set(sessionId, turn);
  updateComposer();
  await runTurn(turn);
}

async function createSession(text, token) {
  const body = { metadata: { title: titleFrom(text) } };
  const systemPrompt = state.settings.systemPrompt.trim();
  if (systemPrompt) body.system_prompt = systemPrompt;
  const session = await api('v1/sessions', { method: 'POST', body });
  state.sessions = [session, ...state.sessions.filter((s) => s.id !== session.id)];
  if (token === state.viewToken) {
    // Still looking at this new chat: it becomes the open session.
    state.currentId = session.id;
    history.replaceState(null, '', `#session=${encodeURIComponent(session.id)}`);
    els.title.textContent = sessionTitle(session);
    if (systemPrompt) els.messages.prepend(systemNote(systemPrompt));
  }
  renderSessionList();
  return session.id;
}

async function runTurn(turn) {
  const timing = { start: performance.now(), first: null, last: null, deltas: 0 };
  let finishReason = null;
  let usage = null;
  let error = null;
  let done = false;

  const onEvent = (event) => {
    if (event.data === '[DONE]') {
      done = true;
      return;
    }
    let chunk;
    try {
      chunk = JSON.parse(event.data);
    } catch {
      return; // not JSON: nothing we understand
    }
    if (chunk && chunk.error) {
      const e = chunk.error;
      throw new ApiError(String(e.message || 'The server reported an error.'), 0, String(e.type || 'error'), e.code ?? null);
    }
    for (const choice of (chunk && chunk.choices) || []) {
      const content = choice.delta && choice.delta.content;
      if (typeof content === 'string' && content.length > 0) {
        const now = performance.now();
        if (timing.first === null) timing.first = now;
        timing.last = now;
        timing.deltas += 1;
        turn.view.text += content;
      }
      if (choice.finish_reason) finishReason = choice.finish_reason;
    }
    if (chunk && chunk.usage) usage = chunk.usage;
  };

  try {
    const body = { content: turn.text, stream: true };
    const { temperature, maxTokens } = state.settings;
    if (temperature !== '') body.temperature = Number(temperature);
    if (maxTokens !== '') body.max_tokens = Number(maxTokens);
    let res;
    try {
      res = await fetch(apiUrl(`v1/sessions/${encodeURIComponent(turn.sessionId)}/messages`), {
        method: 'POST',
        headers: authHeaders({
          'Content-Type': 'application/json',
          Accept: 'text/event-stream',
          'X-Request-Id': turn.requestId,
        }),
        body: JSON.stringify(body),
        signal: turn.controller.signal,
      });
    } catch (err) {
      throw err.name === 'AbortError' ? err : networkError(err);
    }
    if (!res.ok) throw await errorFromResponse(res);
    if (!res.body) throw new ApiError('The browser gave no readable response body.');

    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    const parser = new SSEParser(onEvent);
    while (!done) {
      let chunk;
      try {
        chunk = await reader.read();
      } catch (err) {
        throw err.name === 'AbortError' ? err : new ApiError(`The connection broke while the reply streamed (${err.message}).`, 0, 'network_error');
      }
      if (chunk.done) {
        parser.push(decoder.decode());
        parser.end();
        break;
      }
      parser.push(decoder.decode(chunk.value, { stream: true }));
      renderLive(turn);
    }
    if (done) reader.cancel().catch(() => {});
    if (!finishReason && !turn.stopping) {
      throw new ApiError('The stream ended before the reply finished.', 0, 'incomplete_stream');
    }
  } catch (err) {
    if (err.name === 'AbortError') finishReason = 'abort'; // we dropped the connection after Stop
    else error = err;
  } finally {
    clearTimeout(turn.stopTimer);
    if (turn.stopping && !finishReason) finishReason = 'abort';
    if (turn.stopping && !usage && turn.cancelInfo && Number.isFinite(turn.cancelInfo.completion_tokens)) {
      usage = { completion_tokens: turn.cancelInfo.completion_tokens };
    }
    const end = timing.last ?? performance.now();
    turn.view.finish({
      finishReason,
      usage,
      error,
      timing: {
        ttftMs: timing.first === null ? null : timing.first - timing.start,
        decodeMs: timing.first === null ? 0 : end - timing.first,
        deltas: timing.deltas,
      },
    });
    state.streams.delete(turn.sessionId);
    updateComposer();
    if (turn.sessionId === state.currentId) {
      scrollToBottom(false);
      els.input.focus();
    }
    refreshSessions();
  }
}

function renderLive(turn) {
  const stick = isNearBottom();
  turn.view.render();
  if (stick) scrollToBottom(true);
}

// Stop: ask the server to cancel the request the page named; the stream then ends with
// finish_reason "abort". If the server does not know the request (or never ends the stream),
// drop the connection, which aborts it server-side as well.
async function stopTurn(turn) {
  if (!turn || turn.stopping) return;
  turn.stopping = true;
  updateComposer();
  turn.stopTimer = setTimeout(() => turn.controller.abort(), STOP_GRACE_MS);
  try {
    turn.cancelInfo = await api(`v1/requests/${encodeURIComponent(turn.requestId)}/cancel`, { method: 'POST' });
  } catch {
    turn.controller.abort();
  }
}

// ---------------------------------------------------------------------------------------------
// Layout helpers

function isNearBottom() {
  const c = els.conversation;
  return c.scrollHeight - c.scrollTop - c.clientHeight < 80;
}

function scrollToBottom(force) {
  if (force || isNearBottom()) els.conversation.scrollTop = els.conversation.scrollHeight;
}

function autoresize() {
  const input = els.input;
  input.style.height = 'auto';
  input.style.height = `${Math.min(input.scrollHeight, 220)}px`;
  updateComposer();
}

function showNotice(message) {
  els.noticeText.textContent = message;
  els.notice.hidden = false;
}

function hideNotice() {
  els.notice.hidden = true;
}

function openSidebar() {
  els.app.classList.add('sidebar-open');
  els.scrim.hidden = false;
}

function closeSidebar() {
  els.app.classList.remove('sidebar-open');
  els.scrim.hidden = true;
}

// ---------------------------------------------------------------------------------------------
// Wiring

els.form.addEventListener('submit', (event) => {
  event.preventDefault();
  sendMessage();
});
els.input.addEventListener('keydown', (event) => {
  if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    sendMessage();
  }
});
els.input.addEventListener('input', autoresize);
els.stop.addEventListener('click', () => stopTurn(state.streams.get(state.currentId)));
document.addEventListener('keydown', (event) => {
  if (event.key === 'Escape' && !els.settings.open && state.streams.has(state.currentId)) {
    stopTurn(state.streams.get(state.currentId));
  }
});
els.newChat.addEventListener('click', () => navigateTo(null));
els.sessionList.addEventListener('click', onSessionListClick);
els.settingsButton.addEventListener('click', openSettings);
els.settingsForm.addEventListener('submit', submitSettings);
els.settingsCancel.addEventListener('click', () => els.settings.close());
els.noticeClose.addEventListener('click', hideNotice);
els.sidebarOpen.addEventListener('click', openSidebar);
els.sidebarClose.addEventListener('click', closeSidebar);
els.scrim.addEventListener('click', closeSidebar);
window.addEventListener('popstate', () => {
  const id = hashSessionId();
  if (id !== state.currentId) showView(id);
});

loadModels();
refreshSessions().then(() => markCurrentInList());
showView(hashSessionId());
document.documentElement.dataset.ready = '1';
