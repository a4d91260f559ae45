"""Helpers for tests that start local servers (moto, Azurite, WebHDFS, a Spark standalone cluster)."""
from estimator.cluster import free_port, wait_for_port

__all__ = ["free_port", "wait_for_port"]
