"""Reproducible benchmarks of stagewire against raw baselines measured in the same run."""
