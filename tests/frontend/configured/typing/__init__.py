"""Modules that only the type checker runs: ``mypy --strict`` must accept them as they are."""
