"""``sparkforge produce | regenerate | parity``: the producer's jobs (their configs: config.py).

Each takes its parsed config and returns the exit code; heavy imports (torch, vLLM) happen only
when a job runs.
"""

from __future__ import annotations

from sparkforge.producer.config import ProducerConfig, RegenerateConfig


def run_produce(cfg: ProducerConfig) -> int:
    """Capture the cache and print the run's accounting."""
    from sparkforge.producer.run import run

    print(run(cfg).table())
    return 0


def run_regenerate(cfg: RegenerateConfig) -> int:
    """Sample responses with the target and print the accounting."""
    from sparkforge.producer.regenerate import regenerate

    print(regenerate(cfg).table())
    return 0


def run_parity(cfg: ProducerConfig) -> int:
    """Compare vLLM capture with a transformers forward; 1 if they disagree."""
    from sparkforge.producer.parity_check import parity

    report = parity(cfg)
    print(report.table())
    return 0 if report.passed else 1
