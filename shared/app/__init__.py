"""The top layer: the ``sparkforge`` command table, the demo and the tiny test target.

It imports the packages below it and none of them imports it; ``sparkforge.api``, the other top
layer, does, as do the console script, the tests and the benchmarks (``tests/unit/test_layers.py``
holds which layer may import which).
"""
