"""The test harness: servers, topologies, a misbehaving network, faults, and clients to compare with.

Imported by the tests and by ``benchmarks/harness.py``; tested by the
``test_*.py`` modules beside it.

- `support`: our own ``redis-server`` processes (`RedisServer`), which
  server software answers (`Software`: Redis or Valkey, and its version),
  the ACL mode's restricted user, a hand-moved clock, waits for a waiter to
  queue or subscribe.
- `topology`: a Redis Cluster that moves slots and a Sentinel group that
  fails over, built from `RedisServer` processes; the cluster hash tag rule.
- `proxy`: `TcpProxy`, a TCP proxy that delays, holds, drops, black-holes and
  partitions.
- `faults`: loads of semaphores under a fault, memory exhaustion, eviction,
  pauses, clients through a proxy, and the fault report.
- `failover`: counting the permits a Sentinel failover forgets.
- `limiting`: a clean configuration for the front end's tests, and waits
  for its tasks to settle.
- `tls`: certificates and a TLS ``redis-server``.
- `book_client`: *Redis in Action*'s semaphore and lock code, faults kept.
- `sites`: local web sites that log every request, for the crawler example.
- `postgres`: the PostgreSQL the database examples need.
"""
