"""LSP base-protocol framing (``Content-Length`` headers), shared by the server and the forwarder.

Import-light on purpose: the stdio forwarder uses it and must start in a fraction of a second.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable
from typing import Protocol

log = logging.getLogger(__name__)


class AsyncReader(Protocol):
    def readline(self) -> Awaitable[bytes]: ...

    def readexactly(self, n: int) -> Awaitable[bytes]: ...


# Raw CR LF bytes cannot occur inside a JSON text's strings, so this inside a body means that the
# body's Content-Length was wrong and the next message's header was swallowed.
_HEADER = re.compile(rb"Content-Length: \d+\r\n")


class ResyncReader:
    """Wraps pygls' reader so that a wrong Content-Length costs one message, not the connection.

    pygls only recognises a header at the start of a line: after a body that was declared too short,
    the next header arrives glued to the leftover bytes; after one declared too long, the body holds
    the next header. Either way every later message would be lost. Here a header found inside a line
    or a body starts a new message; the broken one is reported as unreadable JSON."""

    def __init__(self, inner: AsyncReader) -> None:
        self.inner = inner
        self.pending = b""

    async def readline(self) -> bytes:
        end = self.pending.find(b"\n")
        if end >= 0:
            line, self.pending = self.pending[: end + 1], self.pending[end + 1 :]
        else:
            line, self.pending = self.pending + await self.inner.readline(), b""
        start = line.find(b"Content-Length: ")
        if start > 0:
            log.warning("dropped %d bytes before a Content-Length header (a wrong length before it?)", start)
            line = line[start:]
        return line

    async def readexactly(self, n: int) -> bytes:
        body, self.pending = self.pending[:n], self.pending[n:]
        if len(body) < n:
            body += await self.inner.readexactly(n - len(body))
        header = _HEADER.search(body)
        if header:
            log.warning("a message body holds the next header: its Content-Length was too long")
            body, self.pending = body[: header.start()], body[header.start() :] + self.pending
        return body


async def read_message(reader: AsyncReader) -> bytes | None:
    """The next message body; None at the end of the stream. Headers other than Content-Length
    are read and ignored; a header block without one is skipped."""
    length: int | None = None
    while True:
        line = await reader.readline()
        if not line:
            return None
        if line in (b"\r\n", b"\n"):
            if length is not None:
                return await reader.readexactly(length)
            continue
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            length = int(value.strip())


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body
