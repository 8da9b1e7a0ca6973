"""HTTP on both sides of the proxy: the listener's rules (:mod:`.edge`), request
paths (:mod:`.target`), routes (:mod:`.routes`), and the upstream client
(:mod:`.upstream` over :mod:`.http1`). What they read of aiohttp, and what its errors
mean, is in its adapters (:mod:`.aiohttp_server`, :mod:`.aiohttp_client`). Nothing
here decides a fenced write."""
