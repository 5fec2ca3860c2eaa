"""Eval split by seeded content hash or by id list."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkforge.producer.splits import SplitRule, load_eval_ids
from sparkforge.shared.dataset import row_hash


def test_fraction_is_close_deterministic_and_seeded() -> None:
    """About the asked fraction is eval; the same seed repeats it, another seed changes it."""
    hashes = [row_hash(str(i).encode()) for i in range(4000)]
    rule = SplitRule(eval_fraction=0.1, seed=1)
    splits = [rule.split_of(index=i, content_hash=h) for i, h in enumerate(hashes)]
    assert 300 < splits.count("eval") < 500
    assert splits == [rule.split_of(index=i, content_hash=h) for i, h in enumerate(hashes)]
    other = SplitRule(eval_fraction=0.1, seed=2)
    assert splits != [other.split_of(index=i, content_hash=h) for i, h in enumerate(hashes)]


def test_fraction_depends_on_content_not_position() -> None:
    """A duplicated row lands in the same split wherever it appears."""
    rule = SplitRule(eval_fraction=0.5, seed=0)
    h = row_hash(b"same")
    assert len({rule.split_of(index=i, content_hash=h) for i in range(50)}) == 1


def test_fraction_one_puts_every_row_in_eval() -> None:
    """eval_fraction 1.0 makes an eval-only split, even for hashes whose ratio rounds to 1.0."""
    rule = SplitRule(eval_fraction=1.0, seed=0)
    hashes = [row_hash(str(i).encode()) for i in range(500)]
    assert {rule.split_of(index=i, content_hash=h) for i, h in enumerate(hashes)} == {"eval"}


def test_id_list_selects_row_indices(tmp_path: Path) -> None:
    """An id file puts exactly the listed row indices in eval."""
    path = tmp_path / "ids.txt"
    path.write_text("3\n\n7\n")
    rule = SplitRule(eval_ids=load_eval_ids(str(path)))
    assert [i for i in range(10) if rule.split_of(index=i, content_hash="x") == "eval"] == [3, 7]
    assert SplitRule().split_of(index=0, content_hash="x") == "train"


def test_bad_id_file_names_the_flag_and_line(tmp_path: Path) -> None:
    """A non-integer line in the id file is refused naming --eval_ids and the line number."""
    path = tmp_path / "ids.txt"
    path.write_text("3\nabc\n")
    with pytest.raises(ValueError, match="--eval_ids .* line 2"):
        load_eval_ids(str(path))
