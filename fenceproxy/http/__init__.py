"""HTTP on both sides of the proxy: the listener (:mod:`.server`) and its rules
(:mod:`.edge`), request paths (:mod:`.target`), routes (:mod:`.routes`), and the
upstream client (:mod:`.upstream` over :mod:`.http1`). Both sides parse with llhttp
(httptools); what its errors mean is in one adapter a side: :mod:`.httptools_parser`
for the requests the proxy reads, :mod:`.client_errors` for the answers it reads
from an upstream. Nothing here decides a fenced write."""
