// Branches of a chat, from the sessions the server lists. A branch is a session made by
// POST /v1/sessions/{id}/fork; its `forked_from` names the source and the page records in its
// metadata `branch_at`: the index of the first message where it differs from the source (an edit
// of the user message of turn t: 2t; a regenerated reply of turn t: 2t + 1).
//
// The alternatives shown as ‹ i/n › on message m of session S: walk from S towards the root while
// the session differs from its source at m or later (it shares message m with it); the session
// reached is the group's base; the group is the base plus every session that branched from it
// at exactly m.

export function branchAt(session) {
  const m = session && session.metadata && session.metadata.branch_at;
  return Number.isInteger(m) && m >= 0 ? m : null;
}

export function parentId(session) {
  const from = session && session.forked_from;
  return from && typeof from.session_id === 'string' ? from.session_id : null;
}

export function rootOf(byId, session) {
  let s = session;
  const seen = new Set();
  while (s && parentId(s) && byId.has(parentId(s)) && !seen.has(s.id)) {
    seen.add(s.id);
    s = byId.get(parentId(s));
  }
  return s;
}

// The session a new branch at message m forks from: S and it share messages [0, m) exactly (each
// session on the way shares at least that much with its source), so a fork of it is the same
// prefix, and the new branch lands in the group of m directly.
export function baseAt(byId, session, m) {
  let s = session;
  const seen = new Set();
  while (s && !seen.has(s.id)) {
    seen.add(s.id);
    const at = branchAt(s);
    const parent = byId.get(parentId(s));
    if (!parent || at === null || at < m) return s;
    s = parent;
  }
  return s;
}

// {members: [session ids, oldest first], index: position of the one S shows} at message m.
export function alternativesAt(byId, children, session, m) {
  const base = baseAt(byId, session, m);
  const members = [base.id, ...(children.get(base.id) || []).filter((c) => branchAt(byId.get(c)) === m)];
  members.sort();
  // Which member S shows: the one on S's chain at m.
  let s = session;
  let index = -1;
  const seen = new Set();
  while (s && !seen.has(s.id)) {
    seen.add(s.id);
    index = members.indexOf(s.id);
    if (index !== -1) break;
    s = byId.get(parentId(s));
  }
  return { members, index };
}

export function childrenMap(sessions) {
  const children = new Map();
  for (const s of sessions) {
    const p = parentId(s);
    if (!p) continue;
    if (!children.has(p)) children.set(p, []);
    children.get(p).push(s.id);
  }
  return children;
}

// Every session of the tree `rootId` heads (itself included).
export function treeOf(children, rootId) {
  const out = [];
  const stack = [rootId];
  const seen = new Set();
  while (stack.length) {
    const id = stack.pop();
    if (seen.has(id)) continue;
    seen.add(id);
    out.push(id);
    stack.push(...(children.get(id) || []));
  }
  return out;
}
