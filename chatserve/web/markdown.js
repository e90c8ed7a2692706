// A tiny Markdown subset rendered by building DOM nodes: paragraphs, fenced code blocks, inline
// code, **bold**, headings and flat lists.
//
// NOTE: safety rests on one rule: text only ever reaches the page through createTextNode or
// textContent. No innerHTML, no attributes taken from the text (not even the fence language as
// a class name), no links. Half-written constructs (an unclosed fence while a reply streams)
// render sensibly: the open fence runs to the end of the text.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const BLANK = /^\s*$/;

export function renderMarkdown(text, container) {
  container.replaceChildren(...markdownNodes(text));
}

export function markdownNodes(text) {
  const lines = text.replace(/\r\n?/g, '\n').split('\n');
  const nodes = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (BLANK.test(line)) {
      i += 1;
      continue;
    }
    const fence = line.match(FENCE);
    if (fence) {
      const marker = fence[1];
      const body = [];
      i += 1;
      while (i < lines.length && !isClosingFence(lines[i], marker)) {
        body.push(lines[i]);
        i += 1;
      }
      i += 1; // the closing fence (or past the end while it is still being written)
      nodes.push(codeBlock(body.join('\n'), fence[2]));
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      const level = Math.min(6, heading[1].length + 2); // h3..h6: replies are not documents
      const h = document.createElement(`h${level}`);
      h.append(...inlineNodes(heading[2]));
      nodes.push(h);
      i += 1;
      continue;
    }
    const item = line.match(LIST_ITEM);
    if (item) {
      i = parseList(lines, i, nodes);
      continue;
    }
    const para = [];
    while (i < lines.length && !BLANK.test(lines[i]) && !startsBlock(lines[i])) {
      para.push(lines[i]);
      i += 1;
    }
    const p = document.createElement('p');
    p.append(...inlineNodes(para.join('\n')));
    nodes.push(p);
  }
  return nodes;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || LIST_ITEM.test(line);
}

function isClosingFence(line, marker) {
  const t = line.trim();
  return t.length >= marker.length && t[0] === marker[0] && /^(`+|~+)$/.test(t);
}

function parseList(lines, i, nodes) {
  const ordered = /\d/.test(lines[i].match(LIST_ITEM)[2]);
  const list = document.createElement(ordered ? 'ol' : 'ul');
  if (ordered) {
    const start = parseInt(lines[i].match(LIST_ITEM)[2], 10);
    if (start !== 1) list.start = start;
  }
  let current = null;
  let parts = [];
  const flush = () => {
    if (current) current.append(...inlineNodes(parts.join('\n')));
  };
  while (i < lines.length) {
    const line = lines[i];
    const m = line.match(LIST_ITEM);
    if (m && /\d/.test(m[2]) === ordered) {
      flush();
      current = document.createElement('li');
      list.append(current);
      parts = [m[3]];
    } else if (m || BLANK.test(line) || FENCE.test(line) || HEADING.test(line)) {
      break; // a list of the other kind, or the end of this one
    } else if (/^\s+\S/.test(line)) {
      parts.push(line.trim()); // continuation of the current item
    } else {
      break;
    }
    i += 1;
  }
  flush();
  nodes.push(list);
  return i;
}

function codeBlock(code, lang) {
  const figure = document.createElement('div');
  figure.className = 'code-block';
  const bar = document.createElement('div');
  bar.className = 'code-bar';
  const label = document.createElement('span');
  label.textContent = lang || 'code';
  bar.append(label);
  if (navigator.clipboard && window.isSecureContext) {
    const copy = document.createElement('button');
    copy.type = 'button';
    copy.className = 'code-copy';
    copy.textContent = 'Copy';
    copy.addEventListener('click', () => {
      navigator.clipboard.writeText(code).then(
        () => { copy.textContent = 'Copied'; setTimeout(() => { copy.textContent = 'Copy'; }, 1200); },
        () => { copy.textContent = 'Copy failed'; },
      );
    });
    bar.append(copy);
  }
  const pre = document.createElement('pre');
  const el = document.createElement('code');
  el.textContent = code;
  pre.append(el);
  figure.append(bar, pre);
  return figure;
}

// `code` spans and **bold**; everything else is plain text.
const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*/g;

export function inlineNodes(text) {
  const out = [];
  let last = 0;
  INLINE.lastIndex = 0;
  for (let m = INLINE.exec(text); m !== null; m = INLINE.exec(text)) {
    if (m.index > last) out.push(document.createTextNode(text.slice(last, m.index)));
    if (m[1] !== undefined) {
      const code = document.createElement('code');
      code.textContent = m[2].length > 2 && m[2].startsWith(' ') && m[2].endsWith(' ') ? m[2].slice(1, -1) : m[2];
      out.push(code);
    } else {
      const strong = document.createElement('strong');
      strong.textContent = m[3];
      out.push(strong);
    }
    last = INLINE.lastIndex;
  }
  if (last < text.length) out.push(document.createTextNode(text.slice(last)));
  return out;
}
