"""Eval split by seeded content hash or by id list."""

from __future__ import annotations

from pathlib import Path

from sparkforge.producer.dataset import row_hash
from sparkforge.producer.splits import SplitRule, load_eval_ids


def test_fraction_is_close_deterministic_and_seeded() -> None:
    """About the asked fraction is eval; the same seed repeats it, another seed changes it."""
    hashes = [row_hash(str(i).encode()) for i in range(4000)]
    rule = SplitRule(eval_fraction=0.1, seed=1)
    splits = [rule.split_of(index=i, content_hash=h, row=None) for i, h in enumerate(hashes)]
    assert 300 < splits.count("eval") < 500
    assert splits == [rule.split_of(index=i, content_hash=h, row=None) for i, h in enumerate(hashes)]
    other = SplitRule(eval_fraction=0.1, seed=2)
    assert splits != [other.split_of(index=i, content_hash=h, row=None) for i, h in enumerate(hashes)]


def test_fraction_depends_on_content_not_position() -> None:
    """A duplicated row lands in the same split wherever it appears."""
    rule = SplitRule(eval_fraction=0.5, seed=0)
    h = row_hash(b"same")
    assert len({rule.split_of(index=i, content_hash=h, row=None) for i in range(50)}) == 1


def test_id_list_matches_id_field_or_row_index(tmp_path: Path) -> None:
    """Ids match a row's id field, or its row index when the row has no id."""
    path = tmp_path / "ids.txt"
    path.write_text("abc\n\n7\n")
    rule = SplitRule(eval_ids=load_eval_ids(str(path)))
    assert rule.split_of(index=0, content_hash="x", row={"id": "abc"}) == "eval"
    assert rule.split_of(index=7, content_hash="x", row={"id": "zzz"}) == "train"
    assert rule.split_of(index=7, content_hash="x", row={}) == "eval"
    assert rule.split_of(index=8, content_hash="x", row=None) == "train"
    assert SplitRule().split_of(index=0, content_hash="x", row=None) == "train"
