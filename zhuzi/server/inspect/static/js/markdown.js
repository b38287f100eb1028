// Markdown for streamed replies: marked (vendored) renders; this module keeps it safe and steady.
// - Raw HTML in a reply is shown as text, links only go to http(s)/mailto, images are never fetched.
// - An unclosed code fence stays plain text until its closing fence arrives (an unclosed ** already
//   does: CommonMark leaves unmatched delimiters as literal text), so nothing flips back and forth.
// - Only the top-level blocks that changed are replaced, so earlier blocks never flicker.
import { Marked } from '../vendor/marked.esm.js';

const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
const SAFE_URL = /^(https?:|mailto:)/i;

const marked = new Marked({
  gfm: true,
  renderer: {
    html({ text }) { return escapeHtml(text); },
    link({ href, title, tokens }) {
      const inner = this.parser.parseInline(tokens);
      if (!SAFE_URL.test(href)) return inner;
      const t = title ? ` title="${escapeHtml(title)}"` : '';
      return `<a href="${escapeHtml(href)}"${t} rel="noopener noreferrer" target="_blank">${inner}</a>`;
    },
    image({ text }) { return escapeHtml(text ? `[image: ${text}]` : '[image]'); },
  },
});

const FENCE = /^ {0,3}(`{3,}|~{3,})/;

/** Splits text at an opening code fence that has no closing fence yet: [markdown, plain tail]. */
export function splitOpenFence(text) {
  const lines = text.split('\n');
  let open = null;
  let at = 0;
  let offset = 0;
  for (const line of lines) {
    const m = FENCE.exec(line);
    if (m) {
      if (open === null) { open = m[1]; at = offset; } else if (m[1][0] === open[0] && m[1].length >= open.length && !line.trim().slice(m[1].length)) open = null;
    }
    offset += line.length + 1;
  }
  return open === null ? [text, ''] : [text.slice(0, at), text.slice(at)];
}

export function toHtml(text) {
  const [body, tail] = splitOpenFence(text);
  const html = marked.parse(body);
  return tail ? `${html}<p class="plain">${escapeHtml(tail)}</p>` : html;
}

/** Renders text into node, replacing only the top-level blocks that differ from what is shown. */
export function render(node, text) {
  const fresh = document.createElement('template');
  fresh.innerHTML = toHtml(text);
  const next = Array.from(fresh.content.childNodes).filter((n) => n.nodeType !== Node.TEXT_NODE || n.textContent.trim());
  const current = Array.from(node.childNodes);
  let same = 0;
  while (same < next.length && same < current.length && current[same].isEqualNode(next[same])) same += 1;
  for (const old of current.slice(same)) old.remove();
  node.append(...next.slice(same));
}
