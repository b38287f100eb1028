// View 5, the logit lens: at one position, each layer's residual stream read out through the final norm
// and the LM head (/inspect/logit-lens), one row per layer.
import { inspect } from './api.js';
import { on, state } from './state.js';
import { $, el, heat, pct, tokenLabel } from './util.js';

const TOP_K = 5;
let target = null; // {ids, next, label}
let loaded = null;

function fromStep(sel) {
  const { reply, step } = sel;
  const ids = reply.context(step);
  return { ids, model: reply.model, next: reply.tokens[step]?.id, label: `the last position before step ${step + 1} (predicting the reply's token ${step + 1})` };
}

async function load() {
  if (!target || state.tab !== 'lens' || loaded === target) return;
  const wanted = target;
  $('#lens-head').textContent = 'Reading every layer…';
  const lens = await inspect.lens(wanted.ids, TOP_K, wanted.model);
  if (wanted !== target) return;
  loaded = wanted;
  const final = lens.layers.at(-1).top[0].id;
  $('#lens-head').replaceChildren(
    el('span', {}, 'position ', el('b', { text: String(lens.position) }), ` (token ${lens.token.id} ${JSON.stringify(tokenLabel(lens.token.bytes))}), ${wanted.label}. `),
    el('span', { text: `${lens.layers.length} layers; outlined: the token that actually came next. The last row is the model's real output.` }),
  );
  $('#lens-rows').replaceChildren(...lens.layers.map((layer) => el('tr', { dataset: { testid: 'lens-row', layer: layer.layer } },
    el('td', { class: 'layer', text: `layer ${layer.layer + 1}` }),
    ...layer.top.map((t) => {
      const p = Math.exp(t.logprob);
      const cell = el('td', { class: `cell${t.id === wanted.next ? ' next' : ''}`, dataset: { tokenId: t.id, prob: String(p) }, title: `id ${t.id} · p ${pct(p)}${t.id === final ? ' · the final answer' : ''}`, text: `${tokenLabel(t.bytes)} ${pct(p)}` });
      heat(cell, p, t.id === final ? 28 : 210);
      return cell;
    }))));
}

export function initLens() {
  on('step-selected', (sel) => { target = fromStep(sel); load().catch(report); });
  on('lens-position', ({ position, span }) => {
    const ids = JSON.parse(span.closest('[data-ids]').dataset.ids);
    document.querySelectorAll('.dt.selected').forEach((n) => n.classList.remove('selected'));
    span.classList.add('selected');
    target = { ids: ids.slice(0, position + 1), next: ids[position + 1], label: 'chosen in the document' };
    load().catch(report);
  });
  on('tab-shown', () => load().catch(report));
  $('#lens-head').textContent = 'Select a step (Slow motion) or a token of the document.';
}

function report(error) {
  $('#lens-head').replaceChildren(el('span', { class: 'note', text: `Could not read the layers: ${error.message}` }));
}
