"""HTTP on both sides of the proxy: the listener's rules (:mod:`.edge`), request
paths (:mod:`.target`), routes (:mod:`.routes`), and the upstream client
(:mod:`.upstream` over :mod:`.http1`). Nothing here decides a fenced write."""
