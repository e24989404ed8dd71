// Pure parts of the ember extension: settings -> server command line, TCP target,
// initializationOptions, and status-bar texts. No `vscode` import, so node's test runner can
// test it (src/test/config.test.ts).

export interface EmberSettings {
  /** The `ember` executable, started with --stdio. */
  serverPath: string;
  /** Extra command-line arguments. */
  serverArgs: string[];
  /** "HOST:PORT" of a running `ember --tcp` server; empty: start one over stdio. */
  tcp: string;
  /** Token for TCP servers started with --token. */
  token: string;
  model: string;
  /** "vllm" or "llamacpp"; empty: the server's choice by hardware (llama.cpp without a CUDA GPU). */
  engine: string;
  /** A FIM template name for a model ember does not recognize; empty: chosen from the model. */
  fimTemplate: string;
  engineUrl: string[];
  maxTokens: number | undefined;
  debounceMs: number | undefined;
  contextTokens: number | undefined;
  temperature: number | undefined;
  earlyAnswerMs: number | undefined;
  maxRequestsPerSecond: number | undefined;
  /** Hide suggestions below this confidence (0-1); empty: the model's calibrated default. */
  minConfidence: number | undefined;
  suffixTokens: number | undefined;
  crossFileTokens: number | undefined;
  timeoutMs: number | undefined;
  /** "workspace", "open" or "off"; empty: the server's default. */
  crossFile: string;
  /** vLLM engine arguments over ember's defaults (embedded engine), e.g. {"max_model_len": 4096}. */
  engineArgs: Record<string, unknown>;
  /** Also show ember's item in the suggest widget (it is always shown as ghost text). */
  suggestWidget: boolean;
}

export const DEFAULT_SETTINGS: EmberSettings = {
  serverPath: 'ember',
  serverArgs: [],
  tcp: '',
  token: '',
  model: '',
  engine: '',
  fimTemplate: '',
  engineUrl: [],
  maxTokens: undefined,
  debounceMs: undefined,
  contextTokens: undefined,
  temperature: undefined,
  earlyAnswerMs: undefined,
  maxRequestsPerSecond: undefined,
  minConfidence: undefined,
  suffixTokens: undefined,
  crossFileTokens: undefined,
  timeoutMs: undefined,
  crossFile: '',
  engineArgs: {},
  suggestWidget: false,
};

const CROSS_FILE_MODES = ['workspace', 'open', 'off'];
const ENGINES = ['auto', 'vllm', 'llamacpp'];

function str(v: unknown, fallback: string): string {
  return typeof v === 'string' ? v.trim() : fallback;
}

function num(v: unknown, integer: boolean): number | undefined {
  if (v === null || v === undefined || v === '') return undefined;
  const n = typeof v === 'number' ? v : Number(v);
  if (!Number.isFinite(n)) return undefined;
  return integer ? Math.trunc(n) : n;
}

function oneOf(v: string, choices: string[]): string {
  return choices.includes(v) ? v : '';
}

function plainObject(v: unknown): Record<string, unknown> {
  return v !== null && typeof v === 'object' && !Array.isArray(v) ? { ...(v as Record<string, unknown>) } : {};
}

function urls(v: unknown): string[] {
  const list = Array.isArray(v) ? v : typeof v === 'string' ? v.split(/[\s,]+/) : [];
  return list.filter((u): u is string => typeof u === 'string').map((u) => u.trim()).filter((u) => u !== '');
}

/**
 * Reads and normalizes settings through `get(key)` (in the extension:
 * `workspace.getConfiguration('ember').get`). Unknown or malformed values fall back to defaults.
 */
export function readSettings(get: (key: string) => unknown): EmberSettings {
  const args = get('serverArgs');
  return {
    serverPath: str(get('serverPath'), DEFAULT_SETTINGS.serverPath) || DEFAULT_SETTINGS.serverPath,
    serverArgs: Array.isArray(args) ? args.filter((a): a is string => typeof a === 'string') : [],
    tcp: str(get('tcp'), ''),
    token: str(get('token'), ''),
    model: str(get('model'), ''),
    engine: oneOf(str(get('engine'), ''), ENGINES),
    fimTemplate: str(get('fimTemplate'), ''),
    engineUrl: urls(get('engineUrl')),
    maxTokens: num(get('maxTokens'), true),
    debounceMs: num(get('debounceMs'), true),
    contextTokens: num(get('contextTokens'), true),
    temperature: num(get('temperature'), false),
    earlyAnswerMs: num(get('earlyAnswerMs'), true),
    maxRequestsPerSecond: num(get('maxRequestsPerSecond'), false),
    minConfidence: num(get('minConfidence'), false),
    suffixTokens: num(get('suffixTokens'), true),
    crossFileTokens: num(get('crossFileTokens'), true),
    timeoutMs: num(get('timeoutMs'), true),
    crossFile: oneOf(str(get('crossFile'), ''), CROSS_FILE_MODES),
    engineArgs: plainObject(get('engineArgs')),
    suggestWidget: get('suggestWidget') === true,
  };
}

/**
 * The server's settings object (camelCase keys of the ember protocol), sent as
 * `initializationOptions` and as `workspace/didChangeConfiguration` `{settings: {ember: ...}}`.
 * Empty values are left out so the server keeps its defaults.
 */
export function toInitializationOptions(s: EmberSettings): Record<string, unknown> {
  const o: Record<string, unknown> = {};
  if (s.model) o.model = s.model;
  if (s.engine) o.engine = s.engine;
  if (s.fimTemplate) o.fimTemplate = s.fimTemplate;
  if (s.engineUrl.length === 1) o.engineUrl = s.engineUrl[0];
  else if (s.engineUrl.length > 1) o.engineUrl = [...s.engineUrl];
  if (s.maxTokens !== undefined) o.maxTokens = s.maxTokens;
  if (s.debounceMs !== undefined) o.debounceMs = s.debounceMs;
  if (s.contextTokens !== undefined) o.contextTokens = s.contextTokens;
  if (s.temperature !== undefined) o.temperature = s.temperature;
  if (s.earlyAnswerMs !== undefined) o.earlyAnswerMs = s.earlyAnswerMs;
  if (s.maxRequestsPerSecond !== undefined) o.maxRequestsPerSecond = s.maxRequestsPerSecond;
  if (s.minConfidence !== undefined) o.minConfidence = s.minConfidence;
  if (s.suffixTokens !== undefined) o.suffixTokens = s.suffixTokens;
  if (s.crossFileTokens !== undefined) o.crossFileTokens = s.crossFileTokens;
  if (s.timeoutMs !== undefined) o.timeoutMs = s.timeoutMs;
  if (s.crossFile) o.crossFile = s.crossFile;
  if (s.token) o.token = s.token;
  return o;
}

export interface HostPort {
  host: string;
  port: number;
}

/** Parses "HOST:PORT", "[IPv6]:PORT", ":PORT" or "PORT" (host defaults to 127.0.0.1). */
export function parseHostPort(spec: string): HostPort {
  const s = spec.trim();
  let host = '127.0.0.1';
  let portText: string;
  const v6 = /^\[([^\]]+)\]:(\d+)$/.exec(s);
  if (v6) {
    host = v6[1];
    portText = v6[2];
  } else if (/^\d+$/.test(s)) {
    portText = s;
  } else {
    const i = s.lastIndexOf(':');
    if (i < 0) throw new Error(`ember.tcp must be HOST:PORT, got "${spec}"`);
    if (i > 0) host = s.slice(0, i);
    portText = s.slice(i + 1);
    if (host.includes(':')) throw new Error(`ember.tcp: write IPv6 hosts as [ADDR]:PORT, got "${spec}"`);
  }
  const port = Number(portText);
  if (!/^\d+$/.test(portText) || port < 1 || port > 65535) {
    throw new Error(`ember.tcp: bad port in "${spec}"`);
  }
  return { host, port };
}

export type Connection =
  | { kind: 'stdio'; command: string; args: string[] }
  | { kind: 'tcp'; host: string; port: number };

/**
 * How to reach the server: connect to `ember --tcp` when `tcp` is set, else start
 * `ember --stdio` with the settings the CLI also takes (so the right model loads at once).
 */
export function connection(s: EmberSettings): Connection {
  if (s.tcp) {
    return { kind: 'tcp', ...parseHostPort(s.tcp) };
  }
  const args = ['--stdio'];
  if (s.model) args.push('--model', s.model);
  if (s.engine) args.push('--engine', s.engine);
  for (const url of s.engineUrl) args.push('--engine-url', url);
  if (s.maxTokens !== undefined) args.push('--max-tokens', String(s.maxTokens));
  if (s.debounceMs !== undefined) args.push('--debounce-ms', String(s.debounceMs));
  // On the command line, so that the engine (or the shared daemon's) starts with them at once.
  for (const [key, value] of Object.entries(s.engineArgs)) args.push('--engine-arg', `${key}=${JSON.stringify(value)}`);
  args.push(...s.serverArgs);
  return { kind: 'stdio', command: s.serverPath, args };
}

/** True when a settings change needs a new server process or connection. */
export function needsRestart(before: EmberSettings, after: EmberSettings): boolean {
  return JSON.stringify(connection(before)) !== JSON.stringify(connection(after)) || before.token !== after.token;
}

export interface ProgressState {
  title?: string;
  message?: string;
  percentage?: number;
}

export type ClientState = 'starting' | 'running' | 'stopped' | 'error';

export interface StatusText {
  text: string;
  tooltip: string;
}

/** The status-bar item for a client state, in-flight work-done progress and the last error. */
export function statusText(state: ClientState, progress?: ProgressState, error?: string): StatusText {
  if (state === 'error') {
    return { text: '$(error) ember', tooltip: `ember: ${error || 'error'} (click for the log)` };
  }
  if (progress) {
    // ember titles its progress "ember": no need to say it twice.
    const title = progress.title?.trim().toLowerCase() === 'ember' ? undefined : progress.title;
    const parts = [title, progress.message].filter((p) => p && p.trim() !== '');
    let detail = parts.join(': ');
    if (progress.percentage !== undefined) detail += ` ${Math.round(progress.percentage)}%`;
    return { text: `$(loading~spin) ember: ${detail.trim()}`, tooltip: `ember: ${detail.trim()}` };
  }
  switch (state) {
    case 'starting':
      return { text: '$(loading~spin) ember', tooltip: 'ember: starting the server' };
    case 'running':
      return { text: '$(sparkle) ember', tooltip: 'ember: ready (click for the log)' };
    default:
      return { text: '$(circle-slash) ember', tooltip: 'ember: stopped (click for the log)' };
  }
}
