// What a request costs under a price list: prompt tokens the prefix cache already held are billed at the
// cached-input price, the others at the input price, generated tokens at the output price. The prices are
// the reader's to edit (kept in this browser); the token counts are the server's own (the usage object).
import { $, el } from './util.js';

const KEY = 'zhuzi.prices';
// Per million tokens: an example of the usual shape (cached input a quarter of input, output four times it).
const DEFAULTS = { input: 0.4, cached: 0.1, output: 1.6 };
const FIELDS = [['input', 'input'], ['cached', 'cached input'], ['output', 'output']];

let prices = { ...DEFAULTS, ...JSON.parse(localStorage.getItem(KEY) || '{}') };
let shown = null; // the usage the line was drawn for

const dollars = (x) => `$${x < 0.01 ? x.toPrecision(3) : x.toFixed(4)}`;

/** This request's cost with the cache and as if no prompt token had been cached. */
export function cost(usage, p = prices) {
  const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
  const out = usage.completion_tokens * p.output;
  return {
    withCache: ((usage.prompt_tokens - cached) * p.input + cached * p.cached + out) / 1e6,
    withoutCache: (usage.prompt_tokens * p.input + out) / 1e6,
    cached,
  };
}

export function drawCost(usage) {
  shown = usage;
  const line = $('#cost-line');
  if (!usage) { line.replaceChildren(el('span', { class: 'hint', text: 'The cost appears once a reply has its usage.' })); return; }
  const c = cost(usage);
  line.dataset.withCache = String(c.withCache);
  line.dataset.withoutCache = String(c.withoutCache);
  const saved = c.withoutCache > 0 ? (100 * (c.withoutCache - c.withCache)) / c.withoutCache : 0;
  line.replaceChildren(
    `This request: ${usage.prompt_tokens} prompt tokens (${c.cached} of them cached) and ${usage.completion_tokens} generated → `,
    el('b', { text: dollars(c.withCache) }), ' with the cache; ', el('b', { text: dollars(c.withoutCache) }),
    ` if every prompt token were computed again (${saved.toFixed(0)}% saved). The cached tokens' K and V were read back, not computed: `
    + 'no forward pass over them, which is why they are cheaper.');
}

export function initCost() {
  const table = $('#price-table');
  table.replaceChildren(el('span', { text: 'Prices per million tokens (edit them):' }), ...FIELDS.map(([key, label]) => el('label', {}, label, ' $',
    el('input', { type: 'number', min: 0, step: 0.01, value: prices[key], dataset: { testid: `price-${key}`, key } }))));
  table.addEventListener('input', (e) => {
    const value = Number(e.target.value);
    if (!e.target.dataset.key || !(value >= 0)) return;
    prices = { ...prices, [e.target.dataset.key]: value };
    localStorage.setItem(KEY, JSON.stringify(prices));
    drawCost(shown);
  });
  drawCost(null);
}
