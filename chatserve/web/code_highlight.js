// Syntax highlighting with the vendored highlight.js core and a dozen common languages.
//
// NOTE: highlight.js returns HTML (the code escaped, wrapped in <span class="hljs-...">). That string
// is parsed by DOMParser into an inert document (no scripts run, no images load there) and only
// text nodes and <span> elements with hljs- classes are rebuilt in the page: model text never goes
// through innerHTML, and nothing but those spans can come out of it.

import hljs from './vendor/highlight.js/core.min.js';
import bash from './vendor/highlight.js/languages/bash.min.js';
import c from './vendor/highlight.js/languages/c.min.js';
import cpp from './vendor/highlight.js/languages/cpp.min.js';
import css from './vendor/highlight.js/languages/css.min.js';
import diff from './vendor/highlight.js/languages/diff.min.js';
import go from './vendor/highlight.js/languages/go.min.js';
import java from './vendor/highlight.js/languages/java.min.js';
import javascript from './vendor/highlight.js/languages/javascript.min.js';
import json from './vendor/highlight.js/languages/json.min.js';
import markdown from './vendor/highlight.js/languages/markdown.min.js';
import plaintext from './vendor/highlight.js/languages/plaintext.min.js';
import python from './vendor/highlight.js/languages/python.min.js';
import rust from './vendor/highlight.js/languages/rust.min.js';
import shell from './vendor/highlight.js/languages/shell.min.js';
import sql from './vendor/highlight.js/languages/sql.min.js';
import typescript from './vendor/highlight.js/languages/typescript.min.js';
import xml from './vendor/highlight.js/languages/xml.min.js';
import yaml from './vendor/highlight.js/languages/yaml.min.js';

const LANGUAGES = {
  bash, c, cpp, css, diff, go, java, javascript, json, markdown, plaintext, python, rust, shell, sql, typescript, xml, yaml,
};
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);

const CLASS_OK = /^(hljs-[a-z0-9_-]+|language-[a-z0-9_+-]+|_+)$/i;
const parser = new DOMParser();

export function knownLanguage(lang) {
  const found = lang ? hljs.getLanguage(lang) : undefined;
  return found ? lang.toLowerCase() : null;
}

// The highlighted code as DOM nodes (plain text when the language is unknown or highlighting fails).
export function highlightedNodes(code, lang) {
  const language = knownLanguage(lang);
  if (!language) return [document.createTextNode(code)];
  let html;
  try {
    html = hljs.highlight(code, { language, ignoreIllegals: true }).value;
  } catch {
    return [document.createTextNode(code)];
  }
  const inert = parser.parseFromString(`<!doctype html><body>${html}`, 'text/html');
  return rebuild(inert.body);
}

function rebuild(from) {
  const out = [];
  for (const node of from.childNodes) {
    if (node.nodeType === Node.TEXT_NODE) {
      out.push(document.createTextNode(node.data));
    } else if (node.nodeType === Node.ELEMENT_NODE) {
      const children = rebuild(node);
      if (node.tagName === 'SPAN') {
        const span = document.createElement('span');
        const classes = String(node.getAttribute('class') || '').split(/\s+/).filter((k) => CLASS_OK.test(k));
        if (classes.length) span.className = classes.join(' ');
        span.append(...children);
        out.push(span);
      } else {
        out.push(...children); // anything else keeps only its text
      }
    }
  }
  return out;
}
