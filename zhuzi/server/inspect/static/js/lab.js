// View 4, the sampling lab: the engine's real next-token logits for the selected step, re-cut with the
// sampler's own rule (sampling.js) as the knobs move.
import { decodeLogits, inspect } from './api.js';
import { distribution, ranked } from './sampling.js';
import { emit, on, state } from './state.js';
import { $, el, pct, tokenLabel } from './util.js';

const TOP_N = 300; // the candidates the server sends with their text
const SHOWN_CUT = 40; // cut candidates listed below the survivors

const cache = new Map(); // "reply index:step" -> {logits, top}
let current = null;

/** The engine's distribution for a step: from cache or one /inspect/next-token call. */
export async function stepLogits(reply, step) {
  const key = `${state.replies.indexOf(reply)}:${step}`;
  if (!cache.has(key)) {
    const pending = inspect.nextToken([reply.context(step)], TOP_N, true, reply.model).then((r) => ({
      logits: decodeLogits(r.results[0].logits_b64), top: r.results[0].top, cached: r.results[0].cached_tokens,
    }));
    pending.catch(() => cache.delete(key)); // a failure is not remembered: the next look asks again
    cache.set(key, pending);
  }
  return cache.get(key);
}

function knobs() {
  return [['temperature', '#lab-temperature'], ['top_k', '#lab-top-k'], ['top_p', '#lab-top-p'], ['min_p', '#lab-min-p']];
}

export function setLab(values) {
  Object.assign(state.lab, values);
  for (const [key, sel] of knobs()) $(sel).value = String(state.lab[key]);
  emit('lab-changed', state.lab);
}

function row(entry, p, chosen, cut) {
  const bar = el('div', { class: 'bar' });
  bar.style.width = `${100 * (cut ? Math.exp(entry.logprob) : p)}%`;
  return el('li', { class: chosen ? 'chosen' : '', dataset: { testid: cut ? 'lab-cut' : 'lab-candidate', tokenId: entry.id, prob: String(p) } },
    el('span', { class: 'num', text: String(entry.id) }),
    el('span', { class: 'tk', text: tokenLabel(entry.bytes) }),
    el('span', { class: 'num', text: entry.logit.toFixed(2) }),
    bar,
    el('span', { class: 'num', text: cut ? 'cut' : pct(p) }));
}

function draw() {
  if (!current) return;
  const { reply, step, data } = current;
  const { probs, kept, greedy } = distribution(data.logits, state.lab);
  const chosen = reply.tokens[step]?.id;
  const byId = new Map(data.top.map((t) => [t.id, t]));
  const survivors = ranked(probs, TOP_N);
  const inTop = survivors.filter((id) => byId.has(id));
  const cut = data.top.filter((t) => probs[t.id] === 0).slice(0, SHOWN_CUT);
  const shownMass = inTop.reduce((s, id) => s + probs[id], 0);
  const list = $('#lab-list');
  list.replaceChildren(
    el('li', { class: 'head' }, ...['id', 'token', 'logit', 'p after the cuts', ''].map((h) => el('span', { text: h }))),
    ...inTop.map((id) => row(byId.get(id), probs[id], id === chosen, false)),
    kept > inTop.length ? el('li', { class: 'more', text: `… ${kept - inTop.length} more surviving tokens outside the engine's top ${TOP_N}, holding ${pct(1 - shownMass)} together` }) : null,
    ...cut.map((t) => row(t, 0, t.id === chosen, true)),
  );
  $('#lab-summary').replaceChildren(
    el('span', {}, 'step ', el('b', { text: String(step + 1) }), ` · ${greedy ? 'greedy (T below 1e-5): only the argmax' : `${kept} of ${data.logits.length} tokens survive`}`),
    el('span', { text: ` · the reply drew id ${chosen} (p here ${pct(probs[chosen] ?? 0)})` }),
    el('span', { text: ` · re-run through the step loop, ${data.cached} of ${reply.context(step).length} tokens from the prefix cache` }),
    state.engine?.model.dtype === 'float32' ? null : el('span', { text: ` · in ${state.engine?.model.dtype ?? 'bf16'} the re-run's last tokens take the prefill path, so its probabilities can differ from the step's own by a few 0.1%` }),
  );
}

async function load() {
  const sel = state.selected;
  if (!sel || state.tab !== 'lab') return;
  if (current && current.reply === sel.reply && current.step === sel.step) { draw(); return; }
  $('#lab-summary').textContent = 'Asking the engine for this step\'s logits…';
  const data = await stepLogits(sel.reply, sel.step);
  if (state.selected !== sel) return;
  current = { ...sel, data };
  draw();
}

export function initLab() {
  for (const [key, sel] of knobs()) {
    $(sel).addEventListener('input', () => {
      const v = Number($(sel).value);
      if ($(sel).value === '' || Number.isNaN(v)) return;
      setLab({ [key]: v });
    });
  }
  setLab(state.lab);
  on('lab-changed', draw);
  on('tab-shown', () => load().catch(report));
  on('step-selected', () => load().catch(report));
  on('reply-selected', (reply) => {
    // the lab starts from the settings the reply was sampled with
    const p = reply.params;
    setLab({ temperature: p.temperature ?? 1, top_k: p.top_k ?? 0, top_p: p.top_p ?? 1, min_p: p.min_p ?? 0 });
  });
  $('#lab-summary').textContent = 'Select a step of a reply (Slow motion) to see its distribution.';
}

function report(error) {
  $('#lab-summary').replaceChildren(el('span', { class: 'note', text: `Could not load the distribution: ${error.message}` }));
}
