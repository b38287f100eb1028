// The page's only door to the server: the OpenAI chat API and the /inspect endpoints. Every request names the
// model picked in the page (models.js), unless it names its own.
import { state } from './state.js';

const KEY = 'zhuzi.apiKey';

export const apiKey = {
  get: () => localStorage.getItem(KEY) || '',
  set: (value) => (value ? localStorage.setItem(KEY, value) : localStorage.removeItem(KEY)),
};

export const KEY_NEEDED = 'This server wants an API key: click "API key" (top right) to enter it.';

export class ApiError extends Error {
  constructor(status, body) {
    super(body?.error?.message || `HTTP ${status}`);
    this.status = status;
    this.body = body;
  }
}

function headers() {
  const h = { 'Content-Type': 'application/json' };
  if (apiKey.get()) h.Authorization = `Bearer ${apiKey.get()}`;
  return h;
}

async function check(response) {
  if (response.ok) return response;
  let body = null;
  try { body = await response.json(); } catch { /* not JSON: keep the status */ }
  throw new ApiError(response.status, body);
}

export async function getJSON(path, signal) {
  return (await check(await fetch(path, { headers: headers(), signal }))).json();
}

/** The body, naming the page's model where it names none. */
const named = (body) => JSON.stringify({ ...body, model: body.model ?? state.model ?? undefined });

/** A view's query: the page's model and the given parameters. */
function query(params) {
  const all = { ...params, model: state.model };
  return new URLSearchParams(Object.entries(all).filter(([, v]) => v !== null && v !== undefined)).toString();
}

export async function postJSON(path, body, signal) {
  const response = await fetch(path, { method: 'POST', headers: headers(), body: named(body), signal });
  return (await check(response)).json();
}

/** POST that answers with server-sent events; yields each event's parsed data until [DONE]. */
export async function* postSSE(path, body, signal) {
  const response = await check(await fetch(path, {
    method: 'POST', headers: headers(), body: named(body), signal,
  }));
  yield* readEvents(response.body, signal);
}

/** The SSE wire format: events separated by a blank line, each "data: ..." line carrying JSON. */
export async function* readEvents(stream, signal) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replaceAll('\r\n', '\n');
      let cut;
      while ((cut = buffer.indexOf('\n\n')) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = event.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart()).join('\n');
        if (!data) continue;
        if (data === '[DONE]') return;
        const parsed = JSON.parse(data);
        if (parsed.error) throw new ApiError(500, parsed);
        yield parsed;
      }
    }
  } finally {
    if (!signal?.aborted) reader.cancel().catch(() => {});
  }
}

/** Token ids come back as "token_id:N" when the request sets return_tokens_as_token_ids. */
export const tokenId = (token) => Number(token.slice('token_id:'.length));

export const inspect = {
  engine: (steps = 0) => getJSON(`/inspect/engine?${query({ steps })}`),
  batch: (steps, requestId) => getJSON(`/inspect/batch?${query({ steps, request_id: requestId || null })}`),
  document: (messages, tools, model) => postJSON('/inspect/document', tools ? { messages, tools, model } : { messages, model }),
  // A look at a reply names the model that answered it (model), else the page's.
  nextToken: (contexts, topN = 300, full = true, model = undefined) =>
    postJSON('/inspect/next-token', { contexts, top_n: topN, full_logits: full, model }),
  lens: (tokenIds, topK = 5, model = undefined) => postJSON('/inspect/logit-lens', { token_ids: tokenIds, top_k: topK, model }),
  bpe: (text, signal) => postJSON('/inspect/bpe', { text }, signal),
};

/** The float32 logits of a next-token result (base64, little-endian). */
export function decodeLogits(b64) {
  const raw = atob(b64);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i += 1) bytes[i] = raw.charCodeAt(i);
  return new Float32Array(bytes.buffer);
}
