"""Leases with fencing tokens: the pure decisions (:mod:`.model`) and the HTTP API
(:mod:`.service`). The Python client is :mod:`fenceproxy.client`."""

from .model import Lease, LeaseState

__all__ = ["Lease", "LeaseState"]
