// Small helpers shared by the views: DOM building, token display, number formats.

/** el('div', {class: 'x', dataset: {testid: 'y'}}, child, 'text') */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === 'dataset') {
      for (const [name, v] of Object.entries(value)) if (v !== undefined && v !== null) node.dataset[name] = v;
    }
    else if (key === 'class') node.className = value;
    else if (key === 'text') node.textContent = value;
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? '' : value);
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export const $ = (selector, root = document) => root.querySelector(selector);

const utf8 = new TextDecoder('utf-8', { fatal: true });

/** A token's bytes as text, or null when they are not whole UTF-8 characters. */
export function bytesText(bytes) {
  try {
    return utf8.decode(Uint8Array.from(bytes));
  } catch {
    return null;
  }
}

export const hex = (bytes) => Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join(' ');

/** What a token looks like on screen: whitespace made visible, partial UTF-8 as hex bytes. */
export function tokenLabel(bytes) {
  const text = bytesText(bytes);
  if (text === null) return `‹${hex(bytes)}›`;
  return text.replaceAll(' ', '·').replaceAll('\n', '↵').replaceAll('\t', '⇥') || '∅';
}

export const pct = (p) => (p >= 0.9995 ? '100%' : p >= 0.001 ? `${(p * 100).toFixed(1)}%` : p > 0 ? `${(p * 100).toExponential(1)}%` : '0%');
export const ms = (seconds) => (seconds === null || seconds === undefined ? '–' : `${(seconds * 1000).toFixed(1)} ms`);

export function bytesSize(n) {
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${units[i]}`;
}

export function debounce(fn, wait) {
  let timer;
  return (...args) => { clearTimeout(timer); timer = setTimeout(() => fn(...args), wait); };
}

/** A 0..1 probability as a background intensity class-free colour (CSSOM, allowed by the page's CSP). */
export function heat(node, p, hue = 28) {
  node.style.backgroundColor = `hsla(${hue}, 90%, 55%, ${Math.min(1, Math.max(0.04, p)).toFixed(3)})`;
}
