// The sampler's rule, as zhuzi/sample/sampler.py applies it to one row of raw logits:
// temperature (below 1e-5: greedy) -> top-k -> top-p -> min-p -> softmax over what is left.
// Each cut is at a value, so tokens tied with the last kept one stay (see _truncate there).
// Arithmetic is float64 here and float32 there: probabilities agree to ~1e-6; a token sitting
// exactly on a top-p boundary could in principle fall the other way.

export const GREEDY_BELOW = 1e-5; // zhuzi/sampling_params.py
export const MIN_TEMPERATURE = 0.01; // the server raises 0 < T < 0.01 to this (zhuzi/server/openai/protocol.py)

/** The temperature the sampler ends up using for a requested one. */
export function effectiveTemperature(t) {
  return t > 0 && t < MIN_TEMPERATURE ? MIN_TEMPERATURE : t;
}

/**
 * logits: Float32Array of the whole vocabulary. Returns {probs: Float64Array (0 for cut tokens),
 * kept: number of surviving tokens, greedy: bool}.
 */
export function distribution(logits, { temperature = 1, top_k = 0, top_p = 1, min_p = 0 } = {}) {
  const n = logits.length;
  const probs = new Float64Array(n);
  const t = effectiveTemperature(temperature);
  if (t < GREEDY_BELOW) {
    let best = 0;
    for (let i = 1; i < n; i += 1) if (logits[i] > logits[best]) best = i;
    probs[best] = 1;
    return { probs, kept: 1, greedy: true };
  }
  const z = new Float64Array(n);
  for (let i = 0; i < n; i += 1) z[i] = Math.fround(logits[i] / t);
  if (top_k > 0 && top_k < n) {
    const floor = kthLargest(z, top_k);
    for (let i = 0; i < n; i += 1) if (z[i] < floor) z[i] = -Infinity;
  }
  if (top_p < 1) {
    const p = softmax(z);
    const sorted = Float64Array.from(p).sort().reverse();
    let massBefore = 0;
    let kept = 0;
    while (kept < n && massBefore < top_p) { massBefore += sorted[kept]; kept += 1; }
    const floor = sorted[Math.max(kept, 1) - 1]; // the top token always stays
    for (let i = 0; i < n; i += 1) if (p[i] < floor) z[i] = -Infinity;
  }
  if (min_p > 0) {
    // a probability min_p times the top one's is a fixed distance below the top logit
    let max = -Infinity;
    for (let i = 0; i < n; i += 1) if (z[i] > max) max = z[i];
    const floor = max + Math.log(min_p);
    for (let i = 0; i < n; i += 1) if (z[i] < floor) z[i] = -Infinity;
  }
  const p = softmax(z);
  let kept = 0;
  for (let i = 0; i < n; i += 1) {
    probs[i] = p[i];
    if (z[i] !== -Infinity) kept += 1;
  }
  return { probs, kept, greedy: false };
}

function softmax(z) {
  let max = -Infinity;
  for (const v of z) if (v > max) max = v;
  const out = new Float64Array(z.length);
  let sum = 0;
  for (let i = 0; i < z.length; i += 1) {
    out[i] = z[i] === -Infinity ? 0 : Math.exp(z[i] - max);
    sum += out[i];
  }
  for (let i = 0; i < z.length; i += 1) out[i] /= sum;
  return out;
}

function kthLargest(values, k) {
  return Float64Array.from(values).sort()[values.length - k];
}

/** Token ids ordered by probability, most likely first (ties by id), limited to `limit`. */
export function ranked(probs, limit) {
  const ids = [];
  for (let i = 0; i < probs.length; i += 1) if (probs[i] > 0) ids.push(i);
  ids.sort((a, b) => probs[b] - probs[a] || a - b);
  return ids.slice(0, limit);
}
