"""What an S3 request costs our client in CPU, three choices against their baselines.

- **Timestamp parser.** Every S3 response carries times: each listed object's ``LastModified``
  (ISO 8601) and each GET's ``Last-Modified`` header (an HTTP date), and botocore's default
  parser reads both with dateutil; ``storage.open_location`` installs a cheaper one.
- **One parse per listing page.** botocore parses every S3 answer of status 200 with ElementTree
  to look for an ``<Error>`` inside, before its response parser parses it again;
  ``storage.open_location`` skips that first parse for a listing page that ends as a whole one.
- **Reads on the loop.** ``storage.read_many`` sends an asynchronous filesystem's reads as
  coroutines on its loop, a batch at a time; the baseline is a thread per read, each waiting on
  the loop (``storage.map_ahead`` of ``storage.read_bytes``, which read_many did before).

This prints, in one run, this process's CPU per GET (32 in flight) and per 1,000-object LIST page
(``storage.s3_objects``; the pages with each error check have the cheaper parser), interleaved
over rounds against the tests' S3 server (``tests/s3_server.py``, another process), the medians
and their ratios.

    .venv/bin/python -P benchmarks/bench_s3_client.py

``--s3rver PATH`` serves S3 with s3rver (``npm install s3rver@3.7.1``), whose listing pages
carry less per object than moto's.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"
BUCKET = "bench-s3-client"
OBJECTS = 3000


@contextmanager
def s3_server(s3rver: str | None) -> Iterator[tuple[str, str]]:
    """(endpoint, access key = secret) of the tests' moto server, or of s3rver at ``s3rver``."""
    if s3rver is None:
        server = subprocess.Popen([sys.executable, "-P", str(TESTS / "s3_server.py")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert server.stdin is not None
        assert server.stdout is not None
        try:
            yield f"http://127.0.0.1:{int(server.stdout.readline())}", "testing"
        finally:
            server.stdin.close()
            server.wait()
        return
    sys.path.insert(0, str(TESTS))
    from s3_server import S3RVER_KEY, start_s3rver

    with tempfile.TemporaryDirectory() as folder:
        node, port = start_s3rver(s3rver, folder)
        try:
            yield f"http://127.0.0.1:{port}", S3RVER_KEY
        finally:
            node.terminate()
            node.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--gets", type=int, default=1000, help="GETs per round and parser")
    p.add_argument("--s3rver", metavar="PATH", help="serve S3 with this s3rver executable")
    args = p.parse_args()

    import boto3
    from botocore.handlers import _handle_200_error
    from botocore.utils import parse_timestamp

    from sparkforge.shared import storage

    with s3_server(args.s3rver) as (endpoint, access_key):
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=access_key, aws_secret_access_key=access_key)
        s3.create_bucket(Bucket=BUCKET)
        keys = [f"cache/c/{i:05d}" for i in range(OBJECTS)]
        for key in keys:
            s3.put_object(Bucket=BUCKET, Key=key, Body=b"x" * 200)
        loc = storage.open_location(f"s3://{BUCKET}/cache", {
            "endpoint_url": endpoint, "key": access_key, "secret": access_key,
            "client_kwargs": {"region_name": "us-east-1"}})
        factory = loc.fs.session.get_component("response_parser_factory")
        parsers: dict[str, Callable[[Any], Any]] = {
            "botocore's parser": parse_timestamp, "open_location's": storage._parse_timestamp}
        names = [k.split("/", 1)[1] for k in keys[:args.gets]]
        per_get: dict[str, list[float]] = {name: [] for name in parsers}
        per_page: dict[str, list[float]] = {name: [] for name in parsers}
        threaded: list[float] = []
        checks: dict[str, Callable[..., None]] = {
            "botocore's check": _handle_200_error, "open_location's": storage._check_200_error}
        per_checked_page: dict[str, list[float]] = {name: [] for name in checks}
        events = loc.fs.s3.meta.events
        for _ in range(args.rounds):
            for name, parser in parsers.items():
                factory.set_parser_defaults(timestamp_parser=parser)
                start = time.process_time()
                failed = [(key, data) for key, data in storage.read_many(
                    loc, names, max_concurrency=32) if not isinstance(data, bytes)]
                assert not failed, failed[:3]
                per_get[name].append((time.process_time() - start) / args.gets * 1e3)
                start = time.process_time()
                assert sum(1 for _ in storage.s3_objects(loc, "c")) == OBJECTS
                per_page[name].append((time.process_time() - start) / (OBJECTS / 1000) * 1e3)
            start = time.process_time()  # the cheaper parser still in place
            assert all(isinstance(data, bytes) for _, data in storage.map_ahead(
                lambda key: storage.read_bytes(loc, key), names, max_concurrency=32,
                name="bench"))
            threaded.append((time.process_time() - start) / args.gets * 1e3)
            for name, check in checks.items():
                for other in checks.values():
                    events.unregister("before-parse.s3.*", unique_id=other.__name__)
                    events.unregister("before-parse.s3.*", other)
                events.register_first("before-parse.s3.*", check, unique_id=check.__name__)
                start = time.process_time()
                assert sum(1 for _ in storage.s3_objects(loc, "c")) == OBJECTS
                per_checked_page[name].append(
                    (time.process_time() - start) / (OBJECTS / 1000) * 1e3)
    print(f"client CPU ms, median of {args.rounds} rounds "
          f"({args.gets} GETs, {OBJECTS // 1000} LIST pages each)")
    print(f"{'':24}{'per GET':>10}{'per LIST page':>16}")
    medians = {name: (statistics.median(per_get[name]), statistics.median(per_page[name]))
               for name in parsers}
    for name, (get, page) in medians.items():
        print(f"{name:24}{get:10.3f}{page:16.2f}")
    (old_get, old_page), (new_get, new_page) = medians.values()
    print(f"{'ratio (botocore / ours)':24}{old_get / new_get:10.2f}{old_page / new_page:16.2f}")
    threads = statistics.median(threaded)
    print(f"\nper GET, our parser: a thread per read {threads:.3f}, read_many on the loop "
          f"{new_get:.3f}, ratio {threads / new_get:.2f}")
    old_check, new_check = (statistics.median(per_checked_page[name]) for name in checks)
    print(f"\nper LIST page, our parser: botocore's 200-error check {old_check:.2f}, "
          f"open_location's {new_check:.2f}, ratio {old_check / new_check:.2f}")
    print(f"\nreproduce: .venv/bin/python -P benchmarks/bench_s3_client.py --rounds {args.rounds} "
          f"--gets {args.gets}" + (f" --s3rver {args.s3rver}" if args.s3rver else ""))


if __name__ == "__main__":
    main()
