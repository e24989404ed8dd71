// TCP smoke check without VS Code (run by tests/test_editors.py):
//
//   node out/smoke/tcp.js HOST:PORT TOKEN OUT.json
//
// Connects to a running `ember --tcp` the way the extension does when `ember.tcp` is set
// (connection() + the token in toInitializationOptions()), initializes, and writes the server's
// capabilities (or the error) to OUT.json.
import * as fs from 'fs';
import * as net from 'net';
import {
  ExitNotification,
  InitializeRequest,
  InitializedNotification,
  ShutdownRequest,
  StreamMessageReader,
  StreamMessageWriter,
  createProtocolConnection,
} from 'vscode-languageserver-protocol/node';
import { connection, readSettings, toInitializationOptions } from '../config';

async function main(): Promise<void> {
  const [tcp, token, outPath] = process.argv.slice(2);
  const out: Record<string, unknown> = {};
  const values: Record<string, unknown> = { tcp, token, maxTokens: 16 };
  const settings = readSettings((k) => values[k]);
  const c = connection(settings);
  if (c.kind !== 'tcp') throw new Error('expected a tcp connection');
  out.target = { host: c.host, port: c.port };
  out.initializationOptions = toInitializationOptions(settings);
  const timer = setTimeout(() => {
    out.error = 'timeout';
    fs.writeFileSync(outPath, JSON.stringify(out, null, 2));
    process.exit(0);
  }, 60000);
  try {
    const socket = await new Promise<net.Socket>((resolve, reject) => {
      const s = net.connect(c.port, c.host);
      s.once('connect', () => resolve(s));
      s.once('error', reject);
    });
    const rpc = createProtocolConnection(new StreamMessageReader(socket), new StreamMessageWriter(socket));
    rpc.listen();
    const init = await rpc.sendRequest(InitializeRequest.type, {
      processId: process.pid,
      rootUri: null,
      initializationOptions: toInitializationOptions(settings),
      capabilities: {},
    });
    out.capabilities = init.capabilities;
    await rpc.sendNotification(InitializedNotification.type, {});
    await rpc.sendRequest(ShutdownRequest.type);
    await rpc.sendNotification(ExitNotification.type);
    socket.end();
  } catch (e) {
    out.error = e instanceof Error ? e.message : String(e);
  }
  clearTimeout(timer);
  fs.writeFileSync(outPath, JSON.stringify(out, null, 2));
  process.exit(0);
}

void main();
