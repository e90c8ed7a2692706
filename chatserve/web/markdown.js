// Markdown to DOM with the vendored markdown-it: its token stream is walked and DOM nodes are built
// from a whitelist of tags; its HTML output is never used.
//
// NOTE: safety rests on three rules. markdown-it runs with html: false, so raw HTML in model text
// is text. Elements are created only for the tags in BLOCK_TAGS / INLINE_TAGS, with no attribute
// copied from the text except a link's href (http and https only; anything else stays text), an
// ordered list's numeric start and a table cell's alignment (from a fixed set). Text reaches the
// page only through createTextNode; highlighted code through code_highlight.js's rebuild.

import markdownit from './vendor/markdown-it/markdown-it.esm.min.mjs';
import { highlightedNodes, knownLanguage } from './code_highlight.js';
import { copyButton } from './copy.js';

const md = markdownit({ html: false, linkify: true, typographer: false, breaks: false });
md.validateLink = (url) => /^https?:\/\//i.test(url.trim());

const CONTAINER_TAGS = new Set([
  'p', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6', 'ul', 'ol', 'li', 'blockquote', 'table', 'thead', 'tbody', 'tr', 'th', 'td',
  'strong', 'em', 's', 'a',
]);
const ALIGN = new Set(['left', 'right', 'center']);

export function renderMarkdown(text, container) {
  container.replaceChildren(...markdownNodes(text));
}

export function markdownNodes(text) {
  return buildBlocks(md.parse(text, {}));
}

function buildBlocks(tokens) {
  const root = document.createDocumentFragment();
  const stack = [root];
  const top = () => stack[stack.length - 1];
  for (const token of tokens) {
    if (token.nesting === 1) {
      if (token.hidden) {
        stack.push(top()); // a tight list's paragraph: its text goes straight into the <li>
        continue;
      }
      const el = openElement(token);
      if (el.tagName === 'TABLE') {
        const wrap = document.createElement('div'); // scrolls sideways on narrow screens
        wrap.className = 'table-wrap';
        wrap.append(el);
        top().append(wrap);
      } else {
        top().append(el);
      }
      stack.push(el);
    } else if (token.nesting === -1) {
      if (stack.length > 1) stack.pop();
    } else if (token.type === 'inline') {
      top().append(...buildInline(token.children || []));
    } else if (token.type === 'fence' || token.type === 'code_block') {
      const lang = token.type === 'fence' ? String(token.info || '').trim().split(/\s+/)[0] : '';
      top().append(codeBlock(token.content.replace(/\n$/, ''), lang));
    } else if (token.type === 'hr') {
      top().append(document.createElement('hr'));
    } else if (token.content) {
      top().append(document.createTextNode(token.content)); // anything unexpected: its text only
    }
  }
  return [...root.childNodes];
}

function openElement(token) {
  let tag = CONTAINER_TAGS.has(token.tag) ? token.tag : 'div';
  if (/^h[1-6]$/.test(tag)) tag = `h${Math.min(6, Number(tag[1]) + 2)}`; // h3..h6: replies are not documents
  const el = document.createElement(tag);
  if (tag === 'ol') {
    const start = Number(token.attrGet('start'));
    if (Number.isInteger(start) && start > 1) el.start = start;
  }
  if (tag === 'th' || tag === 'td') {
    const style = String(token.attrGet('style') || '');
    const m = style.match(/text-align:\s*(\w+)/);
    if (m && ALIGN.has(m[1])) el.style.textAlign = m[1];
  }
  return el;
}

function buildInline(tokens) {
  const root = document.createDocumentFragment();
  const stack = [root];
  const top = () => stack[stack.length - 1];
  for (const token of tokens) {
    switch (token.type) {
      case 'text':
        top().append(document.createTextNode(token.content));
        break;
      case 'softbreak':
        top().append(document.createTextNode('\n'));
        break;
      case 'hardbreak':
        top().append(document.createElement('br'));
        break;
      case 'code_inline': {
        const code = document.createElement('code');
        code.textContent = token.content;
        top().append(code);
        break;
      }
      case 'link_open': {
        const href = String(token.attrGet('href') || '');
        let el;
        if (/^https?:\/\//i.test(href)) {
          el = document.createElement('a');
          el.href = href;
          el.target = '_blank';
          el.rel = 'noopener noreferrer nofollow';
        } else {
          el = document.createElement('span');
        }
        top().append(el);
        stack.push(el);
        break;
      }
      case 'image': {
        // No images from model text (they would load from anywhere): the alt text, as a link.
        const src = String(token.attrGet('src') || '');
        const alt = token.content || src;
        if (/^https?:\/\//i.test(src)) {
          const a = document.createElement('a');
          a.href = src;
          a.target = '_blank';
          a.rel = 'noopener noreferrer nofollow';
          a.textContent = `[image: ${alt}]`;
          top().append(a);
        } else {
          top().append(document.createTextNode(alt));
        }
        break;
      }
      default:
        if (token.nesting === 1) {
          const el = document.createElement(CONTAINER_TAGS.has(token.tag) ? token.tag : 'span');
          top().append(el);
          stack.push(el);
        } else if (token.nesting === -1) {
          if (stack.length > 1) stack.pop();
        } else if (token.content) {
          top().append(document.createTextNode(token.content));
        }
    }
  }
  return [...root.childNodes];
}

function codeBlock(code, lang) {
  const figure = document.createElement('div');
  figure.className = 'code-block';
  const bar = document.createElement('div');
  bar.className = 'code-bar';
  const label = document.createElement('span');
  label.textContent = lang || 'code';
  bar.append(label, copyButton(() => code));
  const pre = document.createElement('pre');
  const el = document.createElement('code');
  const language = knownLanguage(lang);
  el.className = language ? `hljs language-${language}` : 'hljs';
  el.append(...highlightedNodes(code, lang));
  pre.append(el);
  figure.append(bar, pre);
  return figure;
}

// Renders a reply while it streams, at most once per animation frame, and without re-parsing the
// whole text each time: blocks before the last blank line outside a code fence are final once
// rendered; only the tail after them is rebuilt. `finish()` renders the whole text once more, so
// constructs that span blank lines (loose lists) end up exactly as markdown-it parses them.
export class StreamingMarkdown {
  constructor(container, { onFrame = null } = {}) {
    this.container = container;
    this.text = '';
    this.stableEnd = 0; // text[0:stableEnd] is rendered into this.stableNodes
    this.stableNodes = [];
    this.frame = 0;
    this.onFrame = onFrame;
    this.frameTimes = []; // ms spent rendering, one entry per frame (for measurement)
  }

  set(text) {
    this.text = text;
    if (!this.frame) this.frame = requestAnimationFrame(() => this.renderNow());
  }

  renderNow() {
    this.frame = 0;
    const t0 = performance.now();
    const cut = stableCut(this.text, this.stableEnd);
    if (cut > this.stableEnd) {
      this.stableNodes.push(...markdownNodes(this.text.slice(this.stableEnd, cut)));
      this.stableEnd = cut;
    }
    const tail = markdownNodes(this.text.slice(this.stableEnd));
    this.container.replaceChildren(...this.stableNodes, ...tail);
    this.markDrawn();
    this.frameTimes.push(performance.now() - t0);
    if (this.onFrame) this.onFrame();
  }

  finish() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.frame = 0;
    renderMarkdown(this.text, this.container);
    this.markDrawn();
  }

  // How much of the markdown source is on screen, as data-source-length on the container: the
  // rendered text can shrink by a few characters while it streams ("**bold" shows its asterisks
  // until the closing pair arrives), the source never does, so a tool (or a test) that follows a
  // reply growing reads this.
  markDrawn() {
    this.container.dataset.sourceLength = String(this.text.length);
  }
}

// The end of the last paragraph break (a blank line) after `from` that is outside a code fence.
function stableCut(text, from) {
  let cut = from;
  let inFence = false;
  let fence = '';
  let pos = from;
  while (pos < text.length) {
    const nl = text.indexOf('\n', pos);
    if (nl === -1) break; // the last line may still be growing
    const line = text.slice(pos, nl);
    const m = line.match(/^ {0,3}(`{3,}|~{3,})/);
    if (m) {
      if (!inFence) {
        inFence = true;
        fence = m[1];
      } else if (line.trim().startsWith(fence[0].repeat(fence.length)) && /^ {0,3}(`{3,}|~{3,})\s*$/.test(line)) {
        inFence = false;
      }
    } else if (!inFence && line.trim() === '' && pos > from) {
      cut = nl + 1;
    }
    pos = nl + 1;
  }
  return cut;
}
