"""moto's S3 service alone on 127.0.0.1: the S3 server of the tests and benchmarks.

``python -m moto.server`` sends every request through its all-services dispatcher first, which,
under one lock, lists moto's package folders (a stat of each of about 200) and tries every
service's URL patterns before it picks S3: a third of the server's CPU on validate's requests
(py-spy, 10^6 samples). Serving moto's S3 app itself answers the same requests with the same
code, minus that step.

Run as a script, it prints its port on stdout and serves until stdin closes.
"""

from __future__ import annotations

import logging
import sys
import threading

from werkzeug.serving import BaseWSGIServer, make_server


def start_s3_server(port: int = 0) -> BaseWSGIServer:
    """moto's S3 app on ``127.0.0.1:port`` (0: any free port), served on a daemon thread, one
    thread per request; stop it with ``shutdown()``."""
    from moto.moto_server.werkzeug_app import create_backend_app

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = make_server("127.0.0.1", port, create_backend_app("s3"), threaded=True)
    threading.Thread(target=server.serve_forever, name="s3-server", daemon=True).start()
    return server


def main() -> None:
    server = start_s3_server()
    print(server.server_address[1], flush=True)
    sys.stdin.read()
    server.shutdown()


if __name__ == "__main__":
    main()
