// chatserve web client: chats with branches (edit, regenerate), streaming replies over fetch + SSE,
// Stop, per-reply stats kept by the server, per-chat sampling settings and a view of the cache.
//
// No build step; the Markdown renderer and highlighter are vendored (vendor/, with their licences),
// so the page works offline. NOTE: model and user text reach the DOM only as text (textContent /
// createTextNode; replies through markdown.js, which builds elements from a whitelist); never
// through innerHTML.

import { ApiError, api, apiUrl, authHeaders, errorFromResponse, listAllSessions, networkError, newRequestId, sessionHeader, setApiKeySource } from './api.js';
import { alternativesAt, baseAt, branchAt, childrenMap, parentId, rootOf, treeOf } from './branches.js';
import { renderServerStats, renderTurnBars } from './cache_panel.js';
import { copyButton } from './copy.js';
import { StreamingMarkdown, renderMarkdown } from './markdown.js';
import { SSEParser } from './sse.js';

const SETTINGS_KEY = 'chatserve.settings.v1';
const LAST_BRANCH_KEY = 'chatserve.lastBranch.v1';
const STOP_GRACE_MS = 5000; // after a cancel, drop the connection if the stream has not ended by then
const PAGE_SIZE = 50; // chats shown in the sidebar before "Show more"
// The sampling fields a session's defaults accept (POST/PATCH /v1/sessions), as the settings panel shows them.
const SAMPLING_FIELDS = [
  { key: 'temperature', label: 'Temperature', min: 0, max: 2, step: 0.05 },
  { key: 'top_p', label: 'Top p', min: 0, max: 1, step: 0.05, exclusiveMin: true },
  { key: 'top_k', label: 'Top k', min: 0, step: 1, integer: true },
  { key: 'min_p', label: 'Min p', min: 0, max: 1, step: 0.01 },
  { key: 'max_tokens', label: 'Max tokens', min: 1, step: 1, integer: true },
  { key: 'presence_penalty', label: 'Presence penalty', min: -2, max: 2, step: 0.1 },
  { key: 'frequency_penalty', label: 'Frequency penalty', min: -2, max: 2, step: 0.1 },
  { key: 'repetition_penalty', label: 'Repetition penalty', min: 0, max: 10, step: 0.05, exclusiveMin: true },
  { key: 'seed', label: 'Seed', step: 1, integer: true },
];
const EMPTY_SAMPLING = Object.fromEntries([...SAMPLING_FIELDS.map((f) => [f.key, '']), ['stop', '']]);
const DEFAULT_SETTINGS = { systemPrompt: '', apiKey: '', theme: 'system', sampling: { ...EMPTY_SAMPLING } };
const SHORTCUTS = [
  ['Ctrl/⌘ + Shift + O', 'New chat'],
  ['/ or Shift + Esc', 'Focus the message box'],
  ['Esc', 'Stop the reply'],
  ['Alt + R', 'Regenerate the last reply'],
  ['Alt + K', 'Show or hide the cache panel'],
  ['Alt + T', 'Switch theme (system, light, dark)'],
  ['?', 'This help'],
];

const $ = (selector) => document.querySelector(selector);

const els = {
  app: $('#app'),
  sidebar: $('#sidebar'),
  scrim: $('#scrim'),
  sidebarOpen: $('#sidebar-open'),
  sidebarClose: $('#sidebar-close'),
  sessionList: $('#session-list'),
  search: $('[data-testid="session-search"]'),
  more: $('[data-testid="sessions-more"]'),
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
  settingsScope: $('#settings-scope'),
  settingsCancel: $('#settings-cancel'),
  settingsError: $('#settings-error'),
  samplingFields: $('#sampling-fields'),
  setSystemPrompt: $('#set-system-prompt'),
  setStop: $('#set-stop'),
  setApiKey: $('#set-api-key'),
  cacheButton: $('[data-testid="cache-button"]'),
  cachePanel: $('#cache-panel'),
  cacheTurns: $('#cache-turns'),
  cacheServer: $('#cache-server'),
  cacheClose: $('#cache-close'),
  themeButton: $('[data-testid="theme-toggle"]'),
  helpButton: $('[data-testid="help-button"]'),
  help: $('#help'),
  helpList: $('#help-list'),
  helpClose: $('#help-close'),
};

const state = {
  settings: loadSettings(),
  sessions: [], // every session the server listed, newest first (branches included)
  byId: new Map(),
  children: new Map(),
  hasMore: false,
  shown: PAGE_SIZE,
  current: null, // the open session as last read (with messages); null for a new chat
  currentId: null,
  viewToken: 0, // bumped on every navigation, so late answers for an old view are dropped
  creating: false, // the first message of a new chat is creating its session
  streams: new Map(), // session id -> the turn streaming in it
  listItems: new Map(), // session id -> its sidebar <li>, reused while it shows the same
  cacheTimer: 0,
};
setApiKeySource(() => state.settings.apiKey);

// ---------------------------------------------------------------------------------------------
// Settings: the system prompt and sampling defaults for new chats and the API key live in
// localStorage; an open chat's sampling settings are its session defaults on the server.

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || '{}') || {};
  } catch {
    saved = {};
  }
  const sampling = { ...EMPTY_SAMPLING, ...(saved.sampling && typeof saved.sampling === 'object' ? saved.sampling : {}) };
  // The first version of the page kept these two at the top level.
  if (saved.temperature !== undefined && sampling.temperature === '') sampling.temperature = String(saved.temperature);
  if (saved.maxTokens !== undefined && sampling.max_tokens === '') sampling.max_tokens = String(saved.maxTokens);
  return {
    ...DEFAULT_SETTINGS,
    systemPrompt: typeof saved.systemPrompt === 'string' ? saved.systemPrompt : '',
    apiKey: typeof saved.apiKey === 'string' ? saved.apiKey : '',
    theme: ['light', 'dark'].includes(saved.theme) ? saved.theme : 'system',
    sampling,
  };
}

function saveSettings(settings) {
  state.settings = settings;
  const stored = { ...settings, temperature: settings.sampling.temperature, maxTokens: settings.sampling.max_tokens };
  try {
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(stored));
  } catch {
    showNotice('Settings could not be saved in this browser (localStorage unavailable); they last until reload.');
  }
}

// Form strings -> a session's `defaults` object (empty fields are left to the server).
function defaultsFrom(sampling) {
  const out = {};
  for (const f of SAMPLING_FIELDS) {
    const raw = String(sampling[f.key] ?? '').trim();
    if (raw !== '') out[f.key] = Number(raw);
  }
  const stops = String(sampling.stop || '').split('\n').map((s) => s.replace(/\\n/g, '\n')).filter((s) => s !== '');
  if (stops.length) out.stop = stops;
  return out;
}

function samplingFrom(defaults) {
  const out = { ...EMPTY_SAMPLING };
  for (const f of SAMPLING_FIELDS) if (defaults && defaults[f.key] !== undefined) out[f.key] = String(defaults[f.key]);
  const stop = defaults && defaults.stop;
  if (stop) out.stop = (Array.isArray(stop) ? stop : [stop]).map((s) => s.replace(/\n/g, '\\n')).join('\n');
  return out;
}

function buildSamplingFields() {
  const nodes = SAMPLING_FIELDS.map((f) => {
    const label = document.createElement('label');
    label.className = 'field';
    const span = document.createElement('span');
    span.className = 'field-label';
    span.textContent = f.label;
    const input = document.createElement('input');
    input.type = 'number';
    input.id = `set-${f.key.replace(/_/g, '-')}`;
    input.dataset.testid = `settings-${f.key.replace(/_/g, '-')}`;
    input.dataset.key = f.key;
    if (f.min !== undefined) input.min = String(f.min);
    if (f.max !== undefined) input.max = String(f.max);
    input.step = String(f.step);
    input.inputMode = f.integer ? 'numeric' : 'decimal';
    input.placeholder = 'server default';
    label.append(span, input);
    return label;
  });
  els.samplingFields.replaceChildren(...nodes);
}

function samplingInputs() {
  return [...els.samplingFields.querySelectorAll('input[data-key]')];
}

function openSettings() {
  const s = state.settings;
  const chat = state.current;
  const sampling = chat ? samplingFrom(chat.defaults) : s.sampling;
  els.settingsScope.textContent = chat
    ? `Sampling for this chat (${chatTitle(chat)}); saved with the chat on the server.`
    : 'Sampling for new chats; saved in this browser.';
  els.setSystemPrompt.value = s.systemPrompt;
  for (const input of samplingInputs()) input.value = sampling[input.dataset.key] ?? '';
  els.setStop.value = sampling.stop || '';
  els.setApiKey.value = s.apiKey;
  els.settingsError.hidden = true;
  els.settings.showModal();
}

function checkSampling(sampling) {
  for (const f of SAMPLING_FIELDS) {
    const raw = String(sampling[f.key] ?? '').trim();
    if (raw === '') continue;
    const x = Number(raw);
    const range = [f.min !== undefined ? `${f.exclusiveMin ? 'above' : 'from'} ${f.min}` : '', f.max !== undefined ? `to ${f.max}` : '']
      .filter(Boolean).join(' ');
    const bad = !Number.isFinite(x) || (f.integer && !Number.isInteger(x))
      || (f.min !== undefined && (f.exclusiveMin ? x <= f.min : x < f.min)) || (f.max !== undefined && x > f.max);
    if (bad) return `${f.label} must be ${f.integer ? 'a whole number' : 'a number'}${range ? ` ${range}` : ''} (or empty for the server default).`;
  }
  return '';
}

async function submitSettings(event) {
  event.preventDefault();
  const sampling = { ...EMPTY_SAMPLING, stop: els.setStop.value };
  for (const input of samplingInputs()) sampling[input.dataset.key] = input.value.trim();
  const problem = checkSampling(sampling);
  if (problem) {
    els.settingsError.textContent = problem;
    els.settingsError.hidden = false;
    return;
  }
  const keyChanged = els.setApiKey.value.trim() !== state.settings.apiKey;
  const chat = state.current;
  saveSettings({
    ...state.settings,
    systemPrompt: els.setSystemPrompt.value,
    apiKey: els.setApiKey.value.trim(),
    sampling: chat ? state.settings.sampling : sampling,
  });
  if (chat) {
    try {
      const updated = await api(`v1/sessions/${encodeURIComponent(chat.id)}`, { method: 'PATCH', body: { defaults: defaultsFrom(sampling) } });
      chat.defaults = updated.defaults;
      rememberSession(updated);
    } catch (err) {
      els.settingsError.textContent = `The chat's settings were not saved: ${err.message}`;
      els.settingsError.hidden = false;
      return;
    }
  }
  els.settings.close();
  if (keyChanged) {
    hideNotice();
    loadModels();
    refreshSessions();
  }
}

// ---------------------------------------------------------------------------------------------
// Theme: follows the system unless set to light or dark here.

function applyTheme() {
  const theme = state.settings.theme;
  if (theme === 'system') delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
  els.themeButton.dataset.theme = theme;
  const next = { system: 'light', light: 'dark', dark: 'system' }[theme];
  els.themeButton.title = `Theme: ${theme} (click for ${next}; Alt+T)`;
  els.themeButton.setAttribute('aria-label', els.themeButton.title);
}

function cycleTheme() {
  const next = { system: 'light', light: 'dark', dark: 'system' }[state.settings.theme] || 'system';
  saveSettings({ ...state.settings, theme: next });
  applyTheme();
}

// ---------------------------------------------------------------------------------------------
// Server status and the sessions sidebar (root chats; their branches open through ‹ i/n ›)

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

function indexSessions() {
  state.byId = new Map(state.sessions.map((s) => [s.id, s]));
  state.children = childrenMap(state.sessions);
}

function rememberSession(session) {
  const { messages, ...meta } = session;
  state.sessions = [meta, ...state.sessions.filter((s) => s.id !== session.id)];
  state.sessions.sort((a, b) => (a.id < b.id ? 1 : -1));
  indexSessions();
  renderSessionList();
}

async function refreshSessions() {
  try {
    const { sessions, hasMore } = await listAllSessions();
    state.sessions = sessions;
    state.hasMore = hasMore;
    indexSessions();
    renderSessionList();
    if (state.current) renderBranchNavs();
  } catch (err) {
    if (err.status !== 401) showNotice(`Could not load chats: ${err.message}`);
  }
}

function chatTitle(session) {
  const title = session && (session.title || (session.metadata && session.metadata.title));
  return typeof title === 'string' && title.trim() ? title.trim() : 'Untitled chat';
}

function rootSessions() {
  return state.sessions.filter((s) => !parentId(s) || !state.byId.has(parentId(s)));
}

function matchesSearch(root, query) {
  if (!query) return true;
  const q = query.toLowerCase();
  return treeOf(state.children, root.id).some((id) => chatTitle(state.byId.get(id)).toLowerCase().includes(q));
}

function renderSessionList() {
  const query = els.search.value.trim();
  const roots = rootSessions().filter((s) => matchesSearch(s, query));
  const currentRoot = state.current ? rootOf(state.byId, state.byId.get(state.currentId) || state.current) : null;
  const items = roots.slice(0, state.shown).map((session) => {
    // An item that shows the same as before is kept (not rebuilt), so focus and references to it survive.
    const li = sessionItem(session);
    const old = state.listItems.get(session.id);
    const item = old && old.dataset.signature === li.dataset.signature ? old : li;
    if (currentRoot && currentRoot.id === session.id) item.setAttribute('aria-current', 'page');
    else item.removeAttribute('aria-current');
    return item;
  });
  state.listItems = new Map(items.map((li) => [li.dataset.sessionId, li]));
  if (items.length === 0) {
    const li = document.createElement('li');
    li.className = 'session-empty';
    li.textContent = query ? 'No chat matches' : 'No chats yet';
    items.push(li);
  }
  els.sessionList.replaceChildren(...items);
  els.more.hidden = !(roots.length > state.shown || state.hasMore);
}

function sessionItem(session) {
  const li = document.createElement('li');
  li.className = 'session-item';
  li.dataset.testid = 'session-item';
  li.dataset.sessionId = session.id;

  const open = document.createElement('button');
  open.type = 'button';
  open.className = 'session-open';
  const title = document.createElement('span');
  title.className = 'session-title';
  title.textContent = chatTitle(session);
  const meta = document.createElement('span');
  meta.className = 'session-meta';
  const turns = Number(session.num_turns) || 0;
  const branches = treeOf(state.children, session.id).length - 1;
  const when = new Date((session.updated_at || session.created_at) * 1000);
  meta.textContent = [
    relativeTime(session.updated_at || session.created_at),
    `${turns} ${turns === 1 ? 'turn' : 'turns'}`,
    branches ? `${branches} ${branches === 1 ? 'branch' : 'branches'}` : '',
  ].filter(Boolean).join(' · ');
  open.title = `${chatTitle(session)}\n${when.toLocaleString()}`;
  open.append(title, meta);

  const rename = iconButton('session-rename', 'rename-session', 'Rename chat', 'M4 20h4L19 9l-4-4L4 16v4zM14 6l4 4');
  const del = iconButton('session-delete', 'delete-session', 'Delete chat', 'M5 7h14M10 7V5h4v2M7 7l1 12h8l1-12');
  li.append(open, rename, del);
  li.dataset.signature = `${title.textContent}\n${meta.textContent}`;
  return li;
}

function iconButton(className, testid, label, path) {
  const b = document.createElement('button');
  b.type = 'button';
  b.className = className;
  b.dataset.testid = testid;
  b.setAttribute('aria-label', label);
  b.title = label;
  b.append(svgIcon(path));
  return b;
}

function onSessionListClick(event) {
  const li = event.target.closest('.session-item');
  if (!li || event.target.closest('.rename-input')) return;
  const id = li.dataset.sessionId;
  if (event.target.closest('.session-delete')) deleteChat(id, event.target.closest('.session-delete'));
  else if (event.target.closest('.session-rename')) startRename(li, id);
  else navigateTo(lastBranchOf(id));
}

function lastBranchOf(rootId) {
  try {
    const map = JSON.parse(localStorage.getItem(LAST_BRANCH_KEY) || '{}');
    const id = map[rootId];
    return id && state.byId.has(id) ? id : rootId;
  } catch {
    return rootId;
  }
}

function rememberBranch(id) {
  const session = state.byId.get(id);
  if (!session) return;
  const root = rootOf(state.byId, session);
  try {
    const map = JSON.parse(localStorage.getItem(LAST_BRANCH_KEY) || '{}');
    map[root.id] = id;
    localStorage.setItem(LAST_BRANCH_KEY, JSON.stringify(map));
  } catch {
    // not remembered: the chat opens on its first branch
  }
}

function startRename(li, id) {
  const session = state.byId.get(id);
  const open = li.querySelector('.session-open');
  const input = document.createElement('input');
  input.className = 'rename-input';
  input.dataset.testid = 'rename-input';
  input.value = chatTitle(session);
  input.maxLength = 200;
  input.setAttribute('aria-label', 'New name of the chat');
  open.replaceWith(input);
  input.focus();
  input.select();
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    state.listItems.delete(id); // the item now holds the input: rebuild it
    const title = input.value.trim();
    if (save && title && title !== chatTitle(session)) await renameChat(id, title);
    else renderSessionList();
  };
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter') { e.preventDefault(); finish(true); }
    if (e.key === 'Escape') { e.preventDefault(); e.stopPropagation(); finish(false); }
  });
  input.addEventListener('blur', () => finish(true));
}

// A rename names the whole chat: every branch of the tree gets the title.
async function renameChat(id, title) {
  const root = rootOf(state.byId, state.byId.get(id));
  for (const sid of treeOf(state.children, root.id)) {
    try {
      const updated = await api(`v1/sessions/${encodeURIComponent(sid)}`, { method: 'PATCH', body: { title } });
      state.byId.set(sid, updated);
      state.sessions = state.sessions.map((s) => (s.id === sid ? updated : s));
      if (state.current && state.current.id === sid) state.current.title = updated.title;
    } catch (err) {
      if (err.status !== 404) showNotice(`Could not rename the chat: ${err.message}`);
    }
  }
  indexSessions();
  renderSessionList();
  if (state.current) setTitle(chatTitle(state.current));
}

// Two clicks delete: the first arms the button for a few seconds. A chat goes with all its branches.
async function deleteChat(id, button) {
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
  const ids = treeOf(state.children, id);
  for (const sid of ids) {
    const turn = state.streams.get(sid);
    if (turn) await stopTurn(turn);
    try {
      await api(`v1/sessions/${encodeURIComponent(sid)}`, { method: 'DELETE' });
    } catch (err) {
      if (err.status !== 404) {
        showNotice(`Could not delete the chat: ${err.message}`);
        return;
      }
    }
  }
  state.sessions = state.sessions.filter((s) => !ids.includes(s.id));
  indexSessions();
  renderSessionList();
  if (ids.includes(state.currentId)) navigateTo(null);
}

// ---------------------------------------------------------------------------------------------
// Navigation: the open session lives in the URL hash (#session=<id>), so reload and Back work.

function hashSessionId() {
  const m = location.hash.match(/^#session=(.+)$/);
  return m ? decodeURIComponent(m[1]) : null;
}

function navigateTo(id, { replace = false } = {}) {
  const hash = id ? `#session=${encodeURIComponent(id)}` : '';
  if (location.hash !== hash) {
    const url = hash || `${location.pathname}${location.search}`;
    if (replace) history.replaceState(null, '', url);
    else history.pushState(null, '', url);
  }
  const shown = showView(id);
  closeSidebar();
  return shown;
}

function showView(id) {
  if (id) return openSession(id);
  newChat();
  return Promise.resolve();
}

function setTitle(text) {
  els.title.textContent = text;
  els.title.title = text;
}

function newChat() {
  state.viewToken += 1;
  state.currentId = null;
  state.current = null;
  setTitle('New chat');
  els.messages.replaceChildren();
  els.empty.hidden = false;
  renderSessionList();
  updateComposer();
  refreshCachePanel();
  els.input.focus();
}

async function openSession(id, { keepLive = true } = {}) {
  const token = ++state.viewToken;
  state.currentId = id;
  const known = state.byId.get(id);
  setTitle(known ? chatTitle(known) : 'Loading…');
  els.empty.hidden = true;
  els.messages.replaceChildren(loadingRow());
  updateComposer();

  let session;
  try {
    session = await api(`v1/sessions/${encodeURIComponent(id)}`);
  } catch (err) {
    if (token !== state.viewToken) return;
    state.current = null;
    els.messages.replaceChildren(errorRow(err.status === 404 ? 'This chat no longer exists (deleted or expired).' : err.message));
    if (err.status === 404) {
      state.sessions = state.sessions.filter((s) => s.id !== id);
      indexSessions();
      renderSessionList();
    }
    return;
  }
  if (token !== state.viewToken) return;
  state.current = session;
  if (!state.byId.has(id)) rememberSession(session);
  rememberBranch(id);
  renderConversation(session, keepLive ? state.streams.get(id) : null);
  renderSessionList();
  updateComposer();
  refreshCachePanel();
  scrollToBottom(true);
}

function renderConversation(session, live) {
  setTitle(chatTitle(session));
  const nodes = [];
  if (session.system_prompt) nodes.push(systemNote(session.system_prompt));
  let history = [...(session.messages || [])];
  if (live) history = history.slice(0, live.firstIndex); // the live turn is shown from its own views
  history.forEach((msg, index) => {
    if (msg.role === 'user') nodes.push(userMessage(msg.content || '', index));
    else if (msg.role === 'assistant') nodes.push(historyReply(msg, index));
    else if (msg.role === 'tool') nodes.push(toolResult(msg, index));
  });
  if (live) {
    if (live.userEl) nodes.push(live.userEl);
    nodes.push(live.view.el);
  }
  els.messages.replaceChildren(...nodes);
  renderBranchNavs();
  markLastReply();
}

// ---------------------------------------------------------------------------------------------
// Messages

function messageActions(el) {
  let bar = el.querySelector(':scope > .msg-actions');
  if (!bar) {
    bar = document.createElement('div');
    bar.className = 'msg-actions';
    el.append(bar);
  }
  return bar;
}

function actionButton(text, testid, onClick, title = text) {
  const b = document.createElement('button');
  b.type = 'button';
  b.className = 'msg-action';
  b.dataset.testid = testid;
  b.textContent = text;
  b.title = title;
  b.addEventListener('click', onClick);
  return b;
}

function userMessage(text, index) {
  const el = document.createElement('article');
  el.className = 'msg user';
  el.dataset.testid = 'user-message';
  el.dataset.index = String(index);
  const body = document.createElement('div');
  body.className = 'msg-body';
  body.textContent = text;
  el.append(body);
  const bar = messageActions(el);
  bar.append(
    copyButton(() => text, { className: 'msg-action', testid: 'copy-message' }),
    actionButton('Edit', 'edit-button', () => startEdit(el, text)),
  );
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

function historyReply(msg, index) {
  const view = new ReplyView(index);
  view.text = msg.content || '';
  view.reasoning = typeof msg.reasoning === 'string' ? msg.reasoning : '';
  view.toolCalls = Array.isArray(msg.tool_calls) ? msg.tool_calls : [];
  view.finish({ finishReason: msg.finish_reason, usage: msg.usage, stats: msg.stats });
  return view.el;
}

// A tool's result (role "tool"), folded: the call it answers and its content as text.
function toolResult(msg, index) {
  const el = document.createElement('details');
  el.className = 'tool-block tool-result';
  el.dataset.testid = 'tool-result';
  el.dataset.index = String(index);
  const summary = document.createElement('summary');
  summary.textContent = `Tool result${msg.name ? `: ${msg.name}` : ''}${msg.tool_call_id ? ` (${msg.tool_call_id})` : ''}`;
  const pre = document.createElement('pre');
  pre.textContent = typeof msg.content === 'string' ? msg.content : JSON.stringify(msg.content, null, 2);
  el.append(summary, pre);
  return el;
}

function toolCallBlock(call) {
  const fn = (call && call.function) || {};
  const el = document.createElement('details');
  el.className = 'tool-block tool-call';
  el.dataset.testid = 'tool-call';
  const summary = document.createElement('summary');
  summary.textContent = `Tool call: ${fn.name || '(unnamed)'}${call.id ? ` (${call.id})` : ''}`;
  const pre = document.createElement('pre');
  let args = fn.arguments || '';
  try {
    args = JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    // still streaming, or not JSON: as sent
  }
  pre.textContent = args;
  el.append(summary, pre);
  return el;
}

// A reasoning model's thinking, above the answer: a collapsible block, open while it streams (so it
// is seen as it comes) and folded once the reply is done or when it comes from the stored session.
// Plain text, never Markdown: it is the model's scratch work, shown as written.
class ReasoningView {
  constructor() {
    this.el = document.createElement('details');
    this.el.className = 'reasoning-block';
    this.el.dataset.testid = 'reasoning';
    this.el.hidden = true;
    this.summary = document.createElement('summary');
    this.summary.textContent = 'Thinking…';
    this.body = document.createElement('div');
    this.body.className = 'reasoning-body';
    this.body.dataset.testid = 'reasoning-text';
    this.el.append(this.summary, this.body);
    this.touched = false; // the user opened or folded it: leave it as they set it
    this.summary.addEventListener('click', () => { this.touched = true; });
  }

  set(text, { streaming }) {
    this.el.hidden = !text;
    if (this.body.textContent !== text) this.body.textContent = text;
    this.summary.textContent = streaming ? 'Thinking…' : 'Thought';
    if (!this.touched) this.el.open = streaming;
  }
}

// One assistant reply: its reasoning (folded, above), its text (safe Markdown, rendered once per
// frame while it streams), tool calls folded, a status badge, a stats line and its actions (copy,
// regenerate).
class ReplyView {
  constructor(index) {
    this.text = '';
    this.reasoning = '';
    this.thinking = new ReasoningView();
    this.toolCalls = [];
    this.el = document.createElement('article');
    this.el.className = 'msg assistant';
    this.el.dataset.testid = 'assistant-message';
    this.el.dataset.index = String(index);
    this.body = document.createElement('div');
    this.body.className = 'msg-body';
    this.tools = document.createElement('div');
    this.tools.className = 'msg-tools';
    this.foot = document.createElement('div');
    this.foot.className = 'msg-foot';
    this.foot.hidden = true;
    this.el.append(this.thinking.el, this.body, this.tools, this.foot);
    this.stream = new StreamingMarkdown(this.body, { onFrame: () => afterFrame(this) });
  }

  waiting() {
    this.el.classList.add('streaming');
    this.body.replaceChildren(typingDots());
  }

  update() {
    this.thinking.set(this.reasoning, { streaming: !this.text && !this.toolCalls.length });
    if (this.reasoning && !this.text) return; // still thinking: the dots stay until the answer begins
    this.stream.set(this.text);
    if (this.toolCalls.length) this.tools.replaceChildren(...this.toolCalls.map(toolCallBlock));
  }

  // finishReason: "stop" | "length" | "abort" | "tool_calls" | null; error: an Error shown under the text.
  finish({ finishReason = null, usage = null, timing = null, stats = null, error = null }) {
    this.el.classList.remove('streaming');
    this.thinking.set(this.reasoning, { streaming: false });
    this.stream.text = this.text;
    this.stream.finish();
    this.tools.replaceChildren(...this.toolCalls.map(toolCallBlock));
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
    this.statsEl = null;
    const text = error && !this.text ? '' : statsText(stats, usage, timing);
    if (text) {
      const span = document.createElement('span');
      span.className = 'reply-stats';
      span.dataset.testid = 'reply-stats';
      span.textContent = text;
      span.title = 'TTFT: time to first token. tok/s: decode speed after the first token. '
        + 'Cached: prompt tokens served from the prefix cache instead of being recomputed.';
      parts.push(span);
      this.statsEl = span;
    }
    if (!this.text && !error && !this.toolCalls.length) {
      if (finishReason === 'abort') this.body.replaceChildren(emptyNote('(stopped before any text)'));
      else if (this.reasoning) this.body.replaceChildren(emptyNote('(no answer after the reasoning)'));
    }
    this.foot.replaceChildren(...parts);
    this.foot.hidden = parts.length === 0;
    if (!error) {
      const bar = messageActions(this.el);
      bar.replaceChildren(copyButton(() => this.text, { className: 'msg-action', testid: 'copy-message' }));
    }
  }

  // The server's own numbers for this reply, once it has stored the turn.
  showStoredStats(msg) {
    const text = statsText(msg.stats, msg.usage, null);
    if (text && this.statsEl) this.statsEl.textContent = text;
  }
}

function afterFrame(view) {
  if (view.el.isConnected && isNearBottom(160)) scrollToBottom(true);
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

function formatMs(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : `${(ms / 1000).toFixed(2)} s`;
}

// The stats line: the server's stored `stats` when there are some (they survive a reload), else
// what the page measured while the reply streamed.
function statsText(stats, usage, timing) {
  const parts = [];
  const s = stats || {};
  const ttftMs = Number.isFinite(s.ttft_s) ? s.ttft_s * 1000 : timing && timing.ttftMs;
  if (Number.isFinite(ttftMs)) parts.push(`TTFT ${formatMs(ttftMs)}`);
  const completion = Number.isFinite(s.completion_tokens) ? s.completion_tokens
    : usage && Number.isFinite(usage.completion_tokens) ? usage.completion_tokens : timing && timing.deltas;
  if (Number.isFinite(s.decode_tokens_per_s)) parts.push(`${s.decode_tokens_per_s.toFixed(1)} tok/s`);
  else if (timing && timing.decodeMs > 0 && completion > 1) parts.push(`${((completion - 1) / (timing.decodeMs / 1000)).toFixed(1)} tok/s`);
  if (Number.isFinite(completion)) parts.push(`${completion} ${completion === 1 ? 'token' : 'tokens'}`);
  const prompt = Number.isFinite(s.prompt_tokens) ? s.prompt_tokens : usage && usage.prompt_tokens;
  if (Number.isFinite(prompt)) {
    const details = (usage && usage.prompt_tokens_details) || {};
    const cached = Number.isFinite(s.cached_tokens) ? s.cached_tokens : Number.isFinite(details.cached_tokens) ? details.cached_tokens : 0;
    parts.push(`cached ${cached}/${prompt} prompt`);
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

// A chat's name from its first message: the first line, cut at a word with an ellipsis.
function titleFrom(text) {
  const line = text.trim().split('\n')[0].replace(/\s+/g, ' ');
  if (line.length <= 60) return line;
  const cut = line.slice(0, 59);
  const space = cut.lastIndexOf(' ');
  return `${(space > 30 ? cut.slice(0, space) : cut).trimEnd()}…`;
}

// ---------------------------------------------------------------------------------------------
// Branches: ‹ i/n › on the messages where alternatives exist; edit and regenerate make new ones.

function renderBranchNavs() {
  const session = state.current;
  if (!session) return;
  const me = state.byId.get(session.id) || session;
  for (const el of els.messages.querySelectorAll('.msg[data-index]')) {
    el.querySelector(':scope > .msg-actions .branch-nav')?.remove();
    const m = Number(el.dataset.index);
    const { members, index } = alternativesAt(state.byId, state.children, me, m);
    if (members.length < 2 || index < 0) continue;
    const nav = document.createElement('span');
    nav.className = 'branch-nav';
    nav.dataset.testid = 'branch-nav';
    const prev = actionButton('‹', 'branch-prev', () => navigateTo(members[index - 1]), 'Previous version');
    const next = actionButton('›', 'branch-next', () => navigateTo(members[index + 1]), 'Next version');
    prev.disabled = index === 0;
    next.disabled = index === members.length - 1;
    const pos = document.createElement('span');
    pos.className = 'branch-pos';
    pos.dataset.testid = 'branch-pos';
    pos.textContent = `${index + 1}/${members.length}`;
    nav.append(prev, pos, next);
    messageActions(el).prepend(nav);
  }
}

// Regenerate shows only on the last reply of a chat that is not streaming.
function markLastReply() {
  for (const b of els.messages.querySelectorAll('[data-testid="regenerate-button"]')) b.remove();
  if (!state.current || state.streams.has(state.currentId)) return;
  const replies = els.messages.querySelectorAll('.msg.assistant[data-index]');
  const last = replies[replies.length - 1];
  if (!last || Number(last.dataset.index) !== (state.current.messages || []).length - 1) return;
  messageActions(last).append(actionButton('Regenerate', 'regenerate-button', () => regenerate(), 'Regenerate (Alt+R)'));
}

function startEdit(el, text) {
  if (isBusy()) return;
  const body = el.querySelector('.msg-body');
  const area = document.createElement('textarea');
  area.className = 'edit-input';
  area.dataset.testid = 'edit-input';
  area.value = text;
  area.rows = Math.min(10, text.split('\n').length + 1);
  const save = actionButton('Send', 'edit-save', () => submitEdit(el, area.value));
  const cancel = actionButton('Cancel', 'edit-cancel', () => {
    area.replaceWith(body);
    bar.remove();
  });
  const bar = document.createElement('div');
  bar.className = 'edit-bar';
  bar.append(cancel, save);
  body.replaceWith(area);
  area.after(bar);
  area.addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) { e.preventDefault(); submitEdit(el, area.value); }
    if (e.key === 'Escape') { e.preventDefault(); e.stopPropagation(); cancel.click(); }
  });
  area.focus();
}

// A new branch at message m: a fork of the session that shares messages [0, m) with this one.
async function forkAt(m, keepTurns) {
  const me = state.byId.get(state.current.id) || state.current;
  const base = baseAt(state.byId, me, m);
  const metadata = { ...(base.metadata || {}), branch_at: m };
  const fork = await api(`v1/sessions/${encodeURIComponent(base.id)}/fork`, { method: 'POST', body: { keep_turns: keepTurns, metadata } });
  rememberSession(fork);
  return fork;
}

async function submitEdit(el, text) {
  if (!text.trim() || isBusy() || !state.current) return;
  const m = Number(el.dataset.index);
  let fork;
  try {
    fork = await forkAt(m, Math.floor(m / 2));
  } catch (err) {
    showNotice(`Could not edit the message: ${err.message}`);
    return;
  }
  await navigateTo(fork.id);
  startTurn({ sessionId: fork.id, text, kind: 'message' });
}

async function regenerate() {
  const session = state.current;
  if (!session || isBusy() || !(session.messages || []).length) return;
  const m = session.messages.length - 1;
  if (session.messages[m].role !== 'assistant') return;
  let fork;
  try {
    fork = await forkAt(m, session.num_turns);
  } catch (err) {
    showNotice(`Could not regenerate: ${err.message}`);
    return;
  }
  await navigateTo(fork.id);
  startTurn({ sessionId: fork.id, text: null, kind: 'regenerate' });
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
  els.input.value = '';
  autoresize();

  let sessionId = state.currentId;
  if (sessionId === null) {
    els.empty.hidden = true;
    const userEl = userMessage(text, 0);
    const view = new ReplyView(1);
    view.waiting();
    els.messages.append(userEl, view.el);
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
    startTurn({ sessionId, text, kind: 'message', userEl, view });
    return;
  }
  startTurn({ sessionId, text, kind: 'message' });
}

// The turn's views go at the end of the conversation: for a message the user's text and a reply;
// for a regenerate the last reply is replaced by the new one.
function startTurn({ sessionId, text, kind, userEl = null, view = null }) {
  const session = state.current && state.current.id === sessionId ? state.current : null;
  const count = session ? (session.messages || []).length : 0;
  const firstIndex = kind === 'regenerate' ? count - 1 : count;
  if (!view) {
    if (kind === 'message') {
      userEl = userMessage(text, firstIndex);
      els.messages.append(userEl);
    } else {
      els.messages.querySelector(`.msg[data-index="${firstIndex}"]`)?.remove();
    }
    view = new ReplyView(kind === 'message' ? firstIndex + 1 : firstIndex);
    view.waiting();
    els.messages.append(view.el);
    els.empty.hidden = true;
  }
  scrollToBottom(true);
  const turn = {
    sessionId, text, kind, firstIndex,
    requestId: newRequestId(),
    controller: new AbortController(),
    userEl, view,
    stopping: false,
    stopTimer: null,
  };
  state.streams.set(sessionId, turn);
  markLastReply();
  updateComposer();
  return runTurn(turn);
}

async function createSession(text, token) {
  const body = { metadata: { title: titleFrom(text) } };
  const systemPrompt = state.settings.systemPrompt.trim();
  if (systemPrompt) body.system_prompt = systemPrompt;
  const defaults = defaultsFrom(state.settings.sampling);
  if (Object.keys(defaults).length) body.defaults = defaults;
  const session = await api('v1/sessions', { method: 'POST', body });
  rememberSession(session);
  if (token === state.viewToken) {
    // Still looking at this new chat: it becomes the open session.
    state.currentId = session.id;
    state.current = { ...session, messages: [] };
    history.replaceState(null, '', `#session=${encodeURIComponent(session.id)}`);
    setTitle(chatTitle(session));
    if (systemPrompt) els.messages.prepend(systemNote(systemPrompt));
    renderSessionList();
  }
  return session.id;
}

async function runTurn(turn) {
  const timing = { start: performance.now(), first: null, last: null, deltas: 0 };
  let finishReason = null;
  let usage = null;
  let error = null;
  let done = false;
  const calls = [];

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
      const delta = choice.delta || {};
      // a reasoning model's thinking (vLLM's `reasoning`, or the older `reasoning_content`)
      const reasoning = typeof delta.reasoning === 'string' ? delta.reasoning : delta.reasoning_content;
      if (typeof reasoning === 'string' && reasoning.length > 0) {
        const now = performance.now();
        if (timing.first === null) timing.first = now;
        timing.last = now;
        timing.deltas += 1;
        turn.view.reasoning += reasoning;
      }
      const content = delta.content;
      if (typeof content === 'string' && content.length > 0) {
        const now = performance.now();
        if (timing.first === null) timing.first = now;
        timing.last = now;
        timing.deltas += 1;
        turn.view.text += content;
      }
      for (const tc of Array.isArray(delta.tool_calls) ? delta.tool_calls : []) {
        const i = Number.isInteger(tc.index) ? tc.index : calls.length;
        const call = calls[i] || (calls[i] = { id: '', type: 'function', function: { name: '', arguments: '' } });
        if (tc.id) call.id = tc.id;
        if (tc.function && tc.function.name) call.function.name += tc.function.name;
        if (tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
        turn.view.toolCalls = calls.filter(Boolean);
      }
      if (choice.finish_reason) finishReason = choice.finish_reason;
    }
    if (chunk && chunk.usage) usage = chunk.usage;
  };

  try {
    const path = turn.kind === 'regenerate' ? 'regenerate' : 'messages';
    const body = turn.kind === 'regenerate' ? { stream: true } : { content: turn.text, stream: true };
    let res;
    try {
      res = await fetch(apiUrl(`v1/sessions/${encodeURIComponent(turn.sessionId)}/${path}`), {
        method: 'POST',
        headers: authHeaders({
          'Content-Type': 'application/json',
          Accept: 'text/event-stream',
          'X-Request-Id': turn.requestId,
          ...sessionHeader(turn.sessionId),
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
      turn.view.update(); // drawn at the next animation frame, however many reads arrive before it
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
    await afterTurn(turn);
  }
}

// The server stored the turn: read the session again (its messages, their stored stats) without
// redrawing what is on screen, so indexes, branch navigation and the cache panel follow.
async function afterTurn(turn) {
  try {
    const session = await api(`v1/sessions/${encodeURIComponent(turn.sessionId)}`);
    rememberSession(session);
    if (state.currentId === turn.sessionId) {
      state.current = session;
      const stored = (session.messages || [])[Number(turn.view.el.dataset.index)];
      if (stored && stored.role === 'assistant') turn.view.showStoredStats(stored);
      renderBranchNavs();
      markLastReply();
      refreshCachePanel();
    }
  } catch {
    // the session is gone or the server is unreachable: what is shown stays
  }
  refreshSessions();
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
    turn.cancelInfo = await api(`v1/requests/${encodeURIComponent(turn.requestId)}/cancel`,
      { method: 'POST', sessionId: turn.sessionId });
  } catch {
    turn.controller.abort();
  }
}

// ---------------------------------------------------------------------------------------------
// The cache panel

function toggleCachePanel(show = els.cachePanel.hidden) {
  els.cachePanel.hidden = !show;
  els.cacheButton.setAttribute('aria-expanded', String(show));
  els.app.classList.toggle('cache-open', show);
  clearInterval(state.cacheTimer);
  if (show) {
    refreshCachePanel();
    state.cacheTimer = setInterval(() => renderServerStats(els.cacheServer), 5000);
  }
}

function refreshCachePanel() {
  if (els.cachePanel.hidden) return Promise.resolve();
  renderTurnBars(els.cacheTurns, state.current ? state.current.messages : []);
  return renderServerStats(els.cacheServer);
}

// ---------------------------------------------------------------------------------------------
// Keyboard shortcuts and the help popover

function buildHelp() {
  const rows = SHORTCUTS.map(([keys, what]) => {
    const dt = document.createElement('dt');
    for (const [i, k] of keys.split(' + ').entries()) {
      if (i) dt.append(' + ');
      const kbd = document.createElement('kbd');
      kbd.textContent = k;
      dt.append(kbd);
    }
    const dd = document.createElement('dd');
    dd.textContent = what;
    return [dt, dd];
  });
  els.helpList.replaceChildren(...rows.flat());
}

function isTyping(target) {
  return target && (target.isContentEditable || ['INPUT', 'TEXTAREA', 'SELECT'].includes(target.tagName));
}

function onShortcut(event) {
  const mod = event.ctrlKey || event.metaKey;
  const key = event.key.toLowerCase();
  const dialogOpen = els.settings.open || els.help.open;
  if (mod && event.shiftKey && key === 'o') {
    event.preventDefault();
    navigateTo(null);
  } else if (event.altKey && !mod && event.code === 'KeyR') {
    event.preventDefault();
    regenerate();
  } else if (event.altKey && !mod && event.code === 'KeyK') {
    event.preventDefault();
    toggleCachePanel();
  } else if (event.altKey && !mod && event.code === 'KeyT') {
    event.preventDefault();
    cycleTheme();
  } else if (event.key === 'Escape' && event.shiftKey) {
    event.preventDefault();
    els.input.focus();
  } else if (event.key === 'Escape' && !dialogOpen && state.streams.has(state.currentId)) {
    stopTurn(state.streams.get(state.currentId));
  } else if (!isTyping(event.target) && !mod && !event.altKey && !dialogOpen) {
    if (event.key === '/') {
      event.preventDefault();
      els.input.focus();
    } else if (event.key === '?') {
      event.preventDefault();
      els.help.showModal();
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Layout helpers

function isNearBottom(slack = 80) {
  const c = els.conversation;
  return c.scrollHeight - c.scrollTop - c.clientHeight < slack;
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
document.addEventListener('keydown', onShortcut);
els.newChat.addEventListener('click', () => navigateTo(null));
els.sessionList.addEventListener('click', onSessionListClick);
els.search.addEventListener('input', () => { state.shown = PAGE_SIZE; renderSessionList(); });
els.more.addEventListener('click', async () => {
  state.shown += PAGE_SIZE;
  if (state.hasMore && rootSessions().length < state.shown) await refreshSessions();
  renderSessionList();
});
els.title.addEventListener('dblclick', () => {
  const li = state.current && els.sessionList.querySelector('.session-item[aria-current="page"]');
  if (li) startRename(li, li.dataset.sessionId);
});
els.settingsButton.addEventListener('click', openSettings);
els.settingsForm.addEventListener('submit', submitSettings);
els.settingsCancel.addEventListener('click', () => els.settings.close());
els.cacheButton.addEventListener('click', () => toggleCachePanel());
els.cacheClose.addEventListener('click', () => toggleCachePanel(false));
els.themeButton.addEventListener('click', cycleTheme);
els.helpButton.addEventListener('click', () => els.help.showModal());
els.helpClose.addEventListener('click', () => els.help.close());
els.noticeClose.addEventListener('click', hideNotice);
els.sidebarOpen.addEventListener('click', openSidebar);
els.sidebarClose.addEventListener('click', closeSidebar);
els.scrim.addEventListener('click', closeSidebar);
window.addEventListener('popstate', () => {
  const id = hashSessionId();
  if (id !== state.currentId) showView(id);
});

buildSamplingFields();
buildHelp();
applyTheme();
loadModels();
refreshSessions();
showView(hashSessionId());
document.documentElement.dataset.ready = '1';

// For tests and the curious: the page's renderer and branch logic, reachable from the console.
window.chatserve = { renderMarkdown, state, branchAt };
