"""Leases, with no I/O: the lease model and its decisions (:mod:`.model`) and the
lease API's credentials (:mod:`.auth`)."""
