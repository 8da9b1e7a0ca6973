"""The lease clients: :class:`LeaseClient` in a coroutine, :class:`SyncLeaseClient`
in a thread; one set of rules (:mod:`.core`) and one flow of each step
(:mod:`.flow`) for both, which differ only in how they do the I/O (:mod:`.aio`,
:mod:`.sync`, and :mod:`.adapter` for httpx).

A worker claims a job, holds its lease while it works (renewed in the background),
adds the lease's fencing headers to every write it sends through the proxy, and
stops the moment the lease is lost: a renewal refused, or none confirmed before the
lease's *local deadline*, which is the client's monotonic clock read *before* the
claim or renewal was sent, plus the ttl, less a safety margin (ttl/10 by default).
The wall clock is never read, and a reply that arrives after the deadline counts as
lost. ``hold(..., wait=N)`` waits up to N seconds for a job another worker holds.

When the lease API takes credentials, pass yours as ``token``: it is sent as
``Authorization: Bearer``, and the leases you take are owned by its name, qualified
by ``owner``.

Failures, all under :class:`~fenceproxy.errors.LeaseError`: ``LeaseRefused`` (the
service said no, with its problem body), ``LeaseServiceError`` (it could not be
reached or answered oddly), ``LeaseLost``.

This package needs only httpx (``pip install fenceproxy``): never the proxy's
server, store or config libraries.
"""

from ..errors import LeaseError, LeaseLost, LeaseRefused, LeaseServiceError
from .aio import HeldLease, LeaseClient
from .core import SAFE_TO_RETRY, Grant, refusal_kind
from .sync import SyncHeldLease, SyncLeaseClient

__all__ = [
    "SAFE_TO_RETRY",
    "Grant",
    "HeldLease",
    "LeaseClient",
    "LeaseError",
    "LeaseLost",
    "LeaseRefused",
    "LeaseServiceError",
    "SyncHeldLease",
    "SyncLeaseClient",
    "refusal_kind",
]
