// VS Code client for the ember LSP server: starts `ember --stdio` (or connects to `ember --tcp`),
// shows its textDocument/inlineCompletion results as ghost text (vscode-languageclient >= 10
// registers the inline completion provider when the server advertises it), sends settings as
// initializationOptions and workspace/didChangeConfiguration, and shows load progress and errors
// in the status bar.
import * as net from 'net';
import * as vscode from 'vscode';
import {
  CloseAction,
  DidChangeConfigurationNotification,
  ErrorAction,
  LanguageClient,
  LanguageClientOptions,
  ServerOptions,
  State,
  StreamInfo,
  WorkDoneProgress,
  WorkDoneProgressCreateRequest,
} from 'vscode-languageclient/node';
import {
  ClientState,
  EmberSettings,
  ProgressState,
  connection,
  needsRestart,
  readSettings,
  statusText,
  toInitializationOptions,
} from './config';

let client: LanguageClient | undefined;
let settings: EmberSettings;
let output: vscode.LogOutputChannel;
let statusItem: vscode.StatusBarItem;
let state: ClientState = 'stopped';
let lastError: string | undefined;
const progress = new Map<string, ProgressState>();

function currentSettings(): EmberSettings {
  const cfg = vscode.workspace.getConfiguration('ember');
  return readSettings((key) => cfg.get(key));
}

function updateStatus(): void {
  const p = progress.size > 0 ? [...progress.values()][progress.size - 1] : undefined;
  const s = statusText(state, p, lastError);
  statusItem.text = s.text;
  statusItem.tooltip = s.tooltip;
  statusItem.backgroundColor =
    state === 'error' ? new vscode.ThemeColor('statusBarItem.errorBackground') : undefined;
  statusItem.show();
}

function setState(next: ClientState, error?: string): void {
  state = next;
  if (error !== undefined) lastError = error;
  if (next === 'running') lastError = undefined;
  updateStatus();
}

function serverOptions(s: EmberSettings): ServerOptions {
  const c = connection(s);
  if (c.kind === 'stdio') {
    return { command: c.command, args: c.args, options: { env: process.env } };
  }
  return () =>
    new Promise<StreamInfo>((resolve, reject) => {
      const socket = net.connect(c.port, c.host);
      socket.once('connect', () => resolve({ reader: socket, writer: socket }));
      socket.once('error', (err) => reject(new Error(`cannot connect to ember at ${c.host}:${c.port}: ${err.message}`)));
    });
}

function clientOptions(s: EmberSettings): LanguageClientOptions {
  return {
    documentSelector: [{ scheme: 'file' }, { scheme: 'untitled' }],
    initializationOptions: toInitializationOptions(s),
    outputChannel: output,
    // The inline ghost text is the main UI; the suggest-widget item only on request.
    middleware: {
      provideCompletionItem: (document, position, context, token, next) =>
        settings.suggestWidget ? next(document, position, context, token) : undefined,
    },
    errorHandler: {
      error: (error, _message, count) => {
        setState('error', error.message);
        return { action: (count ?? 0) <= 3 ? ErrorAction.Continue : ErrorAction.Shutdown };
      },
      closed: () => {
        setState('error', 'the server closed the connection');
        return { action: CloseAction.DoNotRestart, message: 'ember: the server stopped. Run "ember: Restart server" to start it again.' };
      },
    },
    initializationFailedHandler: (error) => {
      setState('error', error instanceof Error ? error.message : String(error));
      return false;
    },
  };
}

function trackProgress(c: LanguageClient): void {
  // Work-done progress ("Loading model ...") shown in our status-bar item.
  c.onRequest(WorkDoneProgressCreateRequest.type, ({ token }) => {
    const key = String(token);
    c.onProgress(WorkDoneProgress.type, token, (value) => {
      if (value.kind === 'begin') {
        progress.set(key, { title: value.title, message: value.message, percentage: value.percentage });
      } else if (value.kind === 'report') {
        const p = progress.get(key) ?? {};
        progress.set(key, { ...p, message: value.message ?? p.message, percentage: value.percentage ?? p.percentage });
      } else {
        progress.delete(key);
      }
      updateStatus();
    });
  });
}

async function start(): Promise<void> {
  settings = currentSettings();
  progress.clear();
  setState('starting');
  let c: LanguageClient;
  try {
    c = new LanguageClient('ember', 'ember', serverOptions(settings), clientOptions(settings));
  } catch (e) {
    const msg = e instanceof Error ? e.message : String(e);
    setState('error', msg);
    void vscode.window.showErrorMessage(`ember: ${msg}`);
    return;
  }
  client = c;
  c.onDidChangeState(({ newState }) => {
    if (newState === State.Running) setState('running');
    else if (newState === State.Stopped && state !== 'error') setState('stopped');
  });
  try {
    await c.start();
    trackProgress(c);
    setState('running');
  } catch (e) {
    const msg = e instanceof Error ? e.message : String(e);
    setState('error', msg);
    const choice = await vscode.window.showErrorMessage(`ember: could not start the server: ${msg}`, 'Show log');
    if (choice) output.show(true);
  }
}

async function stop(): Promise<void> {
  const c = client;
  client = undefined;
  if (c) {
    try {
      await c.stop(5000);
    } catch {
      // already stopped
    }
  }
  progress.clear();
}

export async function activate(context: vscode.ExtensionContext): Promise<void> {
  output = vscode.window.createOutputChannel('ember', { log: true });
  statusItem = vscode.window.createStatusBarItem(vscode.StatusBarAlignment.Right, 100);
  statusItem.command = 'ember.showLog';
  context.subscriptions.push(
    output,
    statusItem,
    vscode.commands.registerCommand('ember.showLog', () => output.show(true)),
    vscode.commands.registerCommand('ember.restart', async () => {
      await stop();
      await start();
    }),
    vscode.workspace.onDidChangeConfiguration(async (e) => {
      if (!e.affectsConfiguration('ember')) return;
      const next = currentSettings();
      if (needsRestart(settings, next) || !client) {
        await stop();
        await start();
        return;
      }
      settings = next;
      await client.sendNotification(DidChangeConfigurationNotification.type, {
        settings: { ember: toInitializationOptions(next) },
      });
    }),
  );
  await start();
}

export async function deactivate(): Promise<void> {
  await stop();
}
