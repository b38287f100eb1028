// View 8, the engine: the step loop live (/inspect/engine): requests (per API key, masked), KV blocks,
// prefix-cache hits, pinned prefixes, KV tiers and hand-offs, recent steps' tokens/s against the measured
// bandwidth roofline, and a KV-memory calculator.
import { ApiError, inspect, KEY_NEEDED } from './api.js';
import { isStreaming } from './chat.js';
import { emit, modelLoaded, on, state } from './state.js';
import { $, bytesSize, el, ms } from './util.js';

const FAST_MS = 250; // while a reply streams: KV usage moves every step
const SLOW_MS = 1500;
const STEPS = 128;

function setStat(testid, value, text = String(value)) {
  const node = document.querySelector(`[data-testid="${testid}"]`);
  node.dataset.value = String(value);
  node.textContent = text;
}

function renderStatus(s) {
  $('#model-name').textContent = `${s.model.name} · ${s.model.architecture} · ${s.model.dtype} · ${s.model.cpu_kernels.variant} kernels`;
  setStat('running', s.requests.running);
  setStat('waiting', s.requests.waiting);
  setStat('kv-used', s.kv.used_blocks);
  setStat('kv-total', s.kv.num_blocks);
  const rate = s.prefix_cache.hit_rate;
  setStat('prefix-hit-rate', rate ?? '', rate === null ? '–' : `${(100 * rate).toFixed(1)}%`);
  $('#kv-bar .kvbar-used').style.width = `${(100 * s.kv.used_blocks) / s.kv.num_blocks}%`;
}

/** Which CPU kernel build serves each operation (native.py's variant, or torch). */
function kernelsCard(m) {
  const { variant, ...ops } = m.cpu_kernels;
  const paths = Object.entries(ops).map(([op, path]) => `${op.replaceAll('_', ' ')}: ${path}`).join(' · ');
  return card('CPU kernels', variant, `${m.dtype} · ${paths || 'torch for every operation'}`);
}

function card(title, big, small, dataset = {}) {
  return el('div', { class: 'card', dataset }, el('h4', { text: title }), el('div', { class: 'big', text: big }), el('div', { class: 'small', text: small }));
}

/** Pinned prefixes (POST /v1/cache/pins): the pool memory they hold against their bound, and each by name. */
function pinsCard(pins) {
  const until = (p) => (p.expires_at === null ? 'until deleted' : `until ${new Date(p.expires_at * 1000).toLocaleTimeString()}`);
  const names = pins.pins.map((p) => `${p.name}: ${p.num_tokens} tokens, ${until(p)}`).join(' · ');
  return card('pinned prefixes', `${bytesSize(pins.bytes)} / ${bytesSize(pins.limit_bytes)}`,
    names || 'none: POST /v1/cache/pins keeps a prefix in the pool', { testid: 'pins-card', value: String(pins.bytes), names: pins.pins.map((p) => p.name).join(',') });
}

function tierCards(s) {
  const cards = s.kv_tiers.map((t) => card(`KV tier: ${t.tier}`, `${bytesSize(t.bytes)} · ${t.blocks} blocks`,
    `${t.hit_tokens} prompt tokens loaded instead of computed · ${t.evicted} evicted · ${t.refused} files refused`, { testid: `tier-${t.tier}` }));
  const x = s.kv_transfers;
  if (x.sent || x.received || x.failed) {
    cards.push(card('prefill → decode hand-offs', `${x.sent} sent · ${x.received} received`,
      `${x.blocks_sent} / ${x.blocks_received} blocks · ${x.failed} fell back to prefilling here`, { testid: 'transfers' }));
  }
  return cards;
}

/** The fastest a decode step of this composition can be: its weight and KV bytes at the measured bandwidth. */
function floorSeconds(s, step) {
  return (s.model.weight_bytes_per_decode_step + step.kv_tokens_read * s.model.kv_bytes_per_token) / s.roofline.read_bandwidth_bytes_per_s;
}

function renderEngine(s) {
  const m = s.model;
  const bw = s.roofline.read_bandwidth_bytes_per_s;
  $('#engine-cards').replaceChildren(
    card('requests', `${s.requests.running} running`, `${s.requests.waiting} waiting for a place in the batch`),
    card('KV blocks', `${s.kv.used_blocks} / ${s.kv.num_blocks}`, `${s.kv.block_size} tokens each · ${s.kv.cached_blocks} hold a cached prefix · pool ${bytesSize(s.kv.pool_bytes)}`),
    card('prefix cache', s.prefix_cache.hit_rate === null ? '–' : `${(100 * s.prefix_cache.hit_rate).toFixed(1)}%`, `${s.prefix_cache.hits} of ${s.prefix_cache.queries} prompt tokens found computed`),
    pinsCard(s.pins),
    ...tierCards(s),
    card('memory bandwidth (measured)', `${(bw / 1e9).toFixed(1)} GB/s`, `a decode step reads ${bytesSize(m.weight_bytes_per_decode_step)} of weights: ≥ ${ms(s.roofline.decode_step_floor_s)}, so one stream ≤ ${(1 / s.roofline.decode_step_floor_s).toFixed(0)} tokens/s`),
    card('model', `${m.num_layers} layers`, `${m.num_heads} query heads, ${m.num_kv_heads} KV heads × ${m.head_dim} · vocab ${m.vocab_size} · context ${m.max_model_len}`),
    kernelsCard(m),
  );
  renderTenants(s.requests.tenants);
  drawSteps(s);
}

/** Running and waiting sequences per API key (its masked id: the page never sees a key). */
function renderTenants(tenants) {
  const rows = tenants.map((t) => el('tr', { dataset: { testid: 'tenant', key: t.key ?? '', running: t.running, waiting: t.waiting } },
    el('td', { class: 'tk', text: t.key ?? 'no key (one tenant)' }), el('td', { class: 'num', text: String(t.running) }),
    el('td', { class: 'num', text: String(t.waiting) })));
  $('#engine-tenants').replaceChildren(rows.length
    ? el('table', { class: 'cands' }, el('thead', {}, el('tr', {}, ...['API key', 'running', 'waiting'].map((h) => el('th', { text: h })))),
      el('tbody', {}, ...rows))
    : el('p', { class: 'hint', text: 'No request in the engine.' }));
}

function drawSteps(s) {
  const svg = $('#steps-chart');
  const steps = s.steps;
  const ns = 'http://www.w3.org/2000/svg';
  const node = (tag, attrs) => { const n = document.createElementNS(ns, tag); for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v); return n; };
  const rate = (st) => (st.prefill_tokens + st.decode_tokens) / st.duration_s;
  const ceiling = (st) => (st.decode_tokens ? st.decode_tokens / floorSeconds(s, st) : 0);
  const top = Math.max(1, ...steps.map(rate), ...steps.map(ceiling)) * 1.1;
  const w = 600 / Math.max(steps.length, 1);
  svg.replaceChildren();
  steps.forEach((st, k) => {
    const h = (180 * rate(st)) / top;
    svg.append(node('rect', { x: k * w + 0.5, y: 180 - h, width: Math.max(w - 1, 0.5), height: h, fill: st.prefill_tokens ? '#74c0fc' : '#ff922b' }));
    if (st.decode_tokens) svg.append(node('rect', { x: k * w, y: 180 - (180 * ceiling(st)) / top - 1, width: w, height: 2, fill: '#212529' }));
  });
  const decodes = steps.filter((st) => st.decode_tokens && !st.prefill_tokens);
  const efficiency = decodes.length ? decodes.reduce((sum, st) => sum + floorSeconds(s, st) / st.duration_s, 0) / decodes.length : null;
  $('#steps-legend').textContent = `${steps.length} most recent steps, oldest left; bar height = tokens/s of that step (blue: with prefill, orange: decode only); ` +
    `black tick = the bandwidth roofline of a decode step (its weights and KV reads at ${(s.roofline.read_bandwidth_bytes_per_s / 1e9).toFixed(1)} GB/s). ` +
    (efficiency === null ? '' : `Pure decode steps reach ${(100 * efficiency).toFixed(0)}% of their roofline on average.`);
}

// ---------------------------------------------------------------- KV-memory calculator

const CALC = [
  ['layers', 'layers', 1], ['kv_heads', 'KV heads', 1], ['head_dim', 'head dim', 1], ['bytes', 'bytes per value', 1],
  ['tokens', 'tokens per context', 1], ['budget_gib', 'memory for KV (GiB)', 0.01],
];

function buildCalculator() {
  const box = $('#kv-calculator');
  const inputs = CALC.map(([key, text, step]) => el('label', {}, text, el('input', { type: 'number', min: step, step, dataset: { testid: `kv-${key}`, key } })));
  const presets = el('div', { class: 'out' },
    el('button', { type: 'button', class: 'ghost', text: 'This server\'s model', onclick: () => preset() }), ' ',
    el('button', { type: 'button', class: 'ghost', text: 'Llama-3.1-8B (32 × 8 × 128, BF16)', onclick: () => fill({ layers: 32, kv_heads: 8, head_dim: 128, bytes: 2 }) }));
  box.replaceChildren(...inputs, el('div', { class: 'out', id: 'kv-out' }), presets);
  box.addEventListener('input', compute);
}

function fill(values) {
  for (const [key, value] of Object.entries(values)) $(`#kv-calculator [data-key="${key}"]`).value = String(value);
  compute();
}

function preset() {
  const s = state.engine;
  if (!s) return;
  fill({ layers: s.model.num_layers, kv_heads: s.model.num_kv_heads, head_dim: s.model.head_dim, bytes: s.model.bytes_per_value,
    tokens: Math.min(4096, s.model.max_model_len), budget_gib: +(s.kv.pool_bytes / 2 ** 30).toFixed(2) });
}

function compute() {
  const v = Object.fromEntries(CALC.map(([key]) => [key, Number($(`#kv-calculator [data-key="${key}"]`).value)]));
  const perToken = 2 * v.layers * v.kv_heads * v.head_dim * v.bytes;
  const perContext = perToken * v.tokens;
  const fit = perContext > 0 ? Math.floor((v.budget_gib * 2 ** 30) / perContext) : 0;
  const out = $('#kv-out');
  out.dataset.perToken = String(perToken);
  out.dataset.contexts = String(fit);
  out.replaceChildren(
    '2 × ', el('b', { text: String(v.layers) }), ' layers × ', el('b', { text: String(v.kv_heads) }), ' KV heads × ', el('b', { text: String(v.head_dim) }),
    ' dims × ', el('b', { text: String(v.bytes) }), ' bytes = ', el('b', { dataset: { testid: 'kv-per-token' }, text: bytesSize(perToken) }), ' per token; ',
    el('b', { text: bytesSize(perContext) }), ` per ${v.tokens}-token context → `, el('b', { dataset: { testid: 'kv-contexts' }, text: String(fit) }),
    ` concurrent contexts fit in ${v.budget_gib} GiB.`);
}

// ---------------------------------------------------------------- polling

let timer = null;
let inFlight = false;

function schedule(delay) {
  clearTimeout(timer);
  timer = setTimeout(poll, delay);
}

/** Nothing to look at: the page's model is not loaded (a look would not load it; the next message does). */
function notLoaded() {
  const banner = $('#banner');
  banner.hidden = false;
  banner.textContent = `${state.model} is not loaded: the next message loads it.`;
  $('#model-name').textContent = state.model;
  for (const testid of ['running', 'waiting', 'kv-used', 'kv-total', 'prefix-hit-rate']) setStat(testid, '', '–');
  $('#kv-bar .kvbar-used').style.width = '0%';
}

async function poll() {
  if (!modelLoaded()) {
    if (state.model !== null) notLoaded(); // else the models are not listed yet (models.js says why)
    schedule(FAST_MS);
    return;
  }
  inFlight = true;
  let delay = SLOW_MS;
  try {
    const s = await inspect.engine(state.tab === 'engine' ? STEPS : 0);
    const first = !state.engine;
    state.engine = s;
    renderStatus(s);
    if (state.tab === 'engine') renderEngine(s);
    if (first) { preset(); emit('engine-ready', s); }
    delay = isStreaming() || s.requests.running ? FAST_MS : SLOW_MS;
    $('#banner').hidden = true;
  } catch (error) {
    const banner = $('#banner');
    banner.hidden = false;
    banner.textContent = error instanceof ApiError && error.status === 401 ? KEY_NEEDED
      : error instanceof ApiError && error.status === 503 ? 'The model is loading…' : `The server does not answer: ${error.message}`;
  }
  inFlight = false;
  schedule(delay);
}

export function initEngine() {
  buildCalculator();
  on('tab-shown', (tab) => { if (tab === 'engine' && state.engine) renderEngine(state.engine); });
  // A reply starts: watch at the fast pace from now, not from the next slow poll (one in flight reschedules itself).
  on('reply-started', () => { if (!inFlight) schedule(FAST_MS); });
  // Another model: its own engine, and nothing of the last one's snapshot holds for it.
  on('model-changed', () => { state.engine = null; if (!inFlight) schedule(0); });
  poll();
}
