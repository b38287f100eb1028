// The tool round trip, one step per Next: the model writes a call, this page runs the tool (toolbox.js), the
// result goes back as a `tool` message, the model answers. At each step the document grows, coloured by
// who wrote each token (the model, the program, the template, the user), and each request's cached prefix
// is shaded: a tool call is the same loop, turned a few more times, mostly re-reading what it has read.
import { inspect, postJSON } from './api.js';
import { asGenerated, docSpans } from './document.js';
import { specialIds, state } from './state.js';
import { runTool, TOOLS } from './toolbox.js';
import { $, el } from './util.js';

const PRESETS = {
  calculator: 'What is 1234 * 5678 + 9?',
  city_time: 'What time is it in Tokyo right now?',
};
const STEPS = ['The model writes the call', 'The program runs the tool', 'The result goes back as a tool message', 'The model answers'];

let trip = null; // {step, messages, doc, requests, call, result, tool}

/** One chat request with the page's tools; its generated tokens in the document's shape. */
async function ask(messages, toolChoice) {
  const r = await postJSON('/v1/chat/completions', {
    messages, tools: TOOLS, tool_choice: toolChoice, temperature: 0, max_tokens: 96, logprobs: true, return_token_ids: true,
  });
  const c = r.choices[0];
  const specials = specialIds();
  const generated = asGenerated(c.token_ids.map((id, k) => ({ id, bytes: c.logprobs.content[k].bytes, special: specials.has(id) })));
  return { id: r.id, usage: r.usage, message: c.message, generated };
}

function commonPrefix(a, b) {
  let n = 0;
  while (n < a.length && n < b.length && a[n] === b[n]) n += 1;
  return n;
}

function drawDocument(tokens, prompt, cached) {
  const box = $('#tool-doc');
  box.replaceChildren(...docSpans(tokens, { prompt, cached, blockSize: state.engine?.kv.block_size }));
  box.dataset.ids = JSON.stringify(tokens.map((t) => t.id));
  box.dataset.prompt = String(prompt);
  box.dataset.cached = String(cached);
}

function drawRequests() {
  $('#tool-requests').replaceChildren(...trip.requests.map((r, k) => {
    const cached = r.usage.prompt_tokens_details?.cached_tokens ?? 0;
    return el('li', { dataset: { testid: 'tool-request', request: k + 1, id: r.id, cached, prompt: r.usage.prompt_tokens, generated: r.generated.length } },
      el('b', { text: `request ${k + 1}` }), `: ${r.usage.prompt_tokens} prompt tokens, `, el('b', { text: String(cached) }),
      ` of them from the prefix cache (computed: ${r.usage.prompt_tokens - cached}); the model wrote ${r.generated.length} tokens.`);
  }));
}

function caption(text, ...more) {
  const step = trip.step;
  $('#tool-step').dataset.step = String(step);
  $('#tool-step').replaceChildren(el('b', { text: step ? `${step} · ${STEPS[step - 1]}. ` : 'Ready. ' }), text, ...more);
  const done = step >= STEPS.length || trip.finished;
  $('#tool-next').disabled = done;
  $('#tool-next').textContent = done ? 'Done' : `Next: ${STEPS[step].toLowerCase()} →`;
}

/** Who tells the model about the tools decides the first request's tool_choice: a template with a tool section
 * lets the model decide; the generic prompt (a small model that rarely calls on its own) forces the call. */
function chooseTool(doc) {
  const generic = doc.tool_prompt === 'generic';
  trip.choice = generic ? { type: 'function', function: { name: trip.tool } } : 'auto';
  $('#tool-template').dataset.toolPrompt = doc.tool_prompt;
  $('#tool-template').textContent = generic
    ? `This model's chat template has no tool section: the server writes zhuzi's generic tool prompt into the system message (the purple text in the document). A model this small rarely calls a tool on its own, so the first request forces a call to ${trip.tool} with tool_choice; the arguments are still the model's own writing.`
    : 'This model\'s chat template writes the tools itself; the first request leaves tool_choice "auto": the model decides whether to call.';
}

async function writeCall() {
  trip.doc = await inspect.document(trip.messages, TOOLS);
  chooseTool(trip.doc);
  const r = await ask(trip.messages, trip.choice);
  trip.requests.push(r);
  trip.call = r.message.tool_calls?.[0] ?? null;
  drawDocument([...trip.doc.tokens, ...r.generated], trip.doc.tokens.length, r.usage.prompt_tokens_details?.cached_tokens ?? 0);
  if (!trip.call) {
    trip.finished = true;
    return caption('The model answered without calling a tool: ', el('q', { text: r.message.content ?? '' }));
  }
  return caption(`Request 1 read the document and the model wrote ${r.generated.length} tokens (dashed, model-written). The server parsed them into a call: `,
    el('code', { dataset: { testid: 'tool-call' }, text: `${trip.call.function.name}(${trip.call.function.arguments})` }),
    '. Nothing has run yet: the model can only write text that asks for it.');
}

function runCall() {
  trip.result = runTool(trip.call.function.name, trip.call.function.arguments);
  return caption(`This page ran ${trip.call.function.name} on the model's arguments: `,
    el('code', { dataset: { testid: 'tool-result', error: trip.result.error ? 'true' : undefined }, text: trip.result.content }),
    ` (computed in the browser by the page's own tool${trip.result.error ? ': the model\'s arguments did not parse, and that is the result it gets' : ''}).`);
}

async function appendResult() {
  const before = JSON.parse($('#tool-doc').dataset.ids);
  trip.messages = [...trip.messages, { role: 'assistant', content: null, tool_calls: [trip.call] },
    { role: 'tool', tool_call_id: trip.call.id, content: trip.result.content }];
  trip.doc = await inspect.document(trip.messages, TOOLS);
  drawDocument(trip.doc.tokens, trip.doc.tokens.length, 0);
  const same = commonPrefix(before, trip.doc.token_ids);
  return caption(`The program appended the call (re-typeset by the template) and a tool message with the result (green, program-written). The document's first `,
    el('b', { dataset: { testid: 'tool-common' }, text: String(same) }),
    ' tokens are, token for token, what request 1 read and wrote: the prefix cache holds their K and V in whole blocks.');
}

async function answer() {
  const r = await ask(trip.messages, 'auto');
  trip.requests.push(r);
  const cached = r.usage.prompt_tokens_details?.cached_tokens ?? 0;
  drawDocument([...trip.doc.tokens, ...r.generated], trip.doc.tokens.length, cached);
  const again = r.message.tool_calls?.length;
  return caption(`Request 2 read all ${r.usage.prompt_tokens} tokens again, ${cached} of them from the prefix cache (shaded): only ${r.usage.prompt_tokens - cached} were computed. `,
    again ? 'The model called a tool again: an agent would run it, append the result and ask once more, until the model answers in words.'
      : el('span', {}, 'The model answered: ', el('q', { text: r.message.content ?? '' })));
}

async function next() {
  const button = $('#tool-next');
  button.disabled = true;
  try {
    trip.step += 1;
    await [writeCall, runCall, appendResult, answer][trip.step - 1]();
    drawRequests();
  } catch (error) {
    trip.finished = true;
    caption(`This step failed: ${error.message}`);
  }
}

function reset() {
  const tool = $('#tool-choice').value;
  const content = $('#tool-question').value.trim() || PRESETS[tool];
  trip = { step: 0, messages: [{ role: 'user', content }], requests: [], tool, finished: false, choice: null };
  $('#tool-doc').replaceChildren(el('p', { class: 'hint', text: 'Press Next: the first request goes out.' }));
  $('#tool-requests').replaceChildren();
  $('#tool-template').textContent = '';
  caption(`The question goes out with ${TOOLS.length} tools: ${TOOLS.map((t) => t.function.name).join(', ')}.`);
}

export function initTools() {
  $('#tool-choice').addEventListener('change', () => { $('#tool-question').value = PRESETS[$('#tool-choice').value]; reset(); });
  $('#tool-question').value = PRESETS.calculator;
  $('#tool-next').addEventListener('click', next);
  $('#tool-reset').addEventListener('click', reset);
  reset();
}
