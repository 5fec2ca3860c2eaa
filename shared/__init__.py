"""Dependency-light pieces every sparkforge package uses: the cache format, storage, logging."""
