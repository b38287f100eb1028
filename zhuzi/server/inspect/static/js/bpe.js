// View 6, the tokenizer: the model's own byte-level BPE merges replayed step by step (/inspect/bpe).
// Every intermediate state is a valid tokenization, so each step row carries its token ids.
import { inspect } from './api.js';
import { on } from './state.js';
import { $, debounce, el, hex, tokenLabel } from './util.js';

let replay = null; // {result, states: [[ [piece] per word ]], fresh: [Set of "w:i"]}
let pending = null;

/** All states: state 0 is each word's bytes; step k applies merge k wherever the server says it applied. */
function states(result) {
  const out = [result.words.map((w) => w.pieces)];
  const fresh = [new Set()];
  for (const step of result.steps) {
    const next = out.at(-1).map((pieces) => [...pieces]);
    const marks = new Set();
    const at = [...step.at].sort((a, b) => b[0] - a[0] || b[1] - a[1]); // right to left: indexes stay valid
    for (const [w, i] of at) next[w].splice(i, 2, step.merged);
    for (const [w] of step.at) {
      next[w].forEach((p, i) => { if (p.id === step.merged.id) marks.add(`${w}:${i}`); });
    }
    out.push(next);
    fresh.push(marks);
  }
  return { states: out, fresh };
}

const idsOf = (words) => words.flat().map((p) => p.id);

function drawStage(k) {
  const words = replay.states[k];
  $('#bpe-slider').value = String(k);
  $('#bpe-at').textContent = k === 0 ? `bytes: ${idsOf(words).length} tokens` : `after merge ${k} of ${replay.result.steps.length}: ${idsOf(words).length} tokens`;
  $('#bpe-stage').replaceChildren(...words.flatMap((pieces, w) => [
    ...pieces.map((p, i) => el('span', {
      class: `piece${p.bytes.length === 1 && k < replay.states.length - 1 ? ' byte' : ''}${replay.fresh[k].has(`${w}:${i}`) ? ' fresh' : ''}`,
      title: `id ${p.id} · bytes ${hex(p.bytes)}`,
      text: tokenLabel(p.bytes),
    })),
    el('span', { class: 'word-gap' }),
  ]));
  document.querySelectorAll('.bpe-steps li.current').forEach((n) => n.classList.remove('current'));
  $(`#bpe-steps [data-step="${k}"]`)?.classList.add('current');
}

function stepRow(k) {
  const ids = idsOf(replay.states[k]).join(',');
  let text;
  if (k === 0) text = `bytes → ${replay.states[0].flat().length} tokens (one per byte, in the model's byte alphabet)`;
  else {
    const s = replay.result.steps[k - 1];
    text = `merge rank ${s.rank}: ${JSON.stringify(s.pair[0])} + ${JSON.stringify(s.pair[1])} → ${JSON.stringify(tokenLabel(s.merged.bytes))} (id ${s.merged.id})${s.at.length > 1 ? ` ×${s.at.length}` : ''}`;
  }
  return el('li', { dataset: { testid: 'bpe-step', step: k, tokenIds: ids }, onclick: () => drawStage(k), text });
}

async function load(text) {
  pending?.abort();
  pending = new AbortController();
  try {
    const result = await inspect.bpe(text, pending.signal);
    replay = { result, ...states(result) };
  } catch (error) {
    if (error.name === 'AbortError') return;
    $('#bpe-summary').replaceChildren(el('span', { class: 'note', text: error.message }));
    return;
  }
  const last = replay.states.length - 1;
  $('#bpe-slider').max = String(last);
  $('#bpe-steps').replaceChildren(...replay.states.map((_, k) => stepRow(k)));
  const same = JSON.stringify(idsOf(replay.states[last])) === JSON.stringify(replay.result.tokenizer_token_ids);
  $('#bpe-summary').replaceChildren(
    el('span', {}, `${new TextEncoder().encode(text).length} bytes → `, el('b', { text: `${idsOf(replay.states[last]).length} tokens` }), ` in ${replay.result.steps.length} merges. Final ids `),
    el('b', { dataset: { testid: 'bpe-final', text }, text: `[${idsOf(replay.states[last]).join(', ')}]` }),
    el('span', { text: same ? ' — the same ids the tokenizer gives.' : ` — the tokenizer gives [${replay.result.tokenizer_token_ids.join(', ')}]` }),
  );
  drawStage(last);
}

export function initBpe() {
  const input = $('#bpe-input');
  const reload = debounce(() => load(input.value), 250);
  input.addEventListener('input', reload);
  $('#bpe-slider').addEventListener('input', (e) => drawStage(Number(e.target.value)));
  on('tab-shown', (tab) => { if (tab === 'bpe' && !replay) load(input.value); });
}
