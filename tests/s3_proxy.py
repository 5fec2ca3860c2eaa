"""An HTTP proxy in front of an S3 endpoint that counts requests by kind and can add latency.

Tests count the requests a job sends (``LIST`` pages, ``GET``, ``PUT``, ``HEAD``); benchmarks also
delay every request by ``latency_s`` to stand in for a remote object store. Point s3fs at
:attr:`S3Proxy.endpoint` instead of the server's own endpoint.

A benchmark can also keep the server's answers to a read-only job (:meth:`S3Proxy.record`) and
then answer the same job's requests from them (:meth:`S3Proxy.replay`): the client then meets
the latency and the same answers, but no server spending CPU on the machine's cores, as a
remote store's servers spend none there.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                          "proxy-connection", "te", "trailer", "upgrade"})


def request_kind(method: str, path: str) -> str:
    """``LIST`` for a bucket listing (a GET with ``list-type``, ``prefix`` or ``delimiter`` on the
    bucket), else the HTTP method."""
    parts = urlsplit(path)
    query = parse_qs(parts.query, keep_blank_values=True)
    on_bucket = parts.path.strip("/").count("/") == 0
    if method == "GET" and on_bucket and ({"list-type", "prefix", "delimiter"} & set(query)):
        return "LIST"
    return method


@dataclass(frozen=True)
class _Answer:
    """One upstream response: what the proxy sends back for it."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class S3Proxy:
    """Forwards every request to ``upstream`` (``http://host:port``), one kept-alive connection
    per client connection, after sleeping ``latency_s``; ``counts`` tallies the kinds."""

    def __init__(self, upstream: str, *, latency_s: float = 0.0) -> None:
        self.upstream = urlsplit(upstream)
        self.latency_s = latency_s
        self.counts: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []
        """(kind, path) of every request since the last :meth:`reset`."""
        self.max_in_flight = 0
        """Most requests forwarded at once since the last :meth:`reset`."""
        self.spans: list[tuple[str, float, float]] = []
        """(path, monotonic start, monotonic end) of every answered request since :meth:`reset`."""
        self.replay_misses = 0
        """Requests asked upstream while replaying (none kept for them) since :meth:`reset`."""
        self._kept: dict[tuple[str, str, str], _Answer] | None = None
        self._replaying = False
        self._in_flight = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """The proxy's own URL, for ``endpoint_url``."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def count(self, kind: str, path: str) -> float:
        """Tally one request, now in flight; returns its start time for :meth:`done`."""
        with self._lock:
            self.counts[kind] += 1
            self.log.append((kind, path))
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        return time.monotonic()

    def done(self, path: str, start: float) -> None:
        """One request answered."""
        with self._lock:
            self._in_flight -= 1
            self.spans.append((path, start, time.monotonic()))

    def reset(self) -> Counter[str]:
        """The counts so far, then start again from zero."""
        with self._lock:
            counts, self.counts, self.log, self.spans = self.counts, Counter(), [], []
            self.max_in_flight, self.replay_misses = self._in_flight, 0
        return counts

    def record(self) -> None:
        """From now on keep upstream's answer to every GET and HEAD, by method, path (with its
        query) and ``Range`` header, dropping any kept before."""
        self._kept, self._replaying = {}, False

    def replay(self) -> None:
        """From now on answer each kept request from memory after the latency, upstream not
        asked; the rest still go upstream (counted in :attr:`replay_misses`)."""
        if self._kept is None:
            raise RuntimeError("replay() needs record() first")
        self._replaying = True

    @property
    def replaying(self) -> bool:
        """Whether kept answers are being replayed (:meth:`replay`)."""
        return self._replaying

    def forward(self) -> None:
        """Ask upstream for every request again and keep nothing (the default)."""
        self._kept, self._replaying = None, False

    def answer(self, method: str, path: str, byte_range: str,
               ask: Callable[[], _Answer]) -> _Answer:
        """The answer to one request (``byte_range``: its ``Range`` header, or ""): kept or
        ``ask()``-ed, as :meth:`record` and :meth:`replay` say."""
        key, kept = (method, path, byte_range), self._kept
        if kept is not None and self._replaying and key in kept:
            return kept[key]
        got = ask()
        with self._lock:
            self.replay_misses += self._replaying
            if kept is not None and not self._replaying and method in ("GET", "HEAD"):
                kept[key] = got
        return got

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


def _handler(proxy: S3Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        upstream: http.client.HTTPConnection | None = None

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            """Quiet: a benchmark sends hundreds of thousands of requests."""

        def _forward(self) -> None:
            body = self._body()
            start = proxy.count(request_kind(self.command, self.path), self.path)
            try:
                self._answer(body)
            finally:
                proxy.done(self.path, start)

        def _answer(self, body: bytes | None) -> None:
            if proxy.latency_s:
                time.sleep(proxy.latency_s)
            got = proxy.answer(self.command, self.path, self.headers.get("Range", ""),
                               lambda: self._ask(body))
            self.send_response_only(got.status, got.reason)
            for key, value in got.headers:
                if key.lower() not in _HOP_HEADERS:
                    self.send_header(key, value)
            length = next((v for k, v in got.headers if k.lower() == "content-length"),
                          None) if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(got.body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(got.body)

        def _ask(self, body: bytes | None) -> _Answer:
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=300)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            self.upstream.request(self.command, self.path, body=body, headers=headers)
            response = self.upstream.getresponse()
            return _Answer(response.status, response.reason, response.getheaders(),
                           response.read())

        def _body(self) -> bytes | None:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else None

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

    return Handler
