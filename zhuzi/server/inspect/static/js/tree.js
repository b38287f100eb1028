// View 7, a name's probability tree: the first two tokens of the selected reply as nested boxes whose
// widths are probabilities (the second row conditional on the first), under the lab's knobs.
import { decodeLogits, inspect } from './api.js';
import { setLab } from './lab.js';
import { distribution, ranked } from './sampling.js';
import { on, state } from './state.js';
import { $, el, pct, tokenLabel } from './util.js';

const EXPANDED = 6; // first tokens whose second token is fetched (the most likely at T = 1)
const SHOWN = 12; // boxes drawn per row before the rest is one grey box

let tree = null; // {reply, first: {logits, top}, children: Map(id -> {logits, top})}
let loading = null; // {reply, promise}: one fetch per reply, however many views ask

function load(reply) {
  if (tree?.reply === reply) return Promise.resolve();
  if (loading?.reply !== reply) loading = { reply, promise: fetchTree(reply).finally(() => { loading = null; }) };
  return loading.promise;
}

async function fetchTree(reply) {
  const prompt = reply.promptIds;
  const first = (await inspect.nextToken([prompt], 200, true, reply.model)).results[0];
  const expand = first.top.slice(0, EXPANDED).map((t) => t.id);
  const chosen = reply.tokens[0]?.id;
  if (chosen !== undefined && !expand.includes(chosen)) expand.push(chosen);
  const second = await inspect.nextToken(expand.map((id) => [...prompt, id]), 200, true, reply.model);
  const pack = (r) => ({ logits: decodeLogits(r.logits_b64), top: new Map(r.top.map((t) => [t.id, t])) });
  if (state.selected && state.selected.reply !== reply) return; // another reply was chosen meanwhile
  tree = {
    reply, first: pack(first),
    children: new Map(expand.map((id, k) => [id, pack(second.results[k])])),
  };
}

/** A row's boxes: the top surviving tokens by probability, then the rest of the surviving mass in grey. */
function row(level, probs, top, chosen) {
  const ids = ranked(probs, SHOWN);
  const items = ids.map((id, k) => {
    const node = el('div', { class: `tree-box${id === chosen ? ' chosen' : ''}`, dataset: { testid: `tree-${level}`, tokenId: id, prob: String(probs[id]) } },
      el('span', { text: top.has(id) ? tokenLabel(top.get(id).bytes) : `#${id}` }), el('span', { text: pct(probs[id]) }));
    node.style.background = `hsl(${(28 + k * 47) % 360}, 70%, ${level === 'first' ? 78 : 86}%)`;
    return { id, p: probs[id], node };
  });
  const rest = 1 - items.reduce((sum, item) => sum + item.p, 0);
  if (rest > 1e-6) items.push({ id: null, p: rest, node: el('div', { class: 'tree-box other', dataset: { testid: `tree-${level}-rest`, prob: String(rest) }, text: 'rest' }) });
  return items;
}

const width = (node, p) => { node.style.flex = `0 0 ${100 * p}%`; return node; };

function draw() {
  if (!tree) return;
  const { reply } = tree;
  const [c1, c2] = [reply.tokens[0]?.id, reply.tokens[1]?.id];
  const firstProbs = distribution(tree.first.logits, state.lab).probs;
  const secondProbs = new Map([...tree.children].map(([id, child]) => [id, distribution(child.logits, state.lab).probs]));
  const columns = row('first', firstProbs, tree.first.top, c1).map(({ id, p, node }) => {
    const inner = el('div', { class: 'tree-row level2' });
    const child = tree.children.get(id);
    if (child) inner.append(...row('second', secondProbs.get(id), child.top, id === c1 ? c2 : undefined).map((item) => width(item.node, item.p)));
    else inner.append(el('div', { class: 'tree-box other', text: id === null ? '' : 'not expanded' }));
    return width(el('div', { class: 'tree-col' }, node, inner), p);
  });
  $('#tree').replaceChildren(el('div', { class: 'tree-row' }, ...columns));
  const p1 = firstProbs[c1] ?? 0;
  const p2 = secondProbs.get(c1)?.[c2] ?? 0;
  const name = (id, top) => JSON.stringify(tokenLabel(top?.get(id)?.bytes ?? []));
  $('#tree-note').textContent = c1 === undefined ? '' :
    `This reply began ${name(c1, tree.first.top)} + ${name(c2, tree.children.get(c1)?.top)}: P = ${pct(p1)} × ${pct(p2)} ≈ ${pct(p1 * p2)} under these settings. ` +
    `Each row shows its top ${SHOWN} survivors; grey is the rest of the surviving mass.`;
}

async function show() {
  if (state.tab !== 'tree') return;
  const reply = state.selected?.reply ?? state.replies.at(-1);
  if (!reply?.promptIds) { $('#tree-note').textContent = 'Send a message first: the tree grows from its reply.'; return; }
  $('#tree-note').textContent = 'Asking the engine for the first two tokens…';
  await load(reply);
  draw();
}

export function initTree() {
  const bind = (sel, key) => $(sel).addEventListener('input', () => {
    const v = Number($(sel).value);
    if ($(sel).value !== '' && !Number.isNaN(v)) setLab({ [key]: v });
  });
  bind('#tree-temperature', 'temperature');
  bind('#tree-top-p', 'top_p');
  on('lab-changed', (lab) => {
    $('#tree-temperature').value = String(lab.temperature);
    $('#tree-top-p').value = String(lab.top_p);
    draw();
  });
  on('tab-shown', () => show().catch(report));
  on('step-selected', () => show().catch(report));
}

function report(error) {
  $('#tree-note').replaceChildren(el('span', { class: 'note', text: `Could not grow the tree: ${error.message}` }));
}
