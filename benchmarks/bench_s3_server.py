"""What the tests' S3 server costs per request: moto's all-services server against its S3 app alone.

The tests and ``bench_scale.py`` serve S3 with ``tests/s3_server.py`` (moto's S3 app, no
dispatcher). This prints, for both servers in one run, the server process's CPU per GET and per
one-page LIST of a fixed 1,000-key folder while the bucket grows (1k, 4k and 16k keys), with the
ratio and the growth exponent. A page's cost is mostly moto writing its XML (1,000 keys, each
key's time through dateutil), and it scans the whole bucket for each page: about half of a page's
CPU at 10^6 samples (125k objects, py-spy of ``bench_scale.py``), too little to see at 16k.

    .venv/bin/python -P benchmarks/bench_s3_server.py
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(TESTS))
from bench_scale_read import cpu_seconds  # noqa: E402
from s3_server import start_on_free_port  # noqa: E402

SERVER = TESTS / "s3_server.py"
BUCKET = "bench-s3-server"
PAGE = 1000


def start(kind: str) -> tuple[subprocess.Popen[Any], str]:
    """``dispatcher``: ``python -m moto.server``; ``s3-app``: ``tests/s3_server.py``."""
    if kind == "s3-app":
        proc = subprocess.Popen([sys.executable, "-P", str(SERVER)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        return proc, f"http://127.0.0.1:{int(proc.stdout.readline())}"
    proc, port = start_on_free_port([sys.executable, "-m", "moto.server", "-H", "127.0.0.1"])
    return proc, f"http://127.0.0.1:{port}"


def client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id="testing", aws_secret_access_key="testing")


def put(s3: Any, keys: list[str]) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: s3.put_object(Bucket=BUCKET, Key=k, Body=b"x" * 200), keys))


def measure(proc: subprocess.Popen[Any], s3: Any, gets: int) -> tuple[float, float]:
    """Server CPU ms per GET (of ``gets`` objects, 16 at a time) and per one LIST page."""
    before = cpu_seconds(proc.pid)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: s3.get_object(Bucket=BUCKET, Key=f"page/{i:06d}")["Body"].read(),
                      range(gets)))
    get_ms = (cpu_seconds(proc.pid) - before) / gets * 1e3
    before = cpu_seconds(proc.pid)
    for _ in range(5):
        assert s3.list_objects_v2(Bucket=BUCKET, Prefix="page/")["KeyCount"] == PAGE
    return get_ms, (cpu_seconds(proc.pid) - before) / 5 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bucket_keys", type=int, nargs=3, default=[1000, 4000, 16000])
    args = parser.parse_args()
    servers = {kind: start(kind) for kind in ("dispatcher", "s3-app")}
    rows: dict[str, list[tuple[float, float]]] = {kind: [] for kind in servers}
    try:
        clients = {kind: client(endpoint) for kind, (_, endpoint) in servers.items()}
        for s3 in clients.values():
            s3.create_bucket(Bucket=BUCKET)
            put(s3, [f"page/{i:06d}" for i in range(PAGE)])
        have = PAGE
        for size in args.bucket_keys:
            for kind, s3 in clients.items():
                put(s3, [f"other/{i:06d}" for i in range(have - PAGE, size - PAGE)])
                rows[kind].append(measure(servers[kind][0], s3, PAGE))
            have = size
    finally:
        for proc, _ in servers.values():
            proc.kill()
    print(f"{'server CPU ms':<50}" + "".join(f"{n:>10,}" for n in args.bucket_keys)
          + "  exponent")
    for what, col in (("per GET", 0), ("per LIST page of 1,000 keys", 1)):
        for kind in servers:
            ms = [r[col] for r in rows[kind]]
            slope = math.log(ms[-1] / ms[0]) / math.log(args.bucket_keys[-1] / args.bucket_keys[0])
            print(f"{kind + ', ' + what:<50}" + "".join(f"{v:>10.2f}" for v in ms)
                  + f"  {slope:8.2f}")
        ratio = [a[col] / b[col] for a, b in zip(rows["dispatcher"], rows["s3-app"], strict=True)]
        print(f"{'dispatcher / s3-app, ' + what:<50}" + "".join(f"{v:>10.2f}" for v in ratio))
    print("\nreproduce: .venv/bin/python -P benchmarks/bench_s3_server.py --bucket_keys "
          + " ".join(map(str, args.bucket_keys)))


if __name__ == "__main__":
    main()
