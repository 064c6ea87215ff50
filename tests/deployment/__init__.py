"""Deployments: Redis Cluster, Sentinel, replicas, ACLs and TLS, other clients of the same keys, connections."""
