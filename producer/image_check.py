"""A re-run of an image cache checks that the images behind its committed rows are unchanged.

An image row's ``source_hash`` covers its image bytes, but images referenced by path or URI live
outside the dataset file, whose hash the header compares on resume. So when a run finds committed
units of an image cache, it reads (not decodes) the images of those units' rows again and compares
each row's hash with the one its commit record holds; any difference stops the run naming the
samples, before anything new is written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from sparkforge.manifests.objects import MAX_COMMIT_BYTES
from sparkforge.producer.capture import sample_source_hash
from sparkforge.producer.inputs import InputRows
from sparkforge.shared import storage
from sparkforge.shared.commit_columns import parse_commit_bytes
from sparkforge.shared.image_sources import ImageReader
from sparkforge.shared.images import ImageProblem, images_sha256, read_images, row_has_images
from sparkforge.shared.layout import commit_key
from sparkforge.shared.writer import CacheMismatchError, CacheWriter

MAX_LISTED = 5


def check_committed_images(
    writer: CacheWriter, units: Iterable[int], inputs: InputRows, *, rows_per_unit: int,
    reader: ImageReader, storage_options: Mapping[str, Any], batch_rows: int = 1024,
) -> int:
    """Compare the images of ``units``' committed image rows with what was captured.

    Returns:
        The number of image rows checked.

    Raises:
        CacheMismatchError: An image changed (or no longer reads) since its row was captured.
    """
    done = set(units)
    stored: dict[int, str] = {}
    for unit in done:
        raw = storage.read_bytes(writer.loc, commit_key(writer.spec, unit),
                                 max_bytes=MAX_COMMIT_BYTES)
        info = parse_commit_bytes(raw, unit=unit, spec=writer.spec)
        stored.update((s.sample_id, s.source_hash) for s in info.samples)
    checked, changed = 0, []
    for raw_row in inputs.rows(wanted=lambda i: i // rows_per_unit in done,
                               batch_rows=batch_rows, storage_options=dict(storage_options)):
        if raw_row.index not in stored or not row_has_images(raw_row.row):
            continue
        assert raw_row.row is not None
        encoded = read_images(raw_row.row["messages"], reader, folder=raw_row.folder)
        now = (encoded.value if isinstance(encoded, ImageProblem) else
               sample_source_hash(raw_row.content_hash, images_sha256(encoded)))
        checked += 1
        if now != stored[raw_row.index]:
            changed.append(raw_row.index)
    if changed:
        raise CacheMismatchError(
            f"the images of {len(changed)} committed image rows changed since they were captured "
            f"(samples {changed[:MAX_LISTED]}{' ...' if len(changed) > MAX_LISTED else ''}): "
            "their hash differs from the one in the commit record; restore the images or write "
            "a new cache")
    return checked
