"""The servers: the proxy's request handler (:mod:`.proxy`), the lease API
(:mod:`.lease_api`), and the application that runs them with the admin listener on
one store (:mod:`.app`)."""
