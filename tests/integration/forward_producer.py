"""Subprocess entry for crash tests: parse like `produce`, then run() over a transformers forward.

Usage: python forward_producer.py DELAY_S produce --config FILE [--field value ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for producer_helpers

from producer_helpers import ForwardSource  # noqa: E402

from sparkforge.producer.cli import _parse  # noqa: E402
from sparkforge.producer.config import ProducerConfig  # noqa: E402
from sparkforge.producer.run import run  # noqa: E402

if __name__ == "__main__":
    delay_s, argv = float(sys.argv[1]), sys.argv[3:]
    cfg = _parse("produce", ProducerConfig, argv)
    layer_ids = [k + 1 for k in cfg.layer_ids or ()]
    run(cfg, source=ForwardSource(Path(cfg.engine.model), layer_ids=layer_ids, delay_s=delay_s))
