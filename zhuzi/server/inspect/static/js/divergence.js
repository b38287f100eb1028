// The divergence experiment: one prompt, greedy, answered alone and inside batches of other sizes (the other
// rows are random prompts this page sends), compared token by token. Each run reads the prompt the same way
// (a first call leaves its blocks in the prefix cache) and starts its target once the other rows decode, so
// that every step the target takes holds the same rows: what changes between runs is the batch, nothing else.
import { inspect, postJSON, postSSE, tokenId } from './api.js';
import { on, state } from './state.js';
import { $, el, tokenLabel } from './util.js';

const WORDS = ('river lantern copper garden winter violin harbor pepper meadow castle rocket pencil orchard '
  + 'thunder marble candle forest window silver engine planet bakery saddle ribbon').split(' ');
const MAX_ROWS = 32;

let controller = null; // the other rows of the run in progress
let cancelled = false;

function randomPrompt() {
  const words = Array.from({ length: 10 }, () => WORDS[Math.floor(Math.random() * WORDS.length)]);
  return `A few sentences with the words ${words.join(', ')}:`;
}

const ask = (content, extra) => ({ messages: [{ role: 'user', content }], temperature: 0, ...extra });

/** n other rows: one streamed /v1/completions request with n random prompts (one connection: a browser opens
 * at most six to a server); resolves once every prompt has its first token, i.e. is decoding. */
async function startOthers(n, maxTokens, signal) {
  const prompts = Array.from({ length: n }, randomPrompt);
  const started = new Set();
  const body = { prompt: prompts, stream: true, temperature: 0, max_tokens: maxTokens, ignore_eos: true, logprobs: 0 };
  let ready;
  const all = new Promise((resolve, reject) => { ready = { resolve, reject }; });
  (async () => {
    try {
      for await (const chunk of postSSE('/v1/completions', body, signal)) {
        for (const choice of chunk.choices) started.add(choice.index);
        if (started.size === n) ready.resolve();
      }
      ready.reject(new Error('the other rows ended before the target: raise their max tokens'));
    } catch (error) {
      if (signal.aborted) ready.resolve(); else ready.reject(error);
    }
  })();
  await all;
}

/** Until the engine runs nothing: the next run starts from an empty batch. */
async function idle() {
  for (let k = 0; k < 100; k += 1) {
    const s = await inspect.engine(0);
    if (!s.requests.running && !s.requests.waiting) return;
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  throw new Error('the engine stayed busy: other clients are using it, so the batches are not the page\'s');
}

/** The target's greedy answer with, at each step, its two leading candidates. */
async function target(prompt, maxTokens) {
  const r = await postJSON('/v1/chat/completions', ask(prompt, {
    max_tokens: maxTokens, logprobs: true, top_logprobs: 2, return_token_ids: true, return_tokens_as_token_ids: true,
  }));
  const entries = r.choices[0].logprobs.content;
  return {
    ids: r.choices[0].token_ids, bytes: entries.map((e) => e.bytes),
    top: entries.map((e) => e.top_logprobs.map((t) => ({ id: tokenId(t.token), bytes: t.bytes, logprob: t.logprob }))),
  };
}

/** One run: the target alone (rows 1) or beside rows - 1 others that already decode. */
async function run(prompt, rows, maxTokens) {
  if (cancelled) throw new Error('cancelled');
  const others = new AbortController();
  controller = others;
  try {
    if (rows > 1) await startOthers(rows - 1, 2 * maxTokens + 16, others.signal);
    return await target(prompt, maxTokens);
  } finally {
    others.abort();
    await idle();
  }
}

export function firstDivergence(a, b) {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i += 1) if (a[i] !== b[i]) return i;
  return a.length === b.length ? -1 : n;
}

function tokens(answer, at) {
  return answer.ids.map((id, i) => el('span', {
    class: `dtok${i === at ? ' first' : at >= 0 && i > at ? ' after' : ''}`, title: `token ${i + 1} · id ${id}`,
    text: tokenLabel(answer.bytes[i]),
  }));
}

const cand = (c) => `“${tokenLabel(c.bytes)}” ${c.logprob.toFixed(4)}`;
const gap = (top) => (top.length > 1 ? top[0].logprob - top[1].logprob : null);

function detail(reference, result) {
  const at = result.first;
  const mine = reference.answer.top[at] || [];
  const theirs = result.answer.top[at] || [];
  return el('div', { class: 'note', dataset: { testid: 'divergence-detail', gapAlone: gap(mine), gapBatch: gap(theirs) } },
    `At token ${at + 1} the two leading candidates, as logprobs (a logit minus one number per step, so their gap is the logits' gap): `,
    el('b', { text: 'alone ' }), mine.map(cand).join(' vs '), ` (gap ${gap(mine)?.toFixed(4)}); `,
    el('b', { text: `in ${result.rows} rows ` }), theirs.map(cand).join(' vs '), ` (gap ${gap(theirs)?.toFixed(4)}). `,
    'The same products summed in another order round differently in ', el('b', { text: state.engine?.model.dtype ?? 'this dtype' }),
    '; where two candidates are that close, the argmax flips, and every later token follows from a different text.');
}

function row(reference, result, maxTokens) {
  const label = result.rows === 1 ? 'alone (the reference)' : `in a batch of ${result.rows} rows`;
  const verdict = result.rows === 1 ? ''
    : result.first >= 0 ? ` — differs from token ${result.first + 1} on (try ${result.tries})`
      : ` — no divergence in ${result.tries} ${result.tries === 1 ? 'try' : 'tries'} (${result.tries} × ${result.answer.ids.length} tokens compared, up to ${maxTokens} each)`;
  return el('div', {
    class: 'drun', dataset: {
      testid: 'divergence-run', batchSize: result.rows, firstDivergence: result.first, tries: result.tries,
      tokenIds: result.answer.ids.join(','),
    },
  },
  el('div', { class: 'drun-head' }, el('b', { text: label }), verdict),
  el('div', { class: 'dtokens' }, tokens(result.answer, result.first)),
  result.first >= 0 ? detail(reference, result) : null);
}

function readSizes() {
  const sizes = $('#div-sizes').value.split(/[\s,]+/).filter(Boolean).map(Number);
  if (!sizes.length || sizes.some((n) => !Number.isInteger(n) || n < 1 || n > MAX_ROWS)) {
    throw new Error(`batch sizes are whole numbers from 1 to ${MAX_ROWS}, e.g. "1, 3, 8, 16"`);
  }
  return [...new Set(sizes.filter((n) => n > 1))].sort((a, b) => a - b);
}

function setStatus(text) { $('#div-status').textContent = text; }

async function experiment() {
  const prompt = $('#div-prompt').value.trim();
  const maxTokens = Number($('#div-tokens').value);
  const tries = Number($('#div-tries').value);
  const sizes = readSizes();
  const out = $('#div-runs');
  out.replaceChildren();
  setStatus('Reading the prompt once, so that every run finds it in the prefix cache…');
  await run(prompt, 1, 1);
  setStatus('Alone…');
  const reference = { rows: 1, tries: 1, first: -1, answer: await run(prompt, 1, maxTokens) };
  out.append(row(reference, reference, maxTokens));
  const results = [];
  for (const rows of sizes) {
    let result = null;
    for (let t = 1; t <= tries && !(result?.first >= 0); t += 1) {
      setStatus(`In a batch of ${rows} rows, try ${t} of ${tries}…`);
      const answer = await run(prompt, rows, maxTokens);
      result = { rows, tries: t, answer, first: firstDivergence(reference.answer.ids, answer.ids) };
    }
    results.push(result);
    out.append(row(reference, result, maxTokens));
  }
  const diverged = results.filter((r) => r.first >= 0);
  setStatus(diverged.length
    ? `${diverged.length} of ${results.length} batch sizes changed the greedy answer.`
    : `No batch size changed the answer: ${results.length} sizes, up to ${tries} ${tries === 1 ? 'try' : 'tries'} each, ${maxTokens} tokens a try.`);
}

function explainMode() {
  const s = state.engine;
  if (!s) return;
  $('#div-mode').textContent = s.settings.deterministic
    ? 'This server runs --deterministic: every linear layer sums in one fixed order per row, whatever the rows around it, so no batch should change a greedy answer.'
    : `This server runs in ${s.model.dtype} without --deterministic: the kernels pick their blocking by the number of rows, so a batch can move a logit by a rounding step.`;
}

export function initDivergence() {
  $('#div-start').addEventListener('click', async () => {
    const button = $('#div-start');
    button.disabled = true;
    cancelled = false;
    explainMode();
    try {
      await experiment();
    } catch (error) {
      setStatus(`The experiment stopped: ${error.message}`);
    } finally {
      controller = null;
      button.disabled = false;
    }
  });
  $('#div-cancel').addEventListener('click', () => { cancelled = true; controller?.abort(); });
  on('engine-ready', explainMode);
}
