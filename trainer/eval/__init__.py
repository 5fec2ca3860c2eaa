"""``sparkforge eval``: reference and served decoding, teacher-forced metrics, the report."""
