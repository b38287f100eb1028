// View 3, the document: what the model actually read. The chat template's flattening of the selected
// reply's messages, token by token, coloured by author; control tokens boxed; the reply's own tokens
// appended (dashed), since each of them was read back in the steps after it was written.
import { inspect } from './api.js';
import { emit, on, state } from './state.js';
import { $, el, tokenLabel } from './util.js';

const AUTHORS = ['template', 'system', 'user', 'assistant', 'tool'];
let loadedFor = null;

function docToken(token, position, generated = false) {
  const span = el('span', {
    class: 'dt',
    dataset: { testid: 'doc-token', author: token.author, tokenId: token.id, special: token.special ? 'true' : 'false', position, generated: generated ? 'true' : undefined },
    title: `#${position} · id ${token.id} · ${token.author}${token.special ? ' · control token' : ''}${generated ? ' · generated' : ''}`,
    text: token.special ? token.token : tokenLabel(token.bytes),
  });
  span.addEventListener('click', () => emit('lens-position', { ids: null, position, span }));
  return token.bytes.length === 1 && token.bytes[0] === 10 ? [span, el('br')] : [span];
}

async function load(reply) {
  const box = $('#document');
  if (!reply) { box.replaceChildren(el('p', { class: 'hint', text: 'Send a message: its document appears here.' })); return; }
  loadedFor = reply;
  const doc = await inspect.document(reply.messages);
  if (loadedFor !== reply) return;
  const generated = reply.tokens.map((t) => ({ id: t.id, bytes: t.bytes, author: 'assistant', special: t.special, token: tokenLabel(t.bytes) }));
  const all = [...doc.tokens, ...generated];
  box.replaceChildren(...all.flatMap((t, k) => docToken(t, k, k >= doc.tokens.length)));
  box.dataset.ids = JSON.stringify(all.map((t) => t.id));
  const counts = Object.fromEntries(AUTHORS.map((a) => [a, doc.tokens.filter((t) => t.author === a).length]));
  const same = reply.promptIds && JSON.stringify(reply.promptIds) === JSON.stringify(doc.token_ids);
  $('#doc-legend').replaceChildren(
    ...AUTHORS.map((a) => el('span', { dataset: { author: a }, text: `${a} ${counts[a]}` })),
    el('span', { dataset: { author: 'assistant' }, text: `generated ${generated.length} (dashed)` }),
    el('b', { text: `${doc.tokens.length} prompt tokens${same ? ' — the very ids the engine prefilled for this reply' : ''}` }),
  );
}

export function initDocument() {
  const refresh = () => { if (state.tab === 'document') load(state.selected?.reply ?? state.replies.at(-1)).catch(report); };
  on('tab-shown', refresh);
  on('reply-finished', refresh);
  on('step-selected', (sel) => { if (sel.reply !== loadedFor) refresh(); });
}

function report(error) {
  $('#document').replaceChildren(el('p', { class: 'note', text: `Could not load the document: ${error.message}` }));
}
