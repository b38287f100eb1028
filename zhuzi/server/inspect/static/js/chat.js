// View 1, chat: streams a reply over /v1/chat/completions (fetch + SSE reader), Stop aborts it in the
// engine, the history stays here and goes out whole each turn.
import { ApiError, postSSE, tokenId } from './api.js';
import { render } from './markdown.js';
import { emit, Reply, specialIds, state } from './state.js';
import { $, el } from './util.js';

let controller = null;
const input = () => $('#chat-input');

function settings() {
  const num = (id) => { const v = $(id).value; return v === '' ? null : Number(v); };
  const params = {
    temperature: num('#set-temperature'), top_p: num('#set-top-p'), top_k: num('#set-top-k'),
    min_p: num('#set-min-p'), max_tokens: num('#set-max-tokens'), seed: num('#set-seed'),
  };
  return Object.fromEntries(Object.entries(params).filter(([, v]) => v !== null));
}

function messagesToSend() {
  const system = $('#system-prompt').value.trim();
  return [...(system ? [{ role: 'system', content: system }] : []), ...state.history];
}

function bubble(role, text) {
  const node = el('li', { class: `msg ${role}`, dataset: { testid: `message-${role}` } });
  if (role === 'user') node.textContent = text;
  $('#messages').append(node);
  node.scrollIntoView({ block: 'end' });
  return node;
}

function selectReply(reply, node) {
  document.querySelectorAll('.msg.assistant.selected').forEach((n) => n.classList.remove('selected'));
  node.classList.add('selected');
  emit('reply-selected', reply);
}

export async function send(text) {
  if (controller || !text.trim()) return;
  state.history.push({ role: 'user', content: text });
  bubble('user', text);
  const reply = new Reply(messagesToSend(), settings());
  state.replies.push(reply);
  const node = bubble('assistant');
  node.dataset.state = 'streaming';
  const thinking = el('div', { class: 'thinking' });
  const body = el('div', { class: 'body' });
  const meta = el('div', { class: 'meta' });
  node.append(thinking, body, meta);
  node.addEventListener('click', () => selectReply(reply, node));
  selectReply(reply, node);
  controller = new AbortController();
  emit('reply-started', reply);
  $('#send').disabled = true;
  $('#stop').disabled = false;
  let frame = 0;
  const paint = () => {
    frame = 0;
    thinking.textContent = reply.reasoning;
    render(body, reply.content);
    node.scrollIntoView({ block: 'end' });
  };
  try {
    const request = {
      messages: reply.messages, stream: true, stream_options: { include_usage: true }, return_progress: true,
      logprobs: true, top_logprobs: 20, return_token_ids: true, return_tokens_as_token_ids: true,
      ...reply.params,
    };
    for await (const chunk of postSSE('/v1/chat/completions', request, controller.signal)) {
      absorb(reply, chunk, performance.now());
      if (reply.id) node.dataset.requestId = reply.id;
      if (reply.model) node.dataset.model = reply.model;
      emit('reply-updated', reply);
      if (!frame) frame = requestAnimationFrame(paint);
    }
  } catch (error) {
    if (controller.signal.aborted) reply.finishReason = 'abort';
    else {
      reply.error = error instanceof ApiError ? error.message : String(error);
      node.classList.add('error');
    }
  } finally {
    cancelAnimationFrame(frame);
    paint();
    controller = null;
    $('#send').disabled = false;
    $('#stop').disabled = true;
    if (reply.error) state.history.pop(); // the turn failed: it is not part of the conversation
    else state.history.push({ role: 'assistant', content: reply.content });
    meta.textContent = reply.error ? `error: ${reply.error}` : summary(reply);
    node.dataset.state = reply.error ? 'error' : reply.finishReason === 'abort' ? 'stopped' : 'done';
    emit('reply-updated', reply);
    emit('reply-finished', reply);
  }
}

function summary(reply) {
  const n = reply.tokens.length;
  const reason = { stop: 'finished', length: 'hit max tokens', abort: 'stopped' }[reply.finishReason] || reply.finishReason;
  return `${reply.model} · ${n} tokens · ${reason}`;
}

/** One SSE chunk into the reply: text, reasoning, and each token with its candidates and arrival time. */
export function absorb(reply, chunk, now) {
  reply.id = chunk.id; // the request's own id: the batch view marks its rows with it
  reply.model = chunk.model; // the model that answers
  if (chunk.prompt_token_ids) reply.promptIds = chunk.prompt_token_ids;
  if (chunk.usage) reply.usage = chunk.usage;
  if (chunk.prompt_progress) reply.progress.push(chunk.prompt_progress);
  const choice = chunk.choices?.[0];
  if (!choice) return;
  reply.content += choice.delta?.content || '';
  reply.reasoning += choice.delta?.reasoning_content || '';
  if (choice.finish_reason) reply.finishReason = choice.finish_reason;
  const entries = choice.logprobs?.content || [];
  const ids = choice.token_ids || entries.map((e) => tokenId(e.token));
  const specials = specialIds();
  ids.forEach((id, k) => {
    const entry = entries[k];
    const token = {
      id, at: now, bytes: entry ? entry.bytes : [], logprob: entry?.logprob ?? null,
      top: (entry?.top_logprobs || []).map((t) => ({ id: tokenId(t.token), bytes: t.bytes, logprob: t.logprob })),
      special: specials.has(id),
      draft: choice.draft_accepted?.[k] ?? false, // speculative decoding: a draft the model accepted
      rejected: choice.drafts_rejected?.[k] ?? null, // the drafts this token's step rejected
    };
    // Whether this step printed anything: the bytes so far, decoded as a stream, end mid-character or not.
    token.text = token.special ? '' : reply.decoder.decode(Uint8Array.from(token.bytes), { stream: true });
    token.partial = !token.special && token.bytes.length > 0 && token.text === '';
    reply.tokens.push(token);
  });
}

export function initChat() {
  $('#composer').addEventListener('submit', (e) => {
    e.preventDefault();
    if (controller) return; // one reply at a time: keep what was typed
    const text = input().value;
    input().value = '';
    send(text);
  });
  input().addEventListener('keydown', (e) => {
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $('#composer').requestSubmit();
    }
  });
  $('#stop').addEventListener('click', () => controller?.abort());
  $('#new-chat').addEventListener('click', () => {
    if (controller) return;
    state.history = [];
    $('#messages').replaceChildren();
  });
}

export const isStreaming = () => controller !== null;
