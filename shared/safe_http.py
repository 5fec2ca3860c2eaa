"""One bounded HTTP(S) GET to a host whose every address was vetted first.

A data row may name an image by URL; this client is how such a URL is read once the operator has
allowed its host. It resolves the host once, refuses it if any address is link-local, a cloud
metadata service, unspecified, multicast or reserved, and connects to the vetted address itself
(so a second DNS answer cannot swap it). It follows no redirect, ignores proxy variables, and
bounds the whole read in bytes and seconds.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
from dataclasses import dataclass
from urllib.parse import SplitResult

from sparkforge.shared.errors import SparkforgeError

METADATA_HOSTS = frozenset({"metadata", "metadata.google.internal", "metadata.goog",
                            "instance-data", "instance-data.ec2.internal"})
"""Host names of cloud metadata services (they resolve to link-local addresses too)."""
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200"))
"""AWS/GCP/Azure/OpenStack, AWS ECS task, AWS IPv6 and Alibaba metadata endpoints."""
_CHUNK_BYTES = 1 << 16


class FetchRefused(SparkforgeError):
    """The URL's host is one this client never contacts (the message says why)."""


class FetchFailed(SparkforgeError):
    """The server could not be reached, answered no 200, sent too much or took too long."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind
        """``missing`` (404/410), ``too_large``, ``timeout`` or ``unreadable``."""


@dataclass(frozen=True)
class Limits:
    """What one read may take."""

    max_bytes: int
    timeout_s: float


def forbidden_address(address: str) -> str | None:
    """Why ``address`` is never contacted, or None when it may be."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        ip = mapped
    if ip in METADATA_ADDRESSES:
        return f"{ip} is a cloud metadata address"
    flags = ["is_link_local", "is_unspecified", "is_multicast"]
    if ip.version == 4:  # IPv6's "reserved" ::/8 holds loopback ::1
        flags.append("is_reserved")
    for flag in flags:
        if getattr(ip, flag):
            return f"{ip} is {flag.removeprefix('is_').replace('_', '-')}"
    return None


def vetted_address(host: str, port: int) -> str:
    """The address to connect to: the host's first, once every one it resolves to is allowed.

    Raises:
        FetchRefused: a metadata host name, an address never contacted, or no address at all.
    """
    if host.lower().rstrip(".") in METADATA_HOSTS:
        raise FetchRefused(f"{host} is a cloud metadata host")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchRefused(f"{host} does not resolve ({exc})") from exc
    for info in infos:
        why = forbidden_address(str(info[4][0]))
        if why is not None:
            raise FetchRefused(f"{host} resolves to {why}")
    return str(infos[0][4][0])


def bounded_get(url: SplitResult, limits: Limits) -> bytes:
    """The body of a 200 answer to GET ``url`` (http or https), read within ``limits``.

    A timer shuts the socket down at the deadline, so neither a silent server nor one that
    drips a byte at a time holds the read longer than ``limits.timeout_s``.

    Raises:
        FetchRefused: see :func:`vetted_address`.
        FetchFailed: anything else that stops the read.
    """
    host = url.hostname or ""
    port = url.port or (443 if url.scheme == "https" else 80)
    address = vetted_address(host, port)
    expired = threading.Event()
    try:
        sock = socket.create_connection((address, port), timeout=limits.timeout_s)
    except TimeoutError as exc:
        raise FetchFailed(f"no connection within {limits.timeout_s:g} s", kind="timeout") from exc
    except OSError as exc:
        raise FetchFailed(f"cannot connect: {exc}", kind="unreadable") from exc
    timer = threading.Timer(limits.timeout_s, _expire, args=(sock, expired))
    timer.start()
    try:
        if url.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        connection = http.client.HTTPConnection(host, port, timeout=limits.timeout_s)
        connection.sock = sock
        with contextlib.closing(connection):
            path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            connection.request("GET", path, headers={"Accept": "image/*"})
            body = _body(connection.getresponse(), limits)
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise FetchFailed(f"not read within {limits.timeout_s:g} s", kind="timeout") from exc
        raise FetchFailed(f"{type(exc).__name__}: {exc}", kind="unreadable") from exc
    finally:
        timer.cancel()
        sock.close()
    if expired.is_set():  # the shutdown may end the body early, as if complete
        raise FetchFailed(f"not read within {limits.timeout_s:g} s", kind="timeout")
    return body


def _expire(sock: socket.socket, expired: threading.Event) -> None:
    expired.set()
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _body(response: http.client.HTTPResponse, limits: Limits) -> bytes:
    if response.status in (404, 410):
        raise FetchFailed(f"HTTP {response.status}", kind="missing")
    if response.status != 200:
        where = response.getheader("Location")
        raise FetchFailed(f"HTTP {response.status}" + (f" (redirect to {where!r} not followed)"
                                                       if where else ""), kind="unreadable")
    declared = response.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_bytes:
        raise FetchFailed(f"{int(declared):,} bytes declared", kind="too_large")
    chunks, total = [], 0
    while chunk := response.read1(_CHUNK_BYTES):
        total += len(chunk)
        if total > limits.max_bytes:
            raise FetchFailed(f"more than {limits.max_bytes:,} bytes", kind="too_large")
        chunks.append(chunk)
    return b"".join(chunks)
