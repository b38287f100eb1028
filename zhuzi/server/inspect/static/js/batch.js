// The batch view: the engine's recent steps as a strip (/inspect/batch), each step a column of its rows,
// prefill chunks apart from decodes and speculative verifications. The selected reply's rows are marked:
// the page names the reply's id and the server marks the rows that belong to it; everyone else's rows come
// back anonymous (numbered per answer, never with a request id).
import { inspect } from './api.js';
import { isStreaming } from './chat.js';
import { on, state } from './state.js';
import { $, el, ms } from './util.js';

const STEPS = 48;
const FAST_MS = 250; // while anything runs: a step every few tens of milliseconds
const SLOW_MS = 1500;
const KINDS = { prefill: 'prefill chunk', decode: 'decode (one token)', verify: 'verification (drafts + one)' };
const ORDER = { decode: 0, verify: 1, prefill: 2 };

let steps = [];
let chosen = null; // the selected step (a copy: it stays readable after it leaves the strip)
let timer = null;
let polling = false; // one request at a time; the one in flight schedules the next

const reply = () => state.selected?.reply ?? state.replies.at(-1) ?? null;
const sorted = (rows) => [...rows].sort((a, b) => ORDER[a.kind] - ORDER[b.kind] || a.request - b.request);

function counts(step) {
  const rows = step.rows;
  return {
    rows: rows.length, prefillTokens: step.prefill_tokens, decodeRows: step.decode_rows, verifyTokens: step.verify_tokens,
    yours: rows.filter((r) => r.yours).length, tokens: rows.reduce((n, r) => n + r.tokens, 0),
  };
}

function column(step) {
  const c = counts(step);
  const col = el('div', {
    class: `bstep${chosen?.index === step.index ? ' selected' : ''}${c.yours ? ' has-yours' : ''}`, role: 'button', tabindex: 0,
    dataset: { testid: 'batch-step', index: step.index, ...c },
    title: `step ${step.index}: ${c.rows} rows, ${c.tokens} tokens, ${ms(step.duration_s)}`,
    onclick: () => select(step),
  });
  for (const row of sorted(step.rows)) {
    const cell = el('div', { class: `brow ${row.kind}${row.yours ? ' yours' : ''}`, dataset: { kind: row.kind, tokens: row.tokens } });
    cell.style.height = `${Math.round(4 + 4 * Math.log2(row.tokens))}px`; // one token: a thin row; a 128-token chunk: a block
    col.append(cell);
  }
  return col;
}

function describe(step) {
  const c = counts(step);
  const prefills = step.rows.filter((r) => r.kind === 'prefill');
  const verifies = step.rows.filter((r) => r.kind === 'verify');
  const parts = [`${c.decodeRows} decode${c.decodeRows === 1 ? '' : 's'} (one token each)`];
  if (verifies.length) parts.push(`${verifies.length} verification${verifies.length === 1 ? '' : 's'} (${c.verifyTokens} tokens: drafts and one position each)`);
  if (prefills.length) parts.push(`${prefills.length} prefill chunk${prefills.length === 1 ? '' : 's'} (${c.prefillTokens} tokens)`);
  return `${c.rows} rows: ${parts.join(', ')}; ${c.tokens} tokens computed in one forward pass`;
}

function renderDetail() {
  const box = $('#batch-detail');
  if (!chosen) { box.replaceChildren(el('p', { class: 'hint', text: 'Select a step (a column) to see its rows.' })); return; }
  const step = chosen;
  box.replaceChildren(
    el('div', { class: 'step-head' },
      el('span', {}, 'step ', el('b', { text: `#${step.index}` })),
      el('span', {}, 'forward pass and sampling ', el('b', { dataset: { testid: 'batch-duration' }, text: ms(step.duration_s) })),
      el('span', { text: `${step.age_s.toFixed(1)} s before it was fetched` })),
    el('p', { dataset: { testid: 'batch-composition' }, text: describe(step) }),
    el('table', { class: 'cands' },
      el('thead', {}, el('tr', {}, ...['request', 'kind', 'tokens', 'attends to', 'drafts accepted'].map((h) => el('th', { text: h })))),
      el('tbody', {}, sorted(step.rows).map((r) => el('tr', { class: r.yours ? 'yours' : '', dataset: { testid: 'batch-row', kind: r.kind, tokens: r.tokens, yours: r.yours } },
        el('td', { text: r.yours ? 'yours' : `another request (#${r.request})` }),
        el('td', {}, el('span', { class: `swatch ${r.kind}` }), KINDS[r.kind]),
        el('td', { class: 'num', text: String(r.tokens) }),
        el('td', { class: 'num', text: `${r.context} tokens` }),
        el('td', { class: 'num', text: r.kind === 'verify' ? `${r.accepted} of ${r.drafts}` : '' }))))));
}

function render() {
  const strip = $('#batch-strip');
  strip.replaceChildren(...steps.map(column));
  const mine = steps.filter((s) => s.rows.some((r) => r.yours));
  const shared = mine.filter((s) => s.rows.some((r) => !r.yours));
  const strangers = Math.max(0, ...mine.map((s) => new Set(s.rows.filter((r) => !r.yours).map((r) => r.request)).size));
  const r = reply();
  $('#batch-summary').replaceChildren(
    `${steps.length} most recent steps, oldest left; each column is one forward pass, each block one sequence's share of it. `,
    r ? el('span', { dataset: { testid: 'batch-yours', steps: mine.length, shared: shared.length } },
      'The selected reply (outlined) is in ', el('b', { text: String(mine.length) }), ` of them; `,
      el('b', { text: String(shared.length) }), ` of those it shared with other requests (up to ${strangers} at once).`)
      : 'Send a message: its rows are outlined.');
  renderDetail();
}

function select(step) {
  chosen = structuredClone(step);
  for (const node of document.querySelectorAll('#batch-strip .bstep')) node.classList.toggle('selected', Number(node.dataset.index) === step.index);
  renderDetail();
}

async function poll() {
  clearTimeout(timer);
  if (state.tab !== 'batch' || polling) return;
  polling = true;
  let delay = SLOW_MS;
  if (!$('#batch-pause').checked) {
    try {
      steps = (await inspect.batch(STEPS, reply()?.id)).steps;
      render();
      if (isStreaming() || state.engine?.requests.running) delay = FAST_MS;
    } catch (error) {
      $('#batch-summary').textContent = `Could not read the steps: ${error.message}`;
    }
  }
  polling = false;
  if (state.tab === 'batch') timer = setTimeout(poll, delay);
}

export function initBatch() {
  const legend = Object.entries(KINDS).map(([kind, text]) => el('span', {}, el('span', { class: `swatch ${kind}` }), text));
  $('#batch-legend').replaceChildren(...legend, el('span', {}, el('span', { class: 'swatch yours' }), 'the selected reply'));
  on('tab-shown', (tab) => { if (tab === 'batch') poll(); });
  on('reply-started', () => { if (state.tab === 'batch') poll(); });
  on('reply-selected', () => { if (state.tab === 'batch') poll(); });
  $('#batch-pause').addEventListener('change', () => poll());
  renderDetail();
}
