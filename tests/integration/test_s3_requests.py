"""Requests sent to S3 (counted at a proxy in front of moto) stay flat as a cache grows."""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import boto3
import pytest
from cache_helpers import SMALL_SPEC, make_run_header, make_unit
from s3_proxy import S3Proxy

from sparkforge.shared.writer import CacheWriter

SPEC = dataclasses.replace(SMALL_SPEC, shard_rows=128)
"""Every unit fits one slot, so every commit writes the same objects."""


@pytest.fixture
def proxy(moto_server: dict[str, Any]) -> Iterator[S3Proxy]:
    """A counting proxy in front of the session's moto server."""
    p = S3Proxy(moto_server["endpoint"])
    yield p
    p.close()


def _options(moto_server: dict[str, Any], proxy: S3Proxy) -> dict[str, Any]:
    return {**moto_server["storage_options"], "endpoint_url": proxy.endpoint,
            "skip_instance_cache": True}


def _put_directly(moto_server: dict[str, Any], keys: list[str]) -> None:
    """Create empty objects on moto itself, past the proxy (other workers' earlier units)."""
    client = boto3.client("s3", endpoint_url=moto_server["endpoint"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: client.put_object(Bucket=moto_server["bucket"], Key=k, Body=b""),
                      keys))


def _commit(writer: CacheWriter, unit: int,
            proxy: S3Proxy) -> tuple[Counter[str], list[tuple[str, str]]]:
    """The requests one ``write_unit`` sends: counts by kind, and (kind, path) of each."""
    proxy.reset()
    writer.write_unit(unit, *make_unit(SPEC, unit))
    log = list(proxy.log)
    return proxy.reset(), log


@pytest.mark.slow
def test_a_commit_sends_the_same_requests_after_a_thousand_earlier_units(
        moto_server: dict[str, Any], proxy: S3Proxy) -> None:
    """Claiming an attempt lists nothing, so 1,001 earlier units' claims (more than one LIST
    page) and commit records do not change what a commit sends."""
    root = uuid.uuid4().hex
    uri = f"s3://{moto_server['bucket']}/{root}"
    writer = CacheWriter.open(uri, spec=SPEC, header=make_run_header(SPEC, num_units=2000),
                              storage_options=_options(moto_server, proxy))
    first, _ = _commit(writer, 1500, proxy)
    _put_directly(moto_server, [f"{root}/{prefix}" for u in range(1001)
                                for prefix in (f"_attempts/unit_{u:08d}/0000",
                                               f"_commits/unit_{u:08d}.json")])
    later, log = _commit(writer, 1501, proxy)
    assert later == first
    assert first["PUT"] == 2 + 5  # the attempt claim, the commit record, one object per array
    assert not [path for kind, path in log if kind == "LIST" and "_attempts" in path]
