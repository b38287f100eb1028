// View 2, slow motion: every generated token is a span; selecting one shows that turn of the loop,
// its candidates (top_logprobs, from the very request that produced it), bytes, and timing.
import { postJSON } from './api.js';
import { emit, on, state } from './state.js';
import { $, el, hex, ms, pct, tokenLabel } from './util.js';

let shown = null; // the reply on screen
let replaying = null;

const seconds = (t) => t / 1000;

/** TTFT, TPOT and tokens/s as the page measured them (arrival of the SSE chunks). */
export function timings(reply) {
  const n = reply.tokens.length;
  if (!n) return null;
  const first = reply.tokens[0].at;
  const last = reply.tokens[n - 1].at;
  return {
    ttft: seconds(first - reply.sentAt),
    tpot: n > 1 ? seconds(last - first) / (n - 1) : null,
    rate: n > 1 && last > first ? (n - 1) / seconds(last - first) : null,
    total: seconds(last - reply.sentAt),
  };
}

/** The prompt's prefill so far (return_progress): tokens read of the whole, those from the prefix cache. */
function prefill(p) {
  const cached = p.cached ? ` (${p.cached} from the prefix cache)` : '';
  return el('span', { dataset: { metric: 'progress', processed: p.prompt_tokens_processed, total: p.prompt_tokens_total } },
    'Reading the prompt (prefill): ', el('b', { text: `${p.prompt_tokens_processed} / ${p.prompt_tokens_total} tokens` }), cached);
}

function renderTiming(reply) {
  const box = $('#timing');
  const t = timings(reply);
  if (!t) {
    const p = reply.progress.at(-1);
    box.replaceChildren(p ? prefill(p) : el('span', { class: 'hint', text: 'Waiting for the first token (prefill)…' }));
    return;
  }
  const usage = reply.usage;
  const cached = usage?.prompt_tokens_details?.cached_tokens;
  const item = (label, value, key) => el('span', { dataset: { metric: key } }, `${label} `, el('b', { text: value }));
  const line = el('div', { class: 'timeline' }, el('div', { class: 'prefill' }));
  line.firstChild.style.width = `${(100 * t.ttft) / t.total}%`;
  for (const token of reply.tokens) {
    const tick = el('div', { class: 'tick' });
    tick.style.left = `${(100 * seconds(token.at - reply.sentAt)) / t.total}%`;
    line.append(tick);
  }
  box.replaceChildren(
    item('TTFT', ms(t.ttft), 'ttft'),
    item('TPOT', t.tpot === null ? '–' : ms(t.tpot), 'tpot'),
    item('decode', t.rate === null ? '–' : `${t.rate.toFixed(1)} tokens/s`, 'rate'),
    item('prompt', usage ? `${usage.prompt_tokens} tokens` : reply.promptIds ? `${reply.promptIds.length} tokens` : '–', 'prompt'),
    item('cached prompt', cached === undefined ? '–' : `${cached} tokens`, 'cached'),
    item('prompt read in', `${Math.max(reply.progress.length, 1)} steps`, 'prefill-steps'),
    item('generated', `${reply.tokens.length} tokens`, 'generated'),
    line,
    el('span', { class: 'timeline-legend', text: 'blue: prefill (queue + reading the whole prompt, until the first token) · ticks: each token as it arrived (decode, one forward pass each)' }),
  );
}

function tokenSpan(token, step) {
  const span = el('span', {
    class: `tok${token.special ? ' special' : ''}`,
    dataset: { testid: 'token', tokenId: token.id, step, partial: token.partial ? 'true' : undefined, draft: token.draft ? 'accepted' : undefined },
    title: `step ${step} · id ${token.id}`,
    text: token.special ? tokenLabel(token.bytes) : token.partial ? `‹${hex(token.bytes)}›` : tokenLabel(token.bytes),
  });
  if (token.logprob !== null) span.style.backgroundColor = `hsla(28, 90%, 55%, ${(0.08 + 0.5 * (1 - Math.exp(token.logprob))).toFixed(3)})`;
  span.addEventListener('click', () => select(shown, step));
  if (!token.rejected?.length) return [span];
  // The drafts this token's step rejected: the model wrote its own token in the first one's place.
  const ghost = el('span', { class: 'rejected', dataset: { testid: 'spec-rejected', step, ids: token.rejected.join(',') },
    title: `the model rejected ${token.rejected.length} draft token${token.rejected.length === 1 ? '' : 's'} here (ids ${token.rejected.join(', ')})`,
    text: `✗${token.rejected.length}` });
  return [span, ghost];
}

/** Speculative decoding in this reply: tokens from accepted drafts, rejected drafts, mean accepted length. */
function renderSpec(reply) {
  const box = $('#spec');
  const settings = state.engine?.settings;
  if (!settings?.speculative_method) { box.hidden = true; return; }
  const accepted = reply.tokens.filter((t) => t.draft).length;
  const checks = reply.tokens.filter((t) => t.rejected !== null);
  const rejected = checks.reduce((n, t) => n + t.rejected.length, 0);
  const mean = checks.length ? 1 + accepted / checks.length : null;
  box.hidden = false;
  box.replaceChildren(el('span', { dataset: { testid: 'spec-accepted', value: accepted, rejected, checks: checks.length, mean: mean ?? '' } },
    `Speculative decoding (${settings.speculative_method}, up to ${settings.num_speculative_tokens} drafts a step): `,
    el('b', { text: `${accepted} of ${reply.tokens.length}` }), ' tokens came from drafts the model accepted (underlined green); ',
    el('b', { text: String(rejected) }), ` drafts were rejected (✗) in ${checks.length} verification steps; mean accepted length `,
    el('b', { text: mean === null ? '–' : mean.toFixed(2) }), ' tokens per verification step (its own token included). '
    + 'A verification step runs the drafts through the model in one pass, as a short prefill: reading, not writing.'));
}

function renderTokens(reply) {
  const box = $('#tokens');
  // Append only what is new, so a long reply does not redraw every token per chunk.
  if (box.dataset.reply !== String(state.replies.indexOf(reply))) {
    box.replaceChildren();
    box.dataset.reply = String(state.replies.indexOf(reply));
    box.dataset.count = '0';
  }
  for (let step = Number(box.dataset.count); step < reply.tokens.length; step += 1) box.append(...tokenSpan(reply.tokens[step], step));
  box.dataset.count = String(reply.tokens.length);
  renderSpec(reply);
}

/** The text of the drafts a step rejected (token ids from the stream; /detokenize spells each). */
async function rejectedNote(token) {
  const texts = await Promise.all(token.rejected.map((id) => postJSON('/detokenize', { tokens: [id] }).then((r) => r.prompt)));
  return el('div', { class: 'note', dataset: { testid: 'spec-rejected-note' } },
    `This step checked drafts and the model rejected ${texts.length}: `, ...texts.map((t) => el('s', { class: 'rejected-text', text: tokenLabel(new TextEncoder().encode(t)) })),
    ' — it wrote its own token in the first one\'s place, and the rest were dropped unread.');
}

function candidateRows(token) {
  const rows = [...token.top];
  if (token.logprob !== null && !rows.some((c) => c.id === token.id)) rows.push({ id: token.id, bytes: token.bytes, logprob: token.logprob, outside: true });
  return rows.map((c, k) => {
    const p = Math.exp(c.logprob);
    const bar = el('div', { class: 'bar' });
    bar.style.width = `${100 * p}%`;
    return el('tr', { dataset: { testid: 'candidate', tokenId: c.id, prob: String(p), chosen: c.id === token.id ? 'true' : undefined } },
      el('td', { class: 'num', text: c.outside ? '>20' : String(k + 1) }),
      el('td', { class: 'tk', text: tokenLabel(c.bytes) }),
      el('td', { class: 'num', text: String(c.id) }),
      el('td', { class: 'num', text: hex(c.bytes) }),
      el('td', { class: 'bar-cell' }, bar),
      el('td', { class: 'num', text: pct(p) }),
      el('td', { class: 'num', text: c.logprob.toFixed(3) }));
  });
}

function renderStep(reply, step) {
  const panel = $('#step-panel');
  const token = reply?.tokens[step];
  if (!token) { panel.replaceChildren(el('p', { class: 'hint', text: 'Select a token above to open its step.' })); return; }
  const previous = step === 0 ? reply.sentAt : reply.tokens[step - 1].at;
  const gap = seconds(token.at - previous);
  const phase = step === 0 ? `prefill → first token: ${ms(gap)} after Enter` : `decode: ${ms(gap)} after the previous token${gap < 0.0005 ? ' (same SSE chunk)' : ''}`;
  const rank = token.top.findIndex((c) => c.id === token.id);
  const notes = [];
  if (token.partial) notes.push(`This step printed nothing: its bytes (${hex(token.bytes)}) are only part of a UTF-8 character, so the detokenizer holds them until the rest arrives.`);
  if (token.special) notes.push('A control token: the engine stops here and never shows its text.');
  if (rank > 0) notes.push(`The sampler drew the #${rank + 1} candidate, not the most likely one: the dice, not the argmax.`);
  if (rank < 0 && token.top.length) notes.push('The sampler drew a token outside the top 20.');
  if (token.draft) notes.push('A draft the model accepted: proposed before this step, checked in one pass with the others of its run, and kept because the model would have written it too.');
  panel.replaceChildren(
    el('div', { class: 'step-head' },
      el('span', {}, 'step ', el('b', { text: `${step + 1} / ${reply.tokens.length}` })),
      el('span', {}, 'token id ', el('b', { text: String(token.id) })),
      el('span', {}, 'bytes ', el('b', { text: `[${hex(token.bytes)}]` })),
      el('span', {}, 'p ', el('b', { text: token.logprob === null ? '–' : pct(Math.exp(token.logprob)) })),
      el('span', { text: phase }),
      el('span', { text: `position ${reply.promptIds ? reply.promptIds.length + step : '?'} in the document` })),
    ...notes.map((n) => el('div', { class: 'note', text: n })),
    el('table', { class: 'cands' },
      el('thead', {}, el('tr', {}, ...['#', 'token', 'id', 'bytes', '', 'p', 'logprob'].map((h) => el('th', { text: h })))),
      el('tbody', {}, candidateRows(token))),
    el('div', { class: 'actions' },
      ...[['lab', 'Sampling lab for this step'], ['lens', 'Logit lens at this step'], ['tree', 'Name tree of this reply']]
        .map(([tab, label]) => el('button', { type: 'button', class: 'ghost', text: label, onclick: () => emit('show-tab', tab) }))),
  );
  if (token.rejected?.length) {
    rejectedNote(token).then((note) => { if (state.selected?.step === step) panel.querySelector('table').before(note); }).catch(() => {});
  }
}

export function select(reply, step) {
  state.selected = { reply, step };
  document.querySelectorAll('.tok.selected').forEach((n) => n.classList.remove('selected'));
  $(`#tokens .tok[data-step="${step}"]`)?.classList.add('selected');
  renderStep(reply, step);
  emit('step-selected', state.selected);
}

function show(reply) {
  shown = reply;
  renderTiming(reply);
  renderTokens(reply);
}

/** Reveals the shown reply again, token by token, at its measured pace slowed down. */
function replay(slowdown = 4) {
  if (!shown?.tokens.length) return;
  clearTimeout(replaying);
  const spans = Array.from($('#tokens').querySelectorAll('.tok'));
  spans.forEach((s) => s.classList.add('hidden-replay'));
  const times = shown.tokens.map((t) => (t.at - shown.sentAt) * slowdown);
  const start = performance.now();
  const tick = () => {
    const now = performance.now() - start;
    spans.forEach((s, k) => { if (times[k] <= now) s.classList.remove('hidden-replay'); });
    if (now < times.at(-1)) replaying = setTimeout(tick, 16);
  };
  tick();
}

export function initSteps() {
  on('reply-selected', (reply) => { $('#tokens').dataset.reply = ''; show(reply); });
  on('reply-updated', (reply) => { if (reply === shown) show(reply); });
  on('reply-finished', (reply) => {
    if (reply !== shown || !reply.tokens.length) return;
    if (!state.selected || state.selected.reply !== reply) select(reply, 0);
    else renderStep(reply, state.selected.step);
  });
  $('#replay').addEventListener('click', () => replay());
  renderStep(null, 0);
}
