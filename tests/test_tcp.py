"""`ember --tcp` on 127.0.0.1: real completions, and two editor sessions at once that keep their
documents and settings apart while sharing one embedded engine."""

from __future__ import annotations

import asyncio

import pytest
from lsprotocol import types
from pygls.exceptions import JsonRpcException
from pygls.lsp.client import LanguageClient

from tests.conftest import client_capabilities, plain, stats, wait_ready

SAME_URI = "file:///work/shared_name.py"


pytestmark = pytest.mark.slow  # every test here talks to the session's ember --tcp (conftest.tcp_server) and its engine


async def connect(address, options=None) -> LanguageClient:
    client = LanguageClient("tcp-test", "1")
    await client.start_tcp(*address)
    await client.initialize_async(
        types.InitializeParams(capabilities=client_capabilities(), initialization_options=options or {})
    )
    client.initialized(types.InitializedParams())
    return client


async def disconnect(client: LanguageClient) -> None:
    """shutdown + exit; the server then closes the connection (a reset is the same as a close)."""
    await client.shutdown_async(None)
    client.exit(None)
    try:
        await client.stop()
    except ConnectionResetError:
        pass


async def inline(client, uri, line, character):
    result = await client.text_document_inline_completion_async(
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=line, character=character),
            context=types.InlineCompletionContext(trigger_kind=types.InlineCompletionTriggerKind.Invoked),
        )
    )
    return [item.insert_text for item in result.items]


async def test_binds_loopback_by_default(tcp_server):
    host, _ = tcp_server
    assert host == "127.0.0.1"


async def test_two_sessions_keep_documents_apart(tcp_server, sample_text):
    first = await connect(tcp_server, {"maxTokens": 16})
    second = await connect(tcp_server, {"maxTokens": 8})
    try:
        await wait_ready(first)
        # Both open the same URI with different text: each session sees only its own.
        text_a = sample_text + "\n\ndef total_quantity(inventory: Inventory) -> int:\n    return "
        text_b = "import math\n\n\ndef circle_area(radius: float) -> float:\n    return "
        for client, text in ((first, text_a), (second, text_b)):
            client.text_document_did_open(
                types.DidOpenTextDocumentParams(types.TextDocumentItem(SAME_URI, "python", 1, text))
            )
        pos_a = (text_a.count("\n"), len(text_a.rsplit("\n", 1)[1]))
        pos_b = (text_b.count("\n"), len(text_b.rsplit("\n", 1)[1]))
        a, b = await asyncio.gather(inline(first, SAME_URI, *pos_a), inline(second, SAME_URI, *pos_b))
        assert a and a[0].strip() and b and b[0].strip(), (a, b)
        # A position valid only in the long document is an error in the short one's session.
        with pytest.raises(JsonRpcException, match="line"):
            await inline(second, SAME_URI, pos_a[0], 0)
        # Closing in one session leaves the other's document open.
        first.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(SAME_URI)))
        assert await inline(second, SAME_URI, *pos_b) == b
        with pytest.raises(JsonRpcException, match="unknown document"):
            await inline(first, SAME_URI, *pos_a)
        # Both sessions share one engine (and its metrics).
        assert (await stats(first))["requests"] == (await stats(second))["requests"]
    finally:
        for client in (first, second):
            await disconnect(client)


async def test_one_session_ending_leaves_the_server_serving(tcp_server):
    await disconnect(await connect(tcp_server))
    again = await connect(tcp_server)
    try:
        assert (await stats(again))["engine"]["ready"]
    finally:
        await disconnect(again)


async def test_tcp_server_is_long_lived_and_an_explicit_engine_arg_wins(tcp_server):
    """``--tcp`` picks compiled mode on the CPU (long-lived process); this server was started with
    ``--engine-arg enforce_eager=true``, which overrides it."""
    client = await connect(tcp_server)
    try:
        engine = (await wait_ready(client))["engine"]
        assert engine["long_lived"] is True
        assert engine["engine_args"]["enforce_eager"] is True
        assert engine["max_model_len"] == 2048 and engine["budget"]["context_tokens"] == 1024
    finally:
        await disconnect(client)


async def test_engine_settings_of_a_later_editor_are_reported_as_not_used(tcp_server):
    """The shared engine started with the server's command line; an editor's engineArgs cannot
    change it, and the editor is told so instead of silently getting another context length."""
    client = LanguageClient("tcp-test", "1")
    messages: list[str] = []
    client.feature(types.WINDOW_SHOW_MESSAGE)(lambda params: messages.append(params.message))
    await client.start_tcp(*tcp_server)
    await client.initialize_async(
        types.InitializeParams(capabilities=client_capabilities(), initialization_options={"engineArgs": {"max_model_len": 4096}})
    )
    client.initialized(types.InitializedParams())
    try:
        engine = (await wait_ready(client))["engine"]
        for _ in range(50):
            if messages:
                break
            await asyncio.sleep(0.1)
        assert any("already started with its own engineArgs" in m for m in messages), messages
        assert engine["max_model_len"] == 2048
    finally:
        await disconnect(client)


def workspace_params(root, options=None, watch=False) -> types.InitializeParams:
    capabilities = client_capabilities()
    if watch:
        capabilities.workspace = types.WorkspaceClientCapabilities(
            did_change_watched_files=types.DidChangeWatchedFilesClientCapabilities(dynamic_registration=True)
        )
    return types.InitializeParams(
        capabilities=capabilities,
        initialization_options=options or {},
        root_uri=root.as_uri(),
        workspace_folders=[types.WorkspaceFolder(root.as_uri(), root.name)],
    )


async def connect_in(address, root, watch=False) -> tuple[LanguageClient, list[types.RegistrationParams]]:
    """A session whose workspace folder is ``root``; the file-watcher registrations it is sent."""
    client = LanguageClient("tcp-test", "1")
    registrations: list[types.RegistrationParams] = []

    @client.feature(types.CLIENT_REGISTER_CAPABILITY)
    def register(params: types.RegistrationParams) -> None:
        registrations.append(params)

    await client.start_tcp(*address)
    await client.initialize_async(workspace_params(root, {"maxTokens": 8}, watch))
    client.initialized(types.InitializedParams())
    return client, registrations


async def listed(client, files: int) -> dict:
    for _ in range(100):
        current = await stats(client)
        if current["workspace"]["scan_done"] and current["workspace"]["files"] >= files:
            return current["workspace"]
        await asyncio.sleep(0.1)
    raise AssertionError(f"the workspace was not listed: {current['workspace']}")


async def cross_file_of(client, uri, text, why: list[str] | None = None) -> list[str]:
    """Completes at the end of ``text`` (opened as ``uri``); the other files the prompt used (and
    into ``why``, what of them and why: ``ember/stats`` ``cross_file_why``)."""
    client.text_document_did_open(types.DidOpenTextDocumentParams(types.TextDocumentItem(uri, "python", 1, text)))
    await inline(client, uri, text.count("\n"), len(text.rsplit("\n", 1)[1]))
    last = plain(await client.protocol.send_request_async("ember/stats", {"uri": uri}))["last_for_uri"]
    client.text_document_did_close(types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri)))
    if why is not None:
        why.extend(last["cross_file_why"])
    return last["cross_file"]


MAIN_TEXT = "from alpha import alpha_rate\nfrom beta import beta_rate\n\n\ndef total(x):\n    return "


async def test_two_sessions_with_different_roots_see_only_their_own_files(tcp_server, tmp_path):
    roots = {}
    for name in ("alpha", "beta"):
        root = roots[name] = tmp_path / f"root_{name}"
        root.mkdir()
        (root / f"{name}.py").write_text(f"def {name}_rate(x: float) -> float:\n    return x * 2\n")
    first, _ = await connect_in(tcp_server, roots["alpha"])
    second, _ = await connect_in(tcp_server, roots["beta"])
    try:
        await wait_ready(first)
        assert (await listed(first, 1))["roots"] == [str(roots["alpha"])]
        assert (await listed(second, 1))["roots"] == [str(roots["beta"])]
        # The same imports in both: each session's prompt has only its own folder's file.
        why: list[str] = []
        assert await cross_file_of(first, (roots["alpha"] / "main.py").as_uri(), MAIN_TEXT, why) == ["alpha.py"]
        assert why == ["alpha.py: alpha_rate: imported, not used yet"]  # and the rank reason
        assert await cross_file_of(second, (roots["beta"] / "main.py").as_uri(), MAIN_TEXT) == ["beta.py"]
        # A document outside the session's folders gets no workspace context.
        assert await cross_file_of(first, (roots["beta"] / "main.py").as_uri(), MAIN_TEXT) == []
        # The editor swaps its folder: now the other one's files.
        first.workspace_did_change_workspace_folders(
            types.DidChangeWorkspaceFoldersParams(
                types.WorkspaceFoldersChangeEvent(
                    added=[types.WorkspaceFolder(roots["beta"].as_uri(), "beta")],
                    removed=[types.WorkspaceFolder(roots["alpha"].as_uri(), "alpha")],
                )
            )
        )
        assert (await listed(first, 1))["roots"] == [str(roots["beta"])]
        assert await cross_file_of(first, (roots["beta"] / "main.py").as_uri(), MAIN_TEXT) == ["beta.py"]
    finally:
        for client in (first, second):
            await disconnect(client)


async def test_a_file_created_on_disk_is_used_after_the_watcher_reports_it(tcp_server, tmp_path):
    root = tmp_path / "watched"
    root.mkdir()
    (root / "main.py").write_text("")
    client, registrations = await connect_in(tcp_server, root, watch=True)
    try:
        await wait_ready(client)
        await listed(client, 1)
        assert [r.method for p in registrations for r in p.registrations] == [types.WORKSPACE_DID_CHANGE_WATCHED_FILES]
        text = "from gamma import gamma_rate\n\n\ndef total(x):\n    return "
        uri = (root / "main.py").as_uri()
        assert await cross_file_of(client, uri, text) == []  # gamma.py does not exist yet
        (root / "gamma.py").write_text("def gamma_rate(x: float) -> float:\n    return x / 2\n")
        client.workspace_did_change_watched_files(
            types.DidChangeWatchedFilesParams([types.FileEvent((root / "gamma.py").as_uri(), types.FileChangeType.Created)])
        )
        await listed(client, 2)
        assert await cross_file_of(client, uri, text) == ["gamma.py"]
        (root / "gamma.py").unlink()
        client.workspace_did_change_watched_files(
            types.DidChangeWatchedFilesParams([types.FileEvent((root / "gamma.py").as_uri(), types.FileChangeType.Deleted)])
        )
        for _ in range(50):
            if (await stats(client))["workspace"]["files"] == 1:
                break
            await asyncio.sleep(0.1)
        assert await cross_file_of(client, uri, text) == []
    finally:
        await disconnect(client)
