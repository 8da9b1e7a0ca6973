"""What operators see: the admin listener (:mod:`.admin`), the operator page
(:mod:`.page`), what both show and where it comes from (:mod:`.data`), the Prometheus
metrics (:mod:`.metrics`) and the recent decisions they show (:mod:`.recent`)."""
