// The inspector page: a chat on the OpenAI API, and views that show what the engine did for each reply.
import { apiKey } from './api.js';
import { initBatch } from './batch.js';
import { initBpe } from './bpe.js';
import { initChat } from './chat.js';
import { initDivergence } from './divergence.js';
import { initDocument } from './document.js';
import { initEngine } from './engine.js';
import { initLab } from './lab.js';
import { initLens } from './lens.js';
import { initModels } from './models.js';
import { emit, on, state } from './state.js';
import { initSteps } from './steps.js';
import { initTools } from './tools.js';
import { initTree } from './tree.js';
import { $ } from './util.js';

function showTab(name) {
  state.tab = name;
  for (const button of document.querySelectorAll('.tabs [data-tab]')) {
    button.setAttribute('aria-selected', String(button.dataset.tab === name));
  }
  for (const view of document.querySelectorAll('.view')) view.hidden = view.id !== `view-${name}`;
  emit('tab-shown', name);
}

function init() {
  for (const button of document.querySelectorAll('.tabs [data-tab]')) {
    button.addEventListener('click', () => showTab(button.dataset.tab));
  }
  $('#key-button').addEventListener('click', () => {
    const key = prompt('API key for this server (stored in this browser only; empty to clear):', apiKey.get());
    if (key !== null) apiKey.set(key.trim());
  });
  initModels();
  initChat();
  initSteps();
  initDocument();
  initLab();
  initLens();
  initBpe();
  initTree();
  initEngine();
  initBatch();
  initDivergence();
  initTools();
  on('show-tab', showTab);
  showTab('steps');
}

init();
