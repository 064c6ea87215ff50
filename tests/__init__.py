"""aiosem's tests, grouped by what they test.

- ``contract/``: the semaphore contract over both classes -- granting,
  waiting and order, cancellation, holding, relay, lanes, limits, the
  scripts and the stateful model, round trips, leaks, the key layout.
- ``frontend/``: the public surface -- the CLI, URLs, observers, exceptions,
  the public API, validation, the demo, the rate limiter, the recipes;
  ``frontend/configured/``: what goes through `aiosem.configure` --
  decorators, limiters and rates by name, the web integrations, the typed
  examples, bad input -- each test starting unconfigured.
- ``deployment/``: Redis Cluster, Sentinel, replicas, ACLs and TLS, other
  clients of the same keys, connections.
- ``faults/``: Redis stopped, cut off, paused, full or evicting; crashed
  and contending processes; closing.
- ``examples/``: the examples, run as a user runs them.
- ``harness/``: the servers, topologies, proxy and fault helpers the tests
  (and ``benchmarks/harness.py``) use, with tests of their own.

``conftest.py`` holds the fixtures every directory shares; a directory's
own ``conftest.py`` holds what only its tests share.
"""
