import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  DEFAULT_SETTINGS,
  EmberSettings,
  connection,
  needsRestart,
  parseHostPort,
  readSettings,
  statusText,
  toInitializationOptions,
} from '../config';

function settings(values: Record<string, unknown>): EmberSettings {
  return readSettings((key) => values[key]);
}

describe('readSettings', () => {
  it('falls back to defaults for missing or malformed values', () => {
    assert.deepEqual(settings({}), DEFAULT_SETTINGS);
    const s = settings({ serverPath: '  ', maxTokens: 'many', temperature: null, serverArgs: 'x', suggestWidget: 'yes' });
    assert.equal(s.serverPath, 'ember');
    assert.equal(s.maxTokens, undefined);
    assert.equal(s.temperature, undefined);
    assert.deepEqual(s.serverArgs, []);
    assert.equal(s.suggestWidget, false);
  });

  it('normalizes numbers and engine URLs', () => {
    const s = settings({
      maxTokens: 48.7,
      debounceMs: '30',
      temperature: 0.2,
      contextTokens: 1024,
      engineUrl: 'http://a:8000/v1, http://b:8000/v1',
    });
    assert.equal(s.maxTokens, 48);
    assert.equal(s.debounceMs, 30);
    assert.equal(s.temperature, 0.2);
    assert.equal(s.contextTokens, 1024);
    assert.deepEqual(s.engineUrl, ['http://a:8000/v1', 'http://b:8000/v1']);
    assert.deepEqual(settings({ engineUrl: ['http://a/v1', '', 3] }).engineUrl, ['http://a/v1']);
  });
});

describe('toInitializationOptions', () => {
  it('sends the context settings the server has', () => {
    const o = toInitializationOptions(
      settings({ crossFile: 'open', crossFileTokens: 512, suffixTokens: 128, timeoutMs: 5000, fimTemplate: 'starcoder2' }),
    );
    assert.deepEqual(o, { fimTemplate: 'starcoder2', crossFile: 'open', crossFileTokens: 512, suffixTokens: 128, timeoutMs: 5000 });
    assert.equal(settings({ crossFile: 'everywhere' }).crossFile, '');
  });

  it('sends only what is set, with the server keys', () => {
    assert.deepEqual(toInitializationOptions(DEFAULT_SETTINGS), {});
    const o = toInitializationOptions(
      settings({
        model: 'Qwen/Qwen2.5-Coder-1.5B',
        engineUrl: ['http://gpu:8000/v1'],
        maxTokens: 64,
        debounceMs: 0,
        contextTokens: 2048,
        temperature: 0,
        earlyAnswerMs: 0,
        maxRequestsPerSecond: 5.5,
        minConfidence: 0.3,
        token: 's3cret',
        serverPath: '/opt/ember',
        tcp: 'gpu:7777',
        suggestWidget: true,
      }),
    );
    assert.deepEqual(o, {
      model: 'Qwen/Qwen2.5-Coder-1.5B',
      engineUrl: 'http://gpu:8000/v1',
      maxTokens: 64,
      debounceMs: 0,
      contextTokens: 2048,
      temperature: 0,
      earlyAnswerMs: 0,
      maxRequestsPerSecond: 5.5,
      minConfidence: 0.3,
      token: 's3cret',
    });
  });

  it('keeps a list for several engine URLs', () => {
    const o = toInitializationOptions(settings({ engineUrl: ['http://a/v1', 'http://b/v1'] }));
    assert.deepEqual(o.engineUrl, ['http://a/v1', 'http://b/v1']);
  });
});

describe('parseHostPort', () => {
  it('parses the usual forms', () => {
    assert.deepEqual(parseHostPort('gpu-box:7777'), { host: 'gpu-box', port: 7777 });
    assert.deepEqual(parseHostPort('7777'), { host: '127.0.0.1', port: 7777 });
    assert.deepEqual(parseHostPort(':7777'), { host: '127.0.0.1', port: 7777 });
    assert.deepEqual(parseHostPort('[::1]:8080'), { host: '::1', port: 8080 });
    assert.deepEqual(parseHostPort(' 10.0.0.5:1 '), { host: '10.0.0.5', port: 1 });
  });

  it('rejects bad input', () => {
    assert.throws(() => parseHostPort('gpu-box'), /HOST:PORT/);
    assert.throws(() => parseHostPort('gpu:0'), /bad port/);
    assert.throws(() => parseHostPort('gpu:70000'), /bad port/);
    assert.throws(() => parseHostPort('gpu:http'), /bad port/);
    assert.throws(() => parseHostPort('::1:80'), /IPv6/);
  });
});

describe('connection', () => {
  it('starts ember --stdio with the CLI flags', () => {
    assert.deepEqual(connection(DEFAULT_SETTINGS), { kind: 'stdio', command: 'ember', args: ['--stdio'] });
    const c = connection(
      settings({
        serverPath: '/venv/bin/ember',
        model: '/models/m.gguf',
        engineUrl: ['http://a/v1', 'http://b/v1'],
        maxTokens: 32,
        debounceMs: 10,
        temperature: 0.5,
        serverArgs: ['--log-level', 'debug'],
      }),
    );
    assert.deepEqual(c, {
      kind: 'stdio',
      command: '/venv/bin/ember',
      args: [
        '--stdio',
        '--model', '/models/m.gguf',
        '--engine-url', 'http://a/v1',
        '--engine-url', 'http://b/v1',
        '--max-tokens', '32',
        '--debounce-ms', '10',
        '--log-level', 'debug',
      ],
    });
  });

  it('passes engine arguments on the command line, and a change restarts the server', () => {
    const s = settings({ engineArgs: { max_model_len: 4096, kv_cache_dtype: 'fp8' } });
    assert.deepEqual(connection(s), {
      kind: 'stdio',
      command: 'ember',
      args: ['--stdio', '--engine-arg', 'max_model_len=4096', '--engine-arg', 'kv_cache_dtype="fp8"'],
    });
    assert.equal(toInitializationOptions(s).engineArgs, undefined); // start-up only: not for a running server
    assert.equal(needsRestart(settings({}), s), true);
    assert.deepEqual(settings({ engineArgs: ['x'] }).engineArgs, {});
  });

  it('connects over TCP when tcp is set', () => {
    assert.deepEqual(connection(settings({ tcp: 'gpu:7777', model: 'x' })), { kind: 'tcp', host: 'gpu', port: 7777 });
    assert.throws(() => connection(settings({ tcp: 'nonsense' })));
  });

  it('restarts only for changes of process or connection', () => {
    const a = settings({ maxTokens: 32 });
    assert.equal(needsRestart(a, settings({ maxTokens: 32 })), false);
    assert.equal(needsRestart(a, settings({ maxTokens: 32, temperature: 0.3 })), false);
    assert.equal(needsRestart(a, settings({ maxTokens: 64 })), true); // on the command line
    assert.equal(needsRestart(a, settings({ maxTokens: 32, serverPath: '/x/ember' })), true);
    const t = settings({ tcp: 'h:1', maxTokens: 32 });
    assert.equal(needsRestart(t, settings({ tcp: 'h:1', maxTokens: 64 })), false);
    assert.equal(needsRestart(t, settings({ tcp: 'h:2', maxTokens: 32 })), true);
    assert.equal(needsRestart(t, settings({ tcp: 'h:1', maxTokens: 32, token: 'new' })), true);
  });
});

describe('statusText', () => {
  it('shows load progress', () => {
    const s = statusText('running', { title: 'Loading model', message: 'SmolLM2-135M', percentage: 42.4 });
    assert.equal(s.text, '$(loading~spin) ember: Loading model: SmolLM2-135M 42%');
    assert.equal(statusText('running', { title: 'Loading model' }).text, '$(loading~spin) ember: Loading model');
    assert.equal(
      statusText('running', { title: 'ember', message: 'loading the bundled model' }).text,
      '$(loading~spin) ember: loading the bundled model',
    );
  });

  it('shows errors before progress, and the plain states', () => {
    const e = statusText('error', { title: 'Loading model' }, 'spawn ember ENOENT');
    assert.equal(e.text, '$(error) ember');
    assert.match(e.tooltip, /spawn ember ENOENT/);
    assert.equal(statusText('running').text, '$(sparkle) ember');
    assert.equal(statusText('starting').text, '$(loading~spin) ember');
    assert.equal(statusText('stopped').text, '$(circle-slash) ember');
  });
});
