// The page's shared state and the events the views listen to. The history lives here, client-side:
// the model keeps nothing between requests, so every turn sends it whole.

export const bus = new EventTarget();
export const emit = (name, detail) => bus.dispatchEvent(new CustomEvent(name, { detail }));
export const on = (name, fn) => bus.addEventListener(name, (e) => fn(e.detail));

export const state = {
  history: [], // {role, content} turns sent with every request
  replies: [], // Reply objects, one per assistant turn
  selected: null, // {reply, step}: the step the lab, lens and tree look at
  lab: { temperature: 1, top_k: 0, top_p: 1, min_p: 0 }, // the lab's knobs (the tree shares them)
  engine: null, // the latest /inspect/engine snapshot
  model: null, // the model the page's requests name (models.js)
  models: [], // what /v1/models lists: {id, state} (a server of one model gives no state)
  tab: 'steps',
};

/** One assistant reply: what was sent, and each token as it arrived. */
export class Reply {
  constructor(messages, params) {
    this.messages = messages; // exactly what the request carried
    this.params = params;
    this.id = null; // the chat completion's id
    this.model = null; // the model that answered
    this.promptIds = null;
    this.tokens = []; // {id, bytes, logprob, top: [{id, bytes, logprob}], at, text, partial, special, draft, rejected}
    this.content = '';
    this.reasoning = '';
    this.finishReason = null;
    this.usage = null;
    this.progress = []; // the prompt's prefill, step by step, before the first token (return_progress)
    this.sentAt = performance.now();
    this.error = null;
    this.decoder = new TextDecoder('utf-8'); // a stream: tells which steps ended mid-character
  }

  get ids() { return this.tokens.map((t) => t.id); }

  /** The token ids the model had read when it chose token `step`. */
  context(step) { return [...this.promptIds, ...this.ids.slice(0, step)]; }
}

export function specialIds() {
  return new Set(state.engine?.model?.special_token_ids ?? []);
}

/** Whether the page's model is loaded, as /v1/models said last (a look at a model loads none). */
export function modelLoaded() {
  const model = state.models.find((m) => m.id === state.model);
  return model !== undefined && (model.state ?? 'loaded') === 'loaded';
}
