// View 3, the document: what the model actually read. The chat template's flattening of the selected
// reply's messages, token by token, coloured by author; control tokens boxed; the reply's own tokens
// appended (dashed), since each of them was read back in the steps after it was written. The prompt tokens
// the prefix cache already held (whole KV blocks from the start: the engine's count for this request) are
// shaded apart from those the prefill computed, and the price line bills them both ways.
import { inspect } from './api.js';
import { drawCost, initCost } from './cost.js';
import { emit, on, state } from './state.js';
import { $, el, tokenLabel } from './util.js';

export const AUTHORS = ['template', 'system', 'user', 'assistant', 'tool'];
let loadedFor = null;

function docToken(token, position, { generated, cached, blockStart }) {
  const span = el('span', {
    class: 'dt',
    dataset: {
      testid: 'doc-token', author: token.author, tokenId: token.id, special: token.special ? 'true' : 'false', position,
      generated: generated ? 'true' : undefined, cached: cached ? 'true' : undefined, blockStart: blockStart ? 'true' : undefined,
    },
    title: `#${position} · id ${token.id} · ${token.author}${token.special ? ' · control token' : ''}${generated ? ' · generated' : ''}${cached ? ' · from the prefix cache' : ''}`,
    text: token.special ? token.token : tokenLabel(token.bytes),
  });
  span.addEventListener('click', () => emit('lens-position', { ids: null, position, span }));
  return token.bytes.length === 1 && token.bytes[0] === 10 ? [span, el('br')] : [span];
}

/** A document's tokens as spans: tokens from `prompt` on are generated; the first `cached` came from the
 * prefix cache, and a KV block starts every `blockSize` tokens. */
export function docSpans(tokens, { prompt = tokens.length, cached = 0, blockSize = 0 } = {}) {
  return tokens.flatMap((t, k) => docToken(t, k, {
    generated: k >= prompt, cached: k < cached, blockStart: blockSize > 0 && k > 0 && k < prompt && k % blockSize === 0,
  }));
}

/** Generated tokens ({id, bytes, special}) in the document's shape: the model wrote them. */
export const asGenerated = (tokens) => tokens.map((t) => ({
  id: t.id, bytes: t.bytes, author: 'assistant', special: t.special, token: tokenLabel(t.bytes),
}));

function cacheLine(usage, promptLength) {
  const cached = usage?.prompt_tokens_details?.cached_tokens;
  const block = state.engine?.kv.block_size;
  if (cached === undefined) return el('span', { class: 'hint', text: 'The prefix-cache count comes with the reply\'s usage.' });
  return el('span', {},
    el('b', { dataset: { testid: 'doc-cached', value: cached }, text: `${cached} of ${promptLength}` }),
    ` prompt tokens were already in the prefix cache (shaded: ${block ? `${cached / block} whole blocks of ${block}` : 'whole blocks'} from the start, `
    + `found by the hashes of their tokens and everything before them); the prefill computed the other ${promptLength - cached}.`);
}

async function load(reply) {
  const box = $('#document');
  if (!reply) { box.replaceChildren(el('p', { class: 'hint', text: 'Send a message: its document appears here.' })); return; }
  loadedFor = reply;
  const doc = await inspect.document(reply.messages, undefined, reply.model);
  if (loadedFor !== reply) return;
  const all = [...doc.tokens, ...asGenerated(reply.tokens)];
  const cached = reply.usage?.prompt_tokens_details?.cached_tokens ?? 0;
  box.replaceChildren(...docSpans(all, { prompt: doc.tokens.length, cached, blockSize: state.engine?.kv.block_size }));
  box.dataset.ids = JSON.stringify(all.map((t) => t.id));
  const counts = Object.fromEntries(AUTHORS.map((a) => [a, doc.tokens.filter((t) => t.author === a).length]));
  const same = reply.promptIds && JSON.stringify(reply.promptIds) === JSON.stringify(doc.token_ids);
  $('#doc-legend').replaceChildren(
    ...AUTHORS.map((a) => el('span', { dataset: { author: a }, text: `${a} ${counts[a]}` })),
    el('span', { dataset: { author: 'assistant' }, text: `generated ${reply.tokens.length} (dashed)` }),
    el('b', { text: `${doc.tokens.length} prompt tokens${same ? ' — the very ids the engine prefilled for this reply' : ''}` }),
  );
  $('#doc-cache').replaceChildren(cacheLine(reply.usage, doc.tokens.length));
  drawCost(reply.usage);
}

export function initDocument() {
  initCost();
  const refresh = () => { if (state.tab === 'document') load(state.selected?.reply ?? state.replies.at(-1)).catch(report); };
  on('tab-shown', refresh);
  on('reply-finished', refresh);
  on('step-selected', (sel) => { if (sel.reply !== loadedFor) refresh(); });
}

function report(error) {
  $('#document').replaceChildren(el('p', { class: 'note', text: `Could not load the document: ${error.message}` }));
}
