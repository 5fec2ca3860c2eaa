"""The top layer: the ``sparkforge`` command table, the demo and the tiny test target.

It imports the four packages and none of them imports it; only the console script, the tests and
the benchmarks do.
"""
