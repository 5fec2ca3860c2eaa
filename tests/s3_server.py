"""moto's S3 service alone on 127.0.0.1: the S3 server of the tests and benchmarks.

``python -m moto.server`` sends every request through its all-services dispatcher first, which,
under one lock, lists moto's package folders (a stat of each of about 200) and tries every
service's URL patterns before it picks S3: a third of the server's CPU on validate's requests
(py-spy, 10^6 samples). Serving moto's S3 app itself answers the same requests with the same
code, minus that step.

Run as a script, it prints its port on stdout and serves until stdin closes.
:func:`start_on_free_port` starts the other servers the benchmarks compare it with
(:func:`start_s3rver` one of them).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping

from werkzeug.serving import BaseWSGIServer, make_server


def start_s3_server(port: int = 0) -> BaseWSGIServer:
    """moto's S3 app on ``127.0.0.1:port`` (0: any free port), served on a daemon thread, one
    thread per request; stop it with ``shutdown()``."""
    from moto.moto_server.werkzeug_app import create_backend_app

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = make_server("127.0.0.1", port, create_backend_app("s3"), threaded=True)
    threading.Thread(target=server.serve_forever, name="s3-server", daemon=True).start()
    return server


S3RVER_KEY = "S3RVER"
"""s3rver's access key and secret."""


def start_s3rver(executable: str, folder: str) -> tuple[subprocess.Popen[bytes], int]:
    """s3rver (``npm install s3rver@3.7.1``) serving ``folder`` on a free port of 127.0.0.1."""
    # Its continuation tokens use a cipher OpenSSL 3 keeps in its legacy provider.
    return start_on_free_port([executable, "-d", folder, "-a", "127.0.0.1", "--silent"],
                              env={"NODE_OPTIONS": "--openssl-legacy-provider"})


def start_on_free_port(argv: list[str], *, env: Mapping[str, str] | None = None,
                       ) -> tuple[subprocess.Popen[bytes], int]:
    """Another server's command (moto's own, s3rver) with ``-p PORT`` added, a free port, once
    it accepts connections (at most 60 s).

    Raises:
        RuntimeError: the server exited or did not listen in time.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([*argv, "-p", str(port)], env=None if env is None else
                              os.environ | dict(env), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise RuntimeError(f"{argv[0]} did not start on port {port}") from None
            time.sleep(0.2)


def main() -> None:
    server = start_s3_server()
    print(server.server_address[1], flush=True)
    sys.stdin.read()
    server.shutdown()


if __name__ == "__main__":
    main()
