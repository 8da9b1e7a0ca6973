"""The operator page, at the admin listener's ``/``: one server-rendered page with a
little plain JavaScript (``static/page.js`` and ``static/charts.js``, no build step,
nothing from elsewhere) and uPlot, kept beside them (``static/uPlot.iife.min.js``).

It draws the last hour (:mod:`fenceproxy.ops.series`, from ``/page/series``, every
10 s): the fenced decisions per second by outcome and the refusals by kind, a fenced
write's time (p50 and p99, through the proxy, in the store and at the upstream) and
the store's batches. It shows the decisions of this proxy as they happen (the script
asks for the rows after the last it has, once a second), the refusals by kind over
the last minute, 5 and 15 minutes, the routes of the running config and their upstreams, the
certificates it presents and when each ends (flagged within 14 days), and, for the
job entered, what the store holds of it now and its timeline: the claims, renewals,
completions and releases (the generations and their holders) and the writes with
their decisions, as this proxy saw them (:mod:`fenceproxy.ops.recent`).

What it shows comes from an :class:`~fenceproxy.ops.data.AdminData`: this process's,
or under ``workers:`` the worker ``?worker=`` names (the first by default), rendered
here alike; the charts add up every worker's. Every row is rendered here, the first
time and as the page polls, so the script only places them, and the tables work with
JavaScript off. Every value is escaped; the page's Content-Security-Policy allows
nothing but this listener's own script and style. One clock throughout: UTC, 24-hour;
sizes and durations with their units (``10 MiB``, ``2.5 ms``, ``30 s``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from html import escape
from importlib.resources import files
from typing import Any

from aiohttp import web

from .._version import __version__
from ..errors import Refusal, StoreError
from ..fence.fencing import parse_job
from .data import AdminData, CertificateRow, Reads, RouteRow, when
from .recent import KEPT, Event

__all__ = ["add_page"]

_SHOWN = 200
"""Decisions shown on the page, newest first."""
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_STATIC = {
    "page.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
}


def add_page(app: web.Application, data: AdminData) -> None:
    """Serve the page (``/``), its updates (``/page/feed``), its charts' data
    (``/page/series``) and its files, from ``data``: the process ``?worker=`` names,
    under ``workers:``, and every worker's series added up."""
    static = {
        name: (files(__package__).joinpath("static", name).read_bytes(), kind)
        for name, kind in _STATIC.items()
    }

    async def page(request: web.Request) -> web.Response:
        worker = request.query.get("worker") or ""
        reads = data.one(worker)
        job, job_html = await _job_section(request.query.get("job"), reads)
        about = await reads.about()
        shown = await reads.events(0, None, _SHOWN)
        html = _PAGE.format(
            version=escape(__version__),
            listen=escape(about.listen),
            store=escape(about.store),
            last=shown.last,
            job_attr=escape(job or "", quote=True),
            worker_attr=escape(worker, quote=True),
            worker_field=_WORKER_FIELD.format(escape(worker, quote=True)) if worker else "",
            refusals=_refusal_rows(shown.refusals),
            events=_event_rows(reversed(shown.events), with_job=True),
            job=job_html,
            routes=_route_rows(about.routes),
            certificates=_certificate_rows(about.certificates),
        )
        return web.Response(text=html, content_type="text/html", headers=_HEADERS)

    async def feed(request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "0"))
        except ValueError:
            after = 0
        job = request.query.get("job") or None
        shown = await data.one(request.query.get("worker")).events(after, None, _SHOWN)
        timeline = [e for e in shown.events if job is not None and e.job == job]
        return web.json_response(
            {
                "last": shown.last,
                "events": _event_rows(reversed(shown.events), with_job=True),
                "timeline": _event_rows(timeline, with_job=False),
                "refusals": _refusal_rows(shown.refusals),
            },
            headers={"Cache-Control": "no-store"},
        )

    async def series(request: web.Request) -> web.Response:
        hour = await data.series()
        return web.json_response(hour.drawn(time.time()), headers={"Cache-Control": "no-store"})

    def serve_static(name: str) -> Any:
        body, kind = static[name]

        async def handler(request: web.Request) -> web.Response:
            return web.Response(
                body=body, headers={"Content-Type": kind, "X-Content-Type-Options": "nosniff"}
            )

        return handler

    app.router.add_get("/", page)
    app.router.add_get("/page/feed", feed)
    app.router.add_get("/page/series", series)
    for name in static:
        app.router.add_get(f"/static/{name}", serve_static(name))


async def _job_section(asked: str | None, reads: Reads) -> tuple[str | None, str]:
    """The job entered, and its section: what the store holds now and its timeline."""
    if not asked:
        return None, ""
    try:
        job = parse_job(asked, "the form")
    except Refusal as refusal:
        return None, f'<p class="problem">{escape(refusal.detail)}</p>'
    try:
        now = _now_html(await reads.job(job))
    except StoreError as exc:
        now = f'<p class="problem">the store could not be read: {escape(str(exc))}</p>'
    events = (await reads.events(0, job, KEPT)).events
    timeline = _TIMELINE.format(
        hidden="" if events else " hidden", rows=_event_rows(events, with_job=False)
    )
    if not events:
        timeline += (
            '<p class="empty" id="timeline-empty">this proxy has seen nothing of it since '
            "it started</p>"
        )
    return job, f"<h3>{escape(job)}</h3>{now}<h4>Timeline</h4>{timeline}"


def _now_html(view: dict[str, Any] | None) -> str:
    """A job as the store holds it (``/jobs/{job}``'s answer), or None: nothing."""
    if view is None:
        return '<p class="empty">the store holds nothing of this job</p>'
    rows = []
    if view["generation"] is not None:
        rows.append(("generation", f"{view['generation']}, set {when(view['generation_set_at'])}"))
    lease = view["lease"]
    if lease is None:
        rows.append(("lease", "none"))
    else:
        left = lease["lease_until"] - view["now"]
        state = f"live, {left:.1f} s left" if lease["live"] else "not live"
        rows.append(
            (
                "lease",
                f"{lease['owner']}, generation {lease['generation']}, {lease['state']}, {state}",
            )
        )
    in_flight = view["in_flight"]
    if in_flight is None:
        rows.append(("in flight", "nothing"))
    else:
        rows.append(
            (
                "in flight",
                f"{in_flight['state']} (holder {in_flight['holder']}), "
                f"until {when(in_flight['expires_at'])}",
            )
        )
    for key in view["keys"]:
        status = "-" if key["status"] is None else key["status"]
        rows.append(
            (
                "key",
                f"{key['key']}: {key['state']}, route {key['route']}, generation "
                f"{key['generation']}, status {status}, {when(key['created_at'])}",
            )
        )
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return f'<table class="now" id="job-now"><tbody>{body}</tbody></table>'


def _event_rows(events: Iterable[Event], *, with_job: bool) -> str:
    return "".join(_event_row(e, with_job) for e in events)


def _event_row(e: Event, with_job: bool) -> str:
    who = e.owner if e.action != "write" else e.key
    cells = [
        f'<td title="{when(e.at)}">{_clock(e.at)}</td>',
        _cell(e.action),
        *([_cell(e.job)] if with_job else []),
        _cell(e.route),
        _cell(e.generation),
        _cell(e.current_generation),
        _cell(who),
        f'<td class="outcome">{escape(e.outcome)}</td>',
        _cell(e.status),
        _cell(None if e.ms is None else _duration(e.ms / 1000)),
    ]
    kind = "refused" if e.refused else "granted"
    return f'<tr class="{kind}" data-seq="{e.seq}">{"".join(cells)}</tr>'


def _cell(value: object) -> str:
    return "<td>-</td>" if value is None else f"<td>{escape(str(value))}</td>"


def _refusal_rows(refusals: dict[str, list[int]]) -> str:
    if not refusals:
        return '<tr class="empty"><td colspan="4">none</td></tr>'
    return "".join(
        f"<tr><td>{escape(kind)}</td>{''.join(f'<td>{n}</td>' for n in counts)}</tr>"
        for kind, counts in refusals.items()
    )


def _route_rows(routes: Iterable[RouteRow]) -> str:
    return "".join(
        f"<tr>{''.join(_cell(v) for v in route[:-2])}"
        f"{_cell(_duration(route.timeout))}"
        f"{_cell(None if route.max_body is None else _size(route.max_body))}</tr>"
        for route in routes
    )


def _certificate_rows(certificates: Iterable[CertificateRow]) -> str:
    """A row a certificate: whose, its file and subject, its end and the whole days
    left, and what clients will make of it, flagged (``ending``) when expired, not yet
    valid or within :data:`~fenceproxy.tls.ENDING` of its end."""
    out = []
    for cert in certificates:
        cells = (*cert[:-1], cert.concern or "")
        flag = "" if cert.concern is None else ' class="ending"'
        out.append(f"<tr{flag}>{''.join(_cell(v) for v in cells)}</tr>")
    return "".join(out) or _NO_CERTIFICATE


_WORKER_FIELD = '<input type="hidden" name="worker" value="{}">'
"""The job form's field on a page opened for a worker (``?worker=``): the job asked
for is read from that worker too."""
_NO_CERTIFICATE = '<tr class="empty"><td colspan="6">none: nothing here presents one</td></tr>'


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}"


def _duration(seconds: float) -> str:
    """``30 s``, ``2.5 ms``, ``250 µs``: three significant digits, in the largest unit
    not above it."""
    if seconds >= 1:
        return f"{_number(seconds)} s"
    if seconds >= 0.001:
        return f"{_number(seconds * 1000)} ms"
    return f"{_number(seconds * 1e6)} µs"


def _size(size: int) -> str:
    """``10 MiB``, ``1.5 KiB``, ``512 B``."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale:
            return f"{_number(size / scale)} {unit}"
    return f"{size} B"


def _number(value: float) -> str:
    """Three significant digits, never an exponent: ``2.5``, ``30``, ``1234``."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


_TIMELINE = """<table class="events"{hidden}><thead><tr><th>time (UTC)</th><th>what</th>
<th>route</th><th>generation</th><th>newer</th><th>key or holder</th><th>decision</th>
<th>status</th><th>took</th></tr></thead><tbody id="timeline">{rows}</tbody></table>"""

_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>fenceproxy on {listen}</title>
<link rel="stylesheet" href="/static/uPlot.min.css">
<link rel="stylesheet" href="/static/page.css">
<script src="/static/uPlot.iife.min.js" defer></script>
<script src="/static/page.js" defer></script>
<script src="/static/charts.js" defer></script>
</head>
<body data-last="{last}" data-job="{job_attr}" data-worker="{worker_attr}">
<header>
<h1>fenceproxy <small>{version}</small></h1>
<p>listening on {listen} &middot; store: {store} &middot;
<a href="/metrics">metrics</a> &middot; <a href="/readyz">readiness</a>
&middot; <span id="feed-status">updated when loaded</span></p>
</header>
<main>
<section>
<h2>The last hour</h2>
<p class="note">In steps of 10 s on the clock (UTC), as this proxy has seen them since it
started (under <code>workers:</code>, every worker's added up); kept in memory, lost on
a restart.</p>
<noscript><p class="empty">The charts are drawn by the page's script; the tables below
need none.</p></noscript>
<div class="charts" id="charts" hidden>
<figure><figcaption>Fenced writes per second, by decision</figcaption>
<div class="chart" id="chart-decisions"></div></figure>
<figure><figcaption>Refusals per second, by kind</figcaption>
<div class="chart" id="chart-refusals"></div></figure>
<figure><figcaption>A fenced write's time: p99 (solid) and p50 (dashed), through the
proxy, in the store and at the upstream</figcaption>
<div class="chart" id="chart-seconds"></div></figure>
<figure><figcaption>Store transactions: operations per commit, mean and largest</figcaption>
<div class="chart" id="chart-batches"></div></figure>
</div>
<p id="charts-status" class="empty"></p>
</section>
<section>
<h2>Refusals by kind</h2>
<table class="counts"><thead><tr><th>kind</th><th>last minute</th><th>5 minutes</th>
<th>15 minutes</th></tr></thead><tbody id="refusals">{refusals}</tbody></table>
</section>
<section>
<h2>Job</h2>
<form method="get" action="/" id="job-form">
<label for="job-input">job id</label>
<input id="job-input" name="job" value="{job_attr}" required maxlength="256">{worker_field}
<button type="submit">Show</button>
</form>
<div id="job">{job}</div>
</section>
<section>
<h2>Decisions, newest first</h2>
<table class="events"><thead><tr><th>time (UTC)</th><th>what</th><th>job</th>
<th>route</th><th>generation</th><th>newer</th><th>key or holder</th><th>decision</th>
<th>status</th><th>took</th></tr></thead><tbody id="events">{events}</tbody></table>
</section>
<section>
<h2>Routes</h2>
<table><thead><tr><th>name</th><th>path</th><th>upstream</th><th>fenced methods</th>
<th>timeout</th><th>max body</th></tr></thead><tbody id="routes">{routes}</tbody></table>
</section>
<section>
<h2>Certificates</h2>
<table><thead><tr><th>of</th><th>file</th><th>subject</th><th>ends (UTC)</th>
<th>days left</th><th></th></tr></thead><tbody id="certificates">{certificates}</tbody></table>
</section>
</main>
</body>
</html>
"""
