// The models this server serves (/v1/models), each loaded, loading or not loaded: the one picked here is the
// one every request of the page names, so the next message to a model that is not loaded loads it. Each
// reply says which model answered it (chat.js).
import { ApiError, getJSON, KEY_NEEDED } from './api.js';
import { emit, on, state } from './state.js';
import { $, el } from './util.js';

const POLL_MS = 3000;

/** The page's first model: one loaded, else the first listed. */
function pick(models) {
  return (models.find((m) => (m.state ?? 'loaded') === 'loaded') ?? models[0]).id;
}

function render() {
  const select = $('#model-select');
  select.replaceChildren(...state.models.map((m) => el('option', {
    value: m.id, text: m.state ? `${m.id} (${m.state})` : m.id, dataset: { state: m.state ?? 'loaded' },
  })));
  select.value = state.model;
  select.disabled = state.models.length < 2;
}

async function refresh() {
  const { data } = await getJSON('/v1/models');
  state.models = data.map((m) => ({ id: m.id, state: m.state ?? null }));
  if (!state.models.some((m) => m.id === state.model)) {
    state.model = pick(state.models);
    emit('model-changed', state.model);
  }
  render();
}

/** No list: the server wants a key, or its one model is loading (503). */
function failed(error) {
  const banner = $('#banner');
  banner.hidden = false;
  banner.textContent = error instanceof ApiError && error.status === 401 ? KEY_NEEDED : 'The model is loading…';
}

let timer = null;

function poll() {
  clearTimeout(timer);
  // Until the first list, ask again soon.
  refresh().catch(failed).finally(() => { timer = setTimeout(poll, state.models.length ? POLL_MS : 500); });
}

export function initModels() {
  $('#model-select').addEventListener('change', (event) => {
    state.model = event.target.value;
    emit('model-changed', state.model);
  });
  on('reply-finished', poll); // the reply may have loaded its model
  poll();
}
