"""Fixtures for the example tests: the stage tests' weights cache and model, shared."""

from __future__ import annotations

# Imported fixtures are found by name, so these names are used though nothing here reads
# them: the example's processes load their weights from this cache, not from ~/.cache.
from tests.stages.conftest import cache_dir, model  # noqa: F401
