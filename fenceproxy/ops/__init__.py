"""What operators see: the admin listener (:mod:`.admin`), the operator page
(:mod:`.page`), the Prometheus metrics (:mod:`.metrics`) and the recent decisions
they show (:mod:`.recent`)."""
