// The tool round trip, one step per Next: the model writes a call, this page runs the tool (toolbox.js), the
// result goes back as a `tool` message, the model is asked again, and so on until it answers in words. At
// each step the document grows, coloured by who wrote each token (the model, the program, the template, the
// user), and each request's cached prefix is shaded: a tool call is the same loop, turned a few more times,
// mostly re-reading what it has read. Each step adds one line to the trip's log; a trip that cannot go on
// (no call, a call cut short, the round limit) says why in one line and ends.
import { getJSON, inspect, postJSON } from './api.js';
import { asGenerated, docSpans } from './document.js';
import { on, specialIds, state } from './state.js';
import { runTool, TOOLS } from './toolbox.js';
import { $, el } from './util.js';

const PRESETS = {
  calculator: 'What is 17 times 23?',
  city_time: 'What time is it in Tokyo right now?',
};
const MAX_TOKENS = 96;
const MAX_CALLS = 2; // an agent's round limit: a small model may call again and again
const ACTIONS = {
  call: 'The model writes the call',
  run: 'The program runs the tool',
  append: 'The result goes back as a tool message',
  answer: 'The model answers',
};

let trip = null; // {step, next, messages, doc, requests, calls, call, result, tool, model, choice, finished}

/** One chat request with the page's tools; its generated tokens in the document's shape. */
async function ask(toolChoice) {
  const r = await postJSON('/v1/chat/completions', {
    model: trip.model, messages: trip.messages, tools: TOOLS, tool_choice: toolChoice, temperature: 0,
    max_tokens: MAX_TOKENS, logprobs: true, return_token_ids: true,
  });
  const c = r.choices[0];
  const specials = specialIds();
  const generated = asGenerated(c.token_ids.map((id, k) => ({ id, bytes: c.logprobs.content[k].bytes, special: specials.has(id) })));
  const text = new TextDecoder().decode(Uint8Array.from(generated.filter((t) => !t.special).flatMap((t) => t.bytes)));
  return { id: r.id, usage: r.usage, message: c.message, finish: c.finish_reason, generated, text, choice: toolChoice };
}

const cachedOf = (r) => r.usage.prompt_tokens_details?.cached_tokens ?? 0;

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
  box.dataset.messages = JSON.stringify(trip.messages); // what the document is the rendering of
}

function drawRequests() {
  $('#tool-requests').replaceChildren(...trip.requests.map((r, k) => {
    const cached = cachedOf(r);
    return el('li', { dataset: { testid: 'tool-request', request: k + 1, id: r.id, cached, prompt: r.usage.prompt_tokens, generated: r.generated.length } },
      el('b', { text: `request ${k + 1}` }), ` (tool_choice ${typeof r.choice === 'string' ? r.choice : r.choice.function.name}): ${r.usage.prompt_tokens} prompt tokens, `,
      el('b', { text: String(cached) }), ` of them from the prefix cache (computed: ${r.usage.prompt_tokens - cached}); the model wrote ${r.generated.length} tokens.`);
  }));
}

/** The step's line: in the summary above the document, and appended to the trip's log (coloured by author). */
function report(outcome, author, text, ...more) {
  const label = ACTIONS[trip.action];
  const done = trip.finished;
  $('#tool-step').dataset.step = String(trip.step);
  $('#tool-step').dataset.outcome = outcome;
  $('#tool-step').replaceChildren(el('b', { text: `${trip.step} · ${label}. ` }), text, ...more);
  $('#tool-log').append(el('li', { dataset: { testid: 'tool-log-step', step: trip.step, action: trip.action, outcome, author } },
    el('b', { text: `${label}. ` }), text, ...more.map((m) => (m instanceof Node ? m.cloneNode(true) : m))));
  $('#tool-next').disabled = done;
  $('#tool-next').textContent = done ? 'Done' : `Next: ${ACTIONS[trip.next].toLowerCase()} →`;
}

/** Who tells the model about the tools decides the first request's tool_choice: a template with a tool section
 * lets the model decide; the generic prompt (a small model that rarely calls on its own) forces the call. */
function chooseTool(doc) {
  const generic = doc.tool_prompt === 'generic';
  trip.generic = generic;
  trip.choice = generic ? { type: 'function', function: { name: trip.tool } } : 'auto';
  $('#tool-template').dataset.toolPrompt = doc.tool_prompt;
  $('#tool-template').textContent = generic
    ? `${trip.model}'s chat template has no tool section: the server writes zhuzi's generic tool prompt into the system message (the purple text in the document). A model this small rarely calls a tool on its own, so the first request forces a call to ${trip.tool} with tool_choice; the arguments are still the model's own writing, held to the tool's schema.`
    : `${trip.model}'s chat template writes the tools itself; the requests leave tool_choice "auto": the model decides whether to call.`;
}

const callText = (call) => `${call.function.name}(${call.function.arguments})`;
const quoted = (text) => el('q', { dataset: { testid: 'tool-wrote' }, text: text.trim() || '(nothing)' });

/** The tool_choice of a request after a result: "none" once the calls reach the limit, where the template
 * writes the tools whatever tool_choice says (so the document, and its cache, stay the same). */
const answerChoice = () => (trip.calls.length >= MAX_CALLS && !trip.generic ? 'none' : 'auto');

/** A request's reply: a call to run next, or the end of the trip, said in one line. */
function settle(r, first) {
  const call = r.message.tool_calls?.[0] ?? null;
  const cached = cachedOf(r);
  const read = first
    ? `Request 1 read the document and the model wrote ${r.generated.length} tokens (dashed, model-written). `
    : `Request ${trip.requests.length} read all ${r.usage.prompt_tokens} tokens again, ${cached} of them from the prefix cache (shaded): only ${r.usage.prompt_tokens - cached} were computed; the model wrote ${r.generated.length}. `;
  let complete = true;
  try { JSON.parse(call?.function.arguments); } catch { complete = false; }
  if (!call) {
    trip.finished = true;
    return report(first ? 'no-call' : 'answer', 'assistant', read, first ? 'The model wrote no tool call, so there is nothing to run and the trip ends. It wrote: ' : 'The model answered without a call, and the trip ends: ', quoted(r.message.content ?? r.text));
  }
  if (!complete) {
    trip.finished = true;
    return report('cut', 'assistant', read, `The model's call was cut off at max_tokens (${MAX_TOKENS}) before its arguments closed, so nothing can run and the trip ends. It wrote: `, quoted(r.text));
  }
  const same = (c) => c.function.name === call.function.name
    && JSON.stringify(JSON.parse(c.function.arguments)) === JSON.stringify(JSON.parse(call.function.arguments));
  const again = trip.calls.some(same);
  if (again || trip.calls.length >= MAX_CALLS) {
    trip.finished = true;
    return report('limit', 'assistant', read, 'The model called a tool again: ', el('code', { dataset: { testid: 'tool-call' }, text: callText(call) }),
      again ? '. It already has that call\'s result, so it will not answer in words; the page stops the loop here, as an agent stops at its round limit.'
        : `. An agent would run it and ask once more, until the model answers in words; this page stops after ${MAX_CALLS} calls.`);
  }
  trip.call = call;
  trip.calls.push(call);
  trip.next = 'run';
  return report('call', 'assistant', read, 'The server parsed them into a call: ', el('code', { dataset: { testid: 'tool-call' }, text: callText(call) }),
    '. Nothing has run yet: the model can only write text that asks for it.');
}

async function writeCall() {
  trip.doc = await inspect.document(trip.messages, TOOLS, trip.model);
  chooseTool(trip.doc);
  const r = await ask(trip.choice);
  trip.requests.push(r);
  drawDocument([...trip.doc.tokens, ...r.generated], trip.doc.tokens.length, cachedOf(r));
  settle(r, true);
}

function runCall() {
  trip.result = runTool(trip.call.function.name, trip.call.function.arguments);
  trip.next = 'append';
  report(trip.result.error ? 'error' : 'result', 'tool', `This page ran ${trip.call.function.name} on the model's arguments: `,
    el('code', { dataset: { testid: 'tool-result', error: trip.result.error ? 'true' : undefined }, text: trip.result.content }),
    ` (computed in the browser by the page's own tool${trip.result.error ? ': the model\'s arguments did not work, and that is the result it gets' : ''}).`);
}

async function appendResult() {
  const before = JSON.parse($('#tool-doc').dataset.ids);
  trip.messages = [...trip.messages, { role: 'assistant', content: null, tool_calls: [trip.call] },
    { role: 'tool', tool_call_id: trip.call.id, content: trip.result.content }];
  trip.doc = await inspect.document(trip.messages, TOOLS, trip.model);
  drawDocument(trip.doc.tokens, trip.doc.tokens.length, 0);
  const same = commonPrefix(before, trip.doc.token_ids);
  trip.next = 'answer';
  const choice = answerChoice();
  report('appended', 'tool', 'The program appended the call (re-typeset by the template) and a tool message with the result (green, program-written). The document\'s first ',
    el('b', { dataset: { testid: 'tool-common' }, text: String(same) }),
    ' tokens are, token for token, what the last request read and wrote: the prefix cache holds their K and V in whole blocks.',
    choice === 'none' ? ` The next request goes with tool_choice "none": after ${MAX_CALLS} calls the program asks for an answer in words.` : '');
}

async function answer() {
  const r = await ask(answerChoice());
  trip.requests.push(r);
  drawDocument([...trip.doc.tokens, ...r.generated], trip.doc.tokens.length, cachedOf(r));
  settle(r, false);
}

const STEPS = { call: writeCall, run: runCall, append: appendResult, answer };

async function next() {
  const button = $('#tool-next');
  button.disabled = true;
  if (trip.step === 0) start();
  try {
    trip.step += 1;
    trip.action = trip.next;
    await STEPS[trip.action]();
    drawRequests();
  } catch (error) {
    trip.finished = true;
    report('failed', 'program', `This step failed: ${error.message}`);
  }
}

/** The trip's first state: the question as the field has it when the first Next is pressed. */
function start() {
  const content = $('#tool-question').value.trim() || PRESETS[trip.tool];
  trip.messages = [{ role: 'user', content }];
  trip.model = $('#tool-model').value || undefined;
}

function reset() {
  trip = { step: 0, next: 'call', action: null, messages: [], requests: [], calls: [], tool: $('#tool-choice').value, finished: false, choice: null };
  $('#tool-doc').replaceChildren(el('p', { class: 'hint', text: 'Press Next: the first request goes out.' }));
  $('#tool-requests').replaceChildren();
  $('#tool-log').replaceChildren();
  $('#tool-template').textContent = '';
  $('#tool-step').dataset.step = '0';
  $('#tool-step').dataset.outcome = '';
  $('#tool-step').replaceChildren(el('b', { text: 'Ready. ' }), `The question goes out with ${TOOLS.length} tools: ${TOOLS.map((t) => t.function.name).join(', ')}.`);
  $('#tool-next').disabled = false;
  $('#tool-next').textContent = `Next: ${ACTIONS.call.toLowerCase()} →`;
}

/** The served models (a server of one model still lists what /v1/models says), the page's pick first chosen. */
async function listModels() {
  const { data } = await getJSON('/v1/models');
  const select = $('#tool-model');
  select.replaceChildren(...data.map((m) => el('option', { value: m.id, text: m.id })));
  if (state.model) select.value = state.model;
  select.dataset.count = String(data.length);
  $('#tool-model-hint').textContent = data.length > 1 ? ''
    : 'This server serves one model (its /v1/models). SmolLM2, the default, calls a tool only when forced; to watch a model whose template writes the tools and that decides to call on its own, start `zhuzi serve` with Qwen2.5-Coder-0.5B-Instruct\'s GGUF (docs/inspector.md).';
}

export function initTools() {
  $('#tool-choice').addEventListener('change', () => { $('#tool-question').value = PRESETS[$('#tool-choice').value]; reset(); });
  $('#tool-question').value = PRESETS.calculator;
  $('#tool-next').addEventListener('click', next);
  $('#tool-reset').addEventListener('click', reset);
  $('#tool-model').addEventListener('change', reset);
  on('model-changed', (model) => { $('#tool-model').value = model; reset(); }); // the page's pick, until one here
  reset();
  const retry = () => listModels().catch(() => setTimeout(retry, 2000)); // 503 while the model loads
  retry();
}
