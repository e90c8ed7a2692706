// The cache panel: what this chat's turns found in the prefix cache (a bar per turn: cached vs
// computed prompt tokens) and the server's KV pool and hit rate (GET /v1/cache/stats, the same
// snapshot /metrics exports).

import { api } from './api.js';

export function turnsOf(messages) {
  const turns = [];
  for (const msg of messages || []) {
    if (msg.role !== 'assistant') continue;
    const stats = msg.stats || {};
    const usage = msg.usage || {};
    const prompt = Number.isFinite(stats.prompt_tokens) ? stats.prompt_tokens : usage.prompt_tokens;
    const details = usage.prompt_tokens_details || {};
    const cached = Number.isFinite(stats.cached_tokens) ? stats.cached_tokens : details.cached_tokens;
    if (Number.isFinite(prompt)) turns.push({ prompt, cached: Number.isFinite(cached) ? cached : 0 });
  }
  return turns;
}

function row(label, value, testid, raw) {
  const div = document.createElement('div');
  div.className = 'cache-row';
  const l = document.createElement('span');
  l.textContent = label;
  const v = document.createElement('strong');
  v.textContent = value;
  v.dataset.testid = testid;
  v.dataset.value = String(raw);
  div.append(l, v);
  return div;
}

export function renderTurnBars(container, messages) {
  const turns = turnsOf(messages);
  const nodes = [];
  const widest = Math.max(1, ...turns.map((t) => t.prompt));
  turns.forEach((t, i) => {
    const item = document.createElement('div');
    item.className = 'cache-turn';
    item.dataset.testid = 'cache-turn';
    item.dataset.cached = String(t.cached);
    item.dataset.prompt = String(t.prompt);
    const label = document.createElement('div');
    label.className = 'cache-turn-label';
    label.textContent = `Turn ${i + 1}: ${t.cached} cached · ${t.prompt - t.cached} computed`;
    const bar = document.createElement('div');
    bar.className = 'cache-bar';
    bar.style.width = `${Math.max(4, (100 * t.prompt) / widest)}%`;
    bar.title = `${t.cached} of ${t.prompt} prompt tokens came from the prefix cache`;
    const hit = document.createElement('span');
    hit.className = 'cache-bar-hit';
    hit.style.width = `${t.prompt ? (100 * t.cached) / t.prompt : 0}%`;
    bar.append(hit);
    item.append(label, bar);
    nodes.push(item);
  });
  if (nodes.length === 0) {
    const p = document.createElement('p');
    p.className = 'cache-empty';
    p.textContent = 'No replies in this chat yet.';
    nodes.push(p);
  }
  container.replaceChildren(...nodes);
}

export async function renderServerStats(container) {
  let s;
  try {
    s = await api('v1/cache/stats');
  } catch (err) {
    const p = document.createElement('p');
    p.className = 'cache-empty';
    p.textContent = `Server cache stats unavailable: ${err.message}`;
    container.replaceChildren(p);
    return null;
  }
  const pct = (x) => `${(100 * x).toFixed(1)}%`;
  const usage = document.createElement('div');
  usage.className = 'cache-bar cache-kv';
  const held = document.createElement('span');
  held.className = 'cache-bar-hit';
  held.style.width = pct(s.kv_cache_usage_perc);
  const cachedPart = document.createElement('span');
  cachedPart.className = 'cache-bar-cached';
  cachedPart.style.width = pct(s.total_blocks ? s.cached_blocks / s.total_blocks : 0);
  usage.append(held, cachedPart);
  container.replaceChildren(
    row('KV blocks in use', pct(s.kv_cache_usage_perc), 'cache-kv-usage', s.kv_cache_usage_perc),
    usage,
    row('Cached (reusable) blocks', `${s.cached_blocks} / ${s.total_blocks}`, 'cache-cached-blocks', s.cached_blocks),
    row('Prefix-cache hit rate', pct(s.prefix_cache_hit_rate), 'cache-hit-rate', s.prefix_cache_hit_rate),
    row('Prompt tokens served from cache', `${s.prefix_cache_hits_tokens} / ${s.prefix_cache_queries_tokens}`,
      'cache-hit-tokens', s.prefix_cache_hits_tokens),
  );
  return s;
}
