"""A data row never decides what is contacted: the operator's allow-list, bounds on every read."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sparkforge.app.tiny_vl import png_bytes, tiny_image
from sparkforge.shared.image_sources import ImageReader, parse_image_sources
from sparkforge.shared.images import ImageProblem
from sparkforge.shared.safe_http import forbidden_address

PNG = png_bytes(tiny_image(1))


class _Server:
    """An HTTP server on 127.0.0.1 that records every path it is asked for."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                server.paths.append(self.path)
                if self.path.startswith("/redirect"):
                    self.send_response(302)
                    self.send_header("Location", f"http://127.0.0.1:{server.port}/images/a.png")
                    self.end_headers()
                elif self.path.startswith("/big"):
                    self.send_response(200)
                    self.end_headers()  # no Content-Length: the body is cut by the byte bound
                    self.wfile.write(b"x" * 4096)
                elif self.path.startswith("/drip"):
                    self.send_response(200)
                    self.end_headers()
                    for _ in range(50):
                        self.wfile.write(b"x")
                        self.wfile.flush()
                        time.sleep(0.1)
                elif self.path in ("/images/a.png", "/images2/a.png"):
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(PNG)))
                    self.end_headers()
                    self.wfile.write(PNG)
                else:
                    self.send_response(404)
                    self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def server() -> Iterator[_Server]:
    got = _Server()
    yield got
    got.httpd.shutdown()


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield sock.getsockname()[1]
    sock.close()


def test_by_default_no_remote_source_is_contacted(server: _Server, tmp_path: Path) -> None:
    """Without --image_sources every remote, chained or nested source is refused unread, and the
    server is never asked."""
    reader = ImageReader()
    cases = {
        f"{server.url}/images/a.png": ImageProblem.SOURCE_REFUSED,
        f"https://127.0.0.1:{server.port}/images/a.png": ImageProblem.SOURCE_REFUSED,
        "s3://bucket/a.png": ImageProblem.SOURCE_REFUSED,
        "gs://bucket/a.png": ImageProblem.SOURCE_REFUSED,
        "ftp://127.0.0.1/a.png": ImageProblem.PROTOCOL_REFUSED,
        "github://org:repo@main/a.png": ImageProblem.PROTOCOL_REFUSED,
        "hf://datasets/org/name/a.png": ImageProblem.PROTOCOL_REFUSED,
        f"simplecache::{server.url}/images/a.png": ImageProblem.PROTOCOL_REFUSED,
        f"zip://a.png::{server.url}/images/a.zip": ImageProblem.PROTOCOL_REFUSED,
        "http://169.254.169.254/latest/meta-data/": ImageProblem.SOURCE_REFUSED,
    }
    for source, problem in cases.items():
        assert reader.read(source, folder=str(tmp_path)) is problem, source
    assert server.paths == []


def test_an_allowed_host_reads_under_its_prefix_only(server: _Server) -> None:
    """http://127.0.0.1:PORT/images allows /images/..., not /images2/..., another port, or a
    '..' that climbs out of the prefix."""
    reader = ImageReader.from_options([f"{server.url}/images"])
    assert reader.read(f"{server.url}/images/a.png", folder=None) == PNG
    for source in (f"{server.url}/images2/a.png", f"http://127.0.0.1:{server.port + 1}/images/a",
                   f"{server.url}/images/../images2/a.png", f"http://localhost:{server.port}/images/a.png"):
        assert reader.read(source, folder=None) is ImageProblem.SOURCE_REFUSED, source
    assert server.paths == ["/images/a.png"]
    assert reader.read(f"{server.url}/images/gone.png", folder=None) is ImageProblem.MISSING


def test_a_redirect_is_not_followed(server: _Server) -> None:
    """A 302 from an allowed host, even to an allowed URL, is not followed: the row's image is
    unreadable and the second URL is never asked for."""
    server.paths.clear()
    reader = ImageReader.from_options([server.url])
    assert reader.read(f"{server.url}/redirect", folder=None) is ImageProblem.UNREADABLE
    assert server.paths == ["/redirect"]


@pytest.mark.parametrize("address", ["169.254.169.254", "169.254.1.1", "fe80::1", "fd00:ec2::254",
                                     "::ffff:169.254.169.254", "100.100.100.200", "0.0.0.0",
                                     "224.0.0.1"])
def test_link_local_and_metadata_addresses_are_never_contacted(address: str) -> None:
    """Each link-local, metadata, unspecified or multicast address is forbidden, even when the
    operator allowed it by name, and the allowed-host reader refuses it before connecting."""
    assert forbidden_address(address) is not None
    host = f"[{address}]" if ":" in address else address
    reader = ImageReader.from_options([f"http://{host}"], timeout_s=0.5)
    assert reader.read(f"http://{host}/latest/meta-data/", folder=None) is (
        ImageProblem.ADDRESS_REFUSED)


def test_ordinary_addresses_are_allowed() -> None:
    """Loopback, private and public addresses may be contacted once their host is allowed."""
    for address in ("127.0.0.1", "10.0.0.1", "192.168.1.1", "8.8.8.8", "::1"):
        assert forbidden_address(address) is None, address


def test_metadata_host_names_are_refused_by_name() -> None:
    """metadata.google.internal is refused before any DNS answer is used."""
    reader = ImageReader.from_options(["http://metadata.google.internal"])
    assert reader.read("http://metadata.google.internal/computeMetadata/v1/",
                       folder=None) is ImageProblem.ADDRESS_REFUSED


def test_http_reads_are_bounded_in_bytes_and_time(server: _Server, silent_port: int) -> None:
    """A body past max_bytes, a silent server and a server that drips a byte every 0.1 s end
    as their own problems instead of holding the run."""
    reader = ImageReader.from_options([server.url, f"http://127.0.0.1:{silent_port}"],
                                      max_bytes=1024, timeout_s=1.0)
    assert reader.read(f"{server.url}/big", folder=None) is ImageProblem.TOO_MANY_BYTES
    assert reader.read(f"http://127.0.0.1:{silent_port}/a.png",
                       folder=None) is ImageProblem.READ_TIMEOUT
    assert reader.read(f"{server.url}/drip", folder=None) is ImageProblem.READ_TIMEOUT


def test_local_paths_stay_in_the_data_folder_or_an_allowed_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative path resolves against the data file's folder, not the current directory; an
    absolute path, a '..' or a symbolic link leading out of the allowed folders is refused."""
    data, other, cwd = tmp_path / "data", tmp_path / "other", tmp_path / "cwd"
    for folder in (data / "images", other, cwd / "images"):
        folder.mkdir(parents=True)
    (data / "images" / "a.png").write_bytes(PNG)
    (cwd / "images" / "a.png").write_bytes(b"the wrong file")
    (other / "b.png").write_bytes(PNG)
    (data / "images" / "link.png").symlink_to(other / "b.png")
    monkeypatch.chdir(cwd)
    reader = ImageReader()
    assert reader.read("images/a.png", folder=str(data)) == PNG
    assert reader.read(str(data / "images" / "a.png"), folder=str(data)) == PNG
    assert reader.read(f"file://{data}/images/a.png", folder=str(data)) == PNG
    for source in (str(other / "b.png"), "../other/b.png", "images/link.png", "/etc/passwd",
                   f"file://{other}/b.png"):
        assert reader.read(source, folder=str(data)) is ImageProblem.PATH_REFUSED, source
    assert reader.read("images/a.png", folder=None) is ImageProblem.PATH_REFUSED
    allowed = ImageReader.from_options([str(other)])
    assert allowed.read(str(other / "b.png"), folder=str(data)) == PNG
    assert allowed.read("images/link.png", folder=str(data)) == PNG
    assert allowed.read("images/gone.png", folder=str(data)) is ImageProblem.MISSING


def test_special_and_oversized_local_files_are_never_read_whole(tmp_path: Path) -> None:
    """/dev/zero, a FIFO and a folder are not regular files (no read, no hang); a file past
    max_bytes is refused from its size."""
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    (tmp_path / "big.png").write_bytes(b"x" * 2048)
    reader = ImageReader.from_options(["/dev"], max_bytes=1024)
    assert reader.read("/dev/zero", folder=None) is ImageProblem.NOT_A_FILE
    assert reader.read("/dev/urandom", folder=None) is ImageProblem.NOT_A_FILE
    assert reader.read("pipe.png", folder=str(tmp_path)) is ImageProblem.NOT_A_FILE
    assert reader.read(".", folder=str(tmp_path)) is ImageProblem.NOT_A_FILE
    assert reader.read("big.png", folder=str(tmp_path)) is ImageProblem.TOO_MANY_BYTES
    assert reader.read(b"x" * 2048, folder=None) is ImageProblem.TOO_MANY_BYTES


def test_a_remote_data_folder_allows_its_own_images(moto_server: dict[str, Any]) -> None:
    """A row of s3://bucket/chats/data.jsonl reads images/a.png from s3://bucket/chats/images/
    (the folder the operator named), but not from elsewhere in the bucket without an entry."""
    import fsspec

    bucket, options = moto_server["bucket"], moto_server["storage_options"]
    for key in ("chats/images/a.png", "private/b.png"):
        with fsspec.open(f"s3://{bucket}/{key}", "wb", **options) as f:
            f.write(PNG)
    reader = ImageReader.from_options([], storage_options=options)
    folder = f"s3://{bucket}/chats"
    assert reader.read("images/a.png", folder=folder) == PNG
    assert reader.read(f"s3://{bucket}/chats/images/a.png", folder=folder) == PNG
    for source in ("../private/b.png", f"s3://{bucket}/private/b.png"):
        assert reader.read(source, folder=folder) is ImageProblem.SOURCE_REFUSED, source
    allowed = ImageReader.from_options([f"s3://{bucket}/private"], storage_options=options)
    assert allowed.read(f"s3://{bucket}/private/b.png", folder=folder) == PNG
    assert allowed.read(f"s3://{bucket}/private/gone.png", folder=folder) is ImageProblem.MISSING


def test_a_store_failure_is_the_image_problem() -> None:
    """An allowed bucket the client cannot reach is image_unreadable, not an exception."""
    reader = ImageReader.from_options(["s3://bucket"], timeout_s=2.0, storage_options={
        "endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s",
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}})
    assert reader.read("s3://bucket/a.png", folder=None) is ImageProblem.UNREADABLE


@pytest.mark.parametrize(("entry", "match"), [
    ("ftp://host/images", "protocol 'ftp' cannot be allowed"),
    ("hf://datasets/x", "protocol 'hf' cannot be allowed"),
    ("simplecache::s3://b", "chained protocols"),
    ("s3://", "name the bucket or host"),
    ("https:///images", "name the bucket or host"),
    ("", "expected a folder or a remote prefix"),
])
def test_a_bad_image_sources_entry_is_refused_naming_it(entry: str, match: str) -> None:
    """Each unusable --image_sources entry is refused with its index and the rule."""
    with pytest.raises(ValueError, match=match) as info:
        parse_image_sources(["/data/images", entry])
    assert "--image_sources[1]" in str(info.value)
