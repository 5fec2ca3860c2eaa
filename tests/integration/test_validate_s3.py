"""validate and inspect through s3fs against a moto S3 server: valid, then a lost shard object."""

from __future__ import annotations

import io
import json
import uuid
from typing import Any

import pyarrow.parquet as pq
import pytest
import s3fs
from cache_helpers import make_run_header, make_unit

from sparkforge.app.cli import main
from sparkforge.manifests.finalize import finalize_cache
from sparkforge.shared.layout import CacheSpec
from sparkforge.shared.writer import CacheWriter

SPEC = CacheSpec(hidden_size=16, num_aux_layers=2, hidden_dtype="bfloat16", max_seq_len=16,
                 shard_rows=32, rows_per_unit=5)


@pytest.mark.slow
def test_validate_and_inspect_on_s3(moto_server: dict[str, Any],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A cache on S3 validates deep (exit 0); deleting one shard object makes it invalid (1)."""
    options = moto_server["storage_options"]
    uri = f"s3://{moto_server['bucket']}/{uuid.uuid4().hex}"
    writer = CacheWriter.open(uri, spec=SPEC, header=make_run_header(SPEC), storage_options=options)
    for unit in range(2):
        writer.write_unit(unit, *make_unit(SPEC, unit))
    finalize_cache(uri, expected_units=2, storage_options=options)
    flags = ["--storage_options", json.dumps(options)]

    assert main(["validate", uri, "--deep", "--json", *flags]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["checked"]["samples"] == 8
    assert report["checked"]["bytes_scanned"] > 0
    assert main(["inspect", uri, "--json", *flags]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 8

    slots = pq.read_table(io.BytesIO(s3fs.S3FileSystem(**options).cat_file(
        f"{uri[5:]}/slots.parquet"))).to_pylist()
    slot = next(s["slot"] for s in slots if s["unit"] == 1)
    s3fs.S3FileSystem(**options, skip_instance_cache=True).rm_file(
        f"{uri[5:]}/final_hidden/c/0/{slot}/0")
    assert main(["validate", uri, *flags]) == 1
    assert f"unit 1, slot {slot}: object final_hidden/c/0/{slot}/0 is missing" in \
        capsys.readouterr().out
    assert main(["validate", f"s3://{moto_server['bucket']}/nothing-here", *flags]) == 2
