"""`sparkforge finalize` reports the cache's accounting in words, as `inspect` does."""

from __future__ import annotations

from pathlib import Path

import pytest
from producer_helpers import ForwardSource, chat_rows, producer_config, write_jsonl

from sparkforge.app.cli import main
from sparkforge.producer.run import run


def test_finalize_prints_the_accounting_line(tiny_target: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Re-finalizing a complete cache exits 0 and prints rows written/skipped/failed, no repr."""
    data = write_jsonl(tmp_path / "d.jsonl", [*chat_rows(3), "{not json"])
    output = str(tmp_path / "cache")
    source = ForwardSource(tiny_target, layer_ids=(1, 2, 3))
    run(producer_config(tiny_target, data, output), source=source)
    capsys.readouterr()
    assert main(["finalize", "--output", output]) == 0
    out = capsys.readouterr().out
    assert out == (f"finalized {output}: 4 input rows: 3 written, skipped malformed_json 1, "
                   "failed 0\n")
