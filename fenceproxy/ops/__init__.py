"""What operators see: the admin listener (:mod:`.admin`), the operator page
(:mod:`.page`), what both show and where it comes from (:mod:`.data`), the Prometheus
metrics (:mod:`.metrics`), the recent decisions and the last hour the page shows
(:mod:`.recent`, :mod:`.series`), and the traces (:mod:`.tracing`, imported only
under ``tracing:``)."""
