"""Prefect tasks: thin wrappers over evoharness library calls (retries, concurrency, artifacts)."""
