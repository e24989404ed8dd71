// Protocol smoke check without VS Code (run by tests/test_editors.py):
//
//   node out/smoke/inline.js EMBER_EXECUTABLE FILE OUT.json [TIMEOUT_S]
//
// Starts the server exactly as the extension does (connection() + toInitializationOptions() from
// ../config), speaks LSP to it with the protocol library vscode-languageclient uses, opens FILE,
// types a line character by character with incremental didChange (as VS Code sends it), then
// polls textDocument/inlineCompletion until the model has loaded and ember returns ghost text.
// Writes what it saw to OUT.json.
import * as cp from 'child_process';
import * as fs from 'fs';
import * as path from 'path';
import { pathToFileURL } from 'url';
import {
  CompletionRequest,
  DidChangeConfigurationNotification,
  DidChangeTextDocumentNotification,
  DidOpenTextDocumentNotification,
  ExitNotification,
  InitializeRequest,
  InitializedNotification,
  InlineCompletionRequest,
  InlineCompletionTriggerKind,
  ShutdownRequest,
  StreamMessageReader,
  StreamMessageWriter,
  WorkDoneProgress,
  WorkDoneProgressCreateRequest,
  createProtocolConnection,
} from 'vscode-languageserver-protocol/node';
import { connection, readSettings, toInitializationOptions } from '../config';

async function main(): Promise<void> {
  const [emberPath, file, outPath, timeoutArg] = process.argv.slice(2);
  const timeoutS = Number(timeoutArg ?? '240');
  const out: Record<string, unknown> = { progress: [] as unknown[] };
  // A short run: the daemon's engine starts eager (its compiled default would add minutes here).
  const values: Record<string, unknown> = {
    serverPath: emberPath,
    serverArgs: ['--engine-arg', 'enforce_eager=true'],
    maxTokens: 24,
    debounceMs: 0,
    temperature: 0,
  };
  const settings = readSettings((k) => values[k]);
  const conn = connection(settings);
  if (conn.kind !== 'stdio') throw new Error('expected a stdio connection');
  out.command = [conn.command, ...conn.args];
  const child = cp.spawn(conn.command, conn.args, { stdio: ['pipe', 'pipe', 'pipe'] });
  let stderr = '';
  child.stderr.on('data', (d: Buffer) => {
    stderr += d.toString();
    if (stderr.length > 20000) stderr = stderr.slice(-20000);
  });
  const rpc = createProtocolConnection(new StreamMessageReader(child.stdout), new StreamMessageWriter(child.stdin));
  rpc.onRequest(WorkDoneProgressCreateRequest.type, ({ token }) => {
    rpc.onProgress(WorkDoneProgress.type, token, (value) => {
      (out.progress as unknown[]).push(value);
    });
  });
  rpc.onNotification('window/logMessage', () => undefined);
  rpc.onNotification('window/showMessage', (m: { type: number; message: string }) => {
    out.showMessage = m;
  });
  rpc.onRequest('workspace/configuration', (params: { items: unknown[] }) =>
    params.items.map(() => toInitializationOptions(settings)),
  );
  const streamErrors: string[] = [];
  out.stream_errors = streamErrors;
  rpc.onError(([error]) => {
    if (streamErrors.length < 5) streamErrors.push(error.message.slice(0, 600));
  });
  rpc.listen();
  // Give up (and still write what was seen) if the server stops answering.
  const finish = (): void => {
    out.stderr_tail = stderr.slice(-4000);
    fs.writeFileSync(outPath, JSON.stringify(out, null, 2));
  };
  const watchdog = setTimeout(() => {
    out.error = `no result within ${timeoutS + 60} s`;
    finish();
    child.kill('SIGKILL');
    process.exit(0);
  }, (timeoutS + 60) * 1000);
  const within = <T>(p: Promise<T>, what: string, ms = 30000): Promise<T> =>
    Promise.race([
      p,
      new Promise<T>((_, reject) => setTimeout(() => reject(new Error(`${what}: no answer within ${ms} ms`)), ms).unref()),
    ]);

  const uri = pathToFileURL(path.resolve(file)).toString();
  const text = fs.readFileSync(file, 'utf8');
  try {
    const init = await within(rpc.sendRequest(InitializeRequest.type, {
      processId: process.pid,
      rootUri: pathToFileURL(path.dirname(path.resolve(file))).toString(),
      workspaceFolders: null,
      initializationOptions: toInitializationOptions(settings),
      capabilities: {
        window: { workDoneProgress: true },
        textDocument: {
          synchronization: { dynamicRegistration: false, didSave: true },
          completion: { completionItem: { snippetSupport: true } },
          inlineCompletion: { dynamicRegistration: true },
        },
        workspace: { configuration: true, didChangeConfiguration: { dynamicRegistration: true } },
      },
    }), 'initialize', 120000);
    out.capabilities = init.capabilities;
    await rpc.sendNotification(InitializedNotification.type, {});
    await rpc.sendNotification(DidChangeConfigurationNotification.type, {
      settings: { ember: toInitializationOptions(settings) },
    });
    await rpc.sendNotification(DidOpenTextDocumentNotification.type, {
      textDocument: { uri, languageId: 'python', version: 1, text },
    });
    // Type a new last line one character at a time, as VS Code sends it.
    const lines = text.split('\n');
    let line = lines.length - 1; // text ends with "\n": the last (empty) line
    if (lines[line] !== '') throw new Error('fixture must end with a newline');
    const typed = '    return n * ';
    let version = 1;
    for (let i = 0; i < typed.length; i++) {
      version += 1;
      await rpc.sendNotification(DidChangeTextDocumentNotification.type, {
        textDocument: { uri, version },
        contentChanges: [{ range: { start: { line, character: i }, end: { line, character: i } }, text: typed[i] }],
      });
    }
    const position = { line, character: typed.length };
    out.position = position;

    const t0 = Date.now();
    let attempts = 0;
    let items: { insertText: unknown; range?: unknown }[] = [];
    while (Date.now() - t0 < timeoutS * 1000) {
      attempts += 1;
      const result = await within(
        rpc.sendRequest(InlineCompletionRequest.type, {
          textDocument: { uri },
          position,
          context: { triggerKind: InlineCompletionTriggerKind.Automatic },
        }),
        'textDocument/inlineCompletion',
      );
      const list = Array.isArray(result) ? result : result?.items ?? [];
      items = list.filter((i) => (typeof i.insertText === 'string' ? i.insertText : i.insertText.value) !== '');
      if (items.length > 0) break;
      await new Promise((r) => setTimeout(r, 1000));
    }
    out.attempts = attempts;
    out.wait_s = (Date.now() - t0) / 1000;
    out.inline_items = items;
    const completion = await within(
      rpc.sendRequest(CompletionRequest.type, { textDocument: { uri }, position }),
      'textDocument/completion',
    );
    out.completion = completion;
    await within(rpc.sendRequest(ShutdownRequest.type), 'shutdown', 10000);
    await rpc.sendNotification(ExitNotification.type);
  } catch (e) {
    out.error = e instanceof Error ? e.stack ?? e.message : String(e);
  } finally {
    clearTimeout(watchdog);
    finish();
    setTimeout(() => {
      child.kill('SIGKILL');
      process.exit(0);
    }, 3000).unref();
    child.on('exit', () => process.exit(0));
  }
}

void main();
