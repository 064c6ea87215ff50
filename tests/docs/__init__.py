"""The Python blocks of README.md and docs/*.md: each one runs, or is an excerpt of an example that runs."""
