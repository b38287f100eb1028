// The page's own tools for the tool-call view. They really compute, here in the browser: arithmetic with a
// small parser (no eval), and the time in a city from the browser's Intl time-zone data. Nothing here
// pretends to fetch anything. Both are strict: the grammar holds a call to its schema, so even a small
// model's arguments parse.

// The calculator's characters: the pattern holds a small model's string to arithmetic, so it must close the
// string instead of writing on inside it until max_tokens.
const EXPRESSION = '^[0-9 .+*/^()-]+$';

export const TOOLS = [
  { type: 'function', function: {
    name: 'calculator', strict: true, description: 'Evaluate an arithmetic expression with + - * / ^ and parentheses.',
    parameters: { type: 'object', properties: { expression: { type: 'string', pattern: EXPRESSION } }, required: ['expression'] } } },
  { type: 'function', function: {
    name: 'city_time', strict: true, description: 'The current date and time in a city.',
    parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] } } },
];

/** The value of an arithmetic expression: numbers, + - * / ^ (right-associative), unary minus, parentheses. */
export function calculate(expression) {
  const tokens = String(expression).match(/\d+(?:\.\d+)?(?:e[+-]?\d+)?|[-+*/^()]|\S/gi) || [];
  let at = 0;
  const peek = () => tokens[at];
  const take = (want) => {
    if (want !== undefined && tokens[at] !== want) throw new Error(`expected "${want}" at "${tokens[at] ?? 'the end'}"`);
    at += 1;
    return tokens[at - 1];
  };
  const primary = () => {
    if (peek() === '(') { take('('); const v = sum(); take(')'); return v; }
    if (peek() === '-') { take(); return -primary(); }
    if (peek() === '+') { take(); return primary(); }
    const t = take();
    if (t === undefined || !/^\d/.test(t)) throw new Error(`a number was expected, not "${t ?? 'the end'}"`);
    return Number(t);
  };
  const power = () => { const base = primary(); return peek() === '^' ? (take(), base ** power()) : base; };
  const product = () => {
    let v = power();
    while (peek() === '*' || peek() === '/') v = take() === '*' ? v * power() : v / power();
    return v;
  };
  const sum = () => {
    let v = product();
    while (peek() === '+' || peek() === '-') v = take() === '+' ? v + product() : v - product();
    return v;
  };
  const value = sum();
  if (at < tokens.length) throw new Error(`unexpected "${tokens[at]}"`);
  return value;
}

// Cities that are not the name of their time zone (the others are found in Intl's own list).
const ALIASES = { beijing: 'Asia/Shanghai', shenzhen: 'Asia/Shanghai', 'san francisco': 'America/Los_Angeles',
  mumbai: 'Asia/Kolkata', delhi: 'Asia/Kolkata', 'washington': 'America/New_York', boston: 'America/New_York' };

/** The time zone of a city: an alias, else the Intl zone whose last part is the city's name. */
export function cityZone(city) {
  const name = String(city).trim().toLowerCase();
  if (ALIASES[name]) return ALIASES[name];
  const wanted = name.replaceAll(' ', '_');
  return Intl.supportedValuesOf('timeZone').find((zone) => zone.toLowerCase().split('/').at(-1) === wanted) ?? null;
}

export function cityTime(city, now = new Date()) {
  const zone = cityZone(city);
  if (!zone) throw new Error(`no time zone known for "${city}"`);
  const when = new Intl.DateTimeFormat('en-GB', { timeZone: zone, dateStyle: 'full', timeStyle: 'long' }).format(now);
  return `${when} (${zone})`;
}

/** Run a call the model wrote: {content, error} where content is what goes back to the model. */
export function runTool(name, argumentsText) {
  try {
    const args = JSON.parse(argumentsText);
    if (name === 'calculator') return { content: String(calculate(args.expression)) };
    if (name === 'city_time') return { content: cityTime(args.city) };
    throw new Error(`no tool named "${name}"`);
  } catch (error) {
    return { content: `error: ${error.message}`, error: true };
  }
}
