"""The servers: the proxy's request handler (:mod:`.proxy`), a fenced write's turn at
its job (:mod:`.turn`), requests forwarded as they came and answers relayed
(:mod:`.relay`), the lease API (:mod:`.lease_api`), and the application that runs
them with the admin listener on one store (:mod:`.app`)."""
