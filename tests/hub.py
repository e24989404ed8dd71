"""A model hub on 127.0.0.1 that speaks enough of the Hugging Face Hub's HTTP API for
``huggingface_hub.snapshot_download`` (and ``HfApi.model_info``), so the download path runs for real
without the internet. Requests seen from huggingface_hub 2.4:

* ``GET /api/models/{repo}[/revision/{rev}]`` (``?blobs=true`` from ``model_info(files_metadata=True)``):
  the commit ``sha`` and ``siblings`` (file names, sizes);
* ``GET /api/models/{repo}/tree/{rev}?recursive=True&expand=False``: the file list (one page);
* ``HEAD`` then ``GET /{repo}/resolve/{rev}/{file}``: ``X-Repo-Commit``, ``ETag``, ``Content-Length``.

An unknown repo gets 404 with ``X-Error-Code: RepoNotFound``, as from the real hub.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

CHUNK = 1 << 20


@dataclass(frozen=True)
class HubFile:
    path: Path
    size: int
    oid: str  # the git blob id, which the hub also sends as ETag for files outside LFS


class LocalHub:
    """Serves ``repos`` ({"owner/name": folder}); ``seconds_per_mib`` slows file bodies down so that
    a download lasts long enough for progress reports to be seen."""

    def __init__(self, repos: dict[str, Path], seconds_per_mib: float = 0.0) -> None:
        self.commit = hashlib.sha1(b"ember-local-hub").hexdigest()
        self.seconds_per_mib = seconds_per_mib
        self.requests: list[str] = []  # "METHOD /path?query", in the order received
        self.files: dict[str, dict[str, HubFile]] = {
            repo: {f.name: self._describe(f) for f in sorted(folder.iterdir()) if f.is_file() and not f.name.startswith(".")}
            for repo, folder in repos.items()
        }
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @staticmethod
    def _describe(path: Path) -> HubFile:
        size = path.stat().st_size
        digest = hashlib.sha1(f"blob {size}\0".encode())
        with path.open("rb") as f:
            while block := f.read(CHUNK * 8):
                digest.update(block)
        return HubFile(path, size, digest.hexdigest())

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> LocalHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.answer(body=False)

            def do_GET(self) -> None:
                self.answer(body=True)

            def answer(self, body: bool) -> None:
                hub.requests.append(f"{self.command} {self.path}")
                path = unquote(urlsplit(self.path).path)
                if match := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
                    self.repo_info(match.group(1))
                elif match := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)", path):
                    self.tree(match.group(1))
                elif match := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
                    self.resolve(match.group(1), match.group(3), body)
                else:
                    self.send_json({"error": f"no route for {path}"}, 404)

            def known(self, repo: str) -> dict[str, HubFile] | None:
                files = hub.files.get(repo)
                if files is None:
                    self.send_json({"error": "Repository not found"}, 404, {"X-Error-Code": "RepoNotFound"})
                return files

            def repo_info(self, repo: str) -> None:
                if (files := self.known(repo)) is None:
                    return
                siblings = [{"rfilename": name, "size": f.size, "blobId": f.oid} for name, f in files.items()]
                self.send_json({"_id": repo, "id": repo, "modelId": repo, "sha": hub.commit, "private": False, "siblings": siblings})

            def tree(self, repo: str) -> None:
                if (files := self.known(repo)) is None:
                    return
                self.send_json([{"type": "file", "path": name, "size": f.size, "oid": f.oid} for name, f in files.items()])

            def resolve(self, repo: str, name: str, body: bool) -> None:
                if (files := self.known(repo)) is None:
                    return
                found = files.get(name)
                if found is None:
                    self.send_json({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(found.size))
                self.send_header("ETag", f'"{found.oid}"')
                self.send_header("X-Repo-Commit", hub.commit)
                self.end_headers()
                if not body:
                    return
                with found.path.open("rb") as f:
                    while block := f.read(CHUNK):
                        self.wfile.write(block)
                        if hub.seconds_per_mib:
                            time.sleep(hub.seconds_per_mib * len(block) / CHUNK)

            def send_json(self, value: object, status: int = 200, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for key, text in (headers or {}).items():
                    self.send_header(key, text)
                self.end_headers()
                self.wfile.write(data)

        return Handler
