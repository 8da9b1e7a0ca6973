"""The alerting rules (deploy/prometheus/fenceproxy-rules.yml) and the dashboard
(deploy/grafana/fenceproxy.json), with Debian's Prometheus: the rules checked and
unit-tested by promtool, every alert firing and not firing; each dashboard query
checked by promtool; every series both read scraped from a real proxy with traffic;
and a real Prometheus scraping a real proxy firing the alert of a held job."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from fenceproxy.testing import ProxyProcess, RecordingUpstream, free_port

from .certs import Certificates
from .test_tls import LEDGER, LISTENER, days_from_now, trusting

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "fenceproxy-rules.yml"
UNIT_TESTS = PROMETHEUS / "tests.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "fenceproxy.json"
RUNBOOKS = ROOT / "docs" / "observability.md"
RUNBOOK_BASE = "https://fenceproxy.example/observability.html#"

# A metric's name in a query: not a recorded series' (``route:fenceproxy_...:rate5m``).
METRIC = re.compile(r"(?<![\w:])fenceproxy_[a-z0-9_]+")
RECORDED = re.compile(r"\b[a-z_]+:fenceproxy_[a-z0-9_]+:[a-z0-9_]+")
MATCHER = re.compile(r"[{,]\s*([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# What Prometheus adds to every series it scrapes.
TARGET_LABELS = {"job", "instance"}
# The dashboard's variables, as Grafana fills them in.
GRAFANA = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$job": ".+"}


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed, and CI must run every test")
        pytest.skip(f"{name} is not installed (make servers installs Debian's prometheus)")
    return found


def promtool(*args: str, cwd: Path = PROMETHEUS) -> str:
    """promtool's output; the test fails with it when promtool does."""
    done = subprocess.run(
        [_tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def rules() -> list[dict[str, Any]]:
    """Every rule of the rules file, recording and alerting."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def alerts() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in rules() if "alert" in rule}


def dashboard_queries() -> list[str]:
    """Every query of the dashboard's panels."""
    model = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in model["panels"] for target in panel.get("targets", ())]


def dashboard_variables() -> list[str]:
    """What the dashboard's variables read: the series of each ``label_values(series,
    label)`` (Grafana's, not PromQL), as a query grouping by that label."""
    found = []
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]  # what Grafana runs; "definition" shows it
            assert variable["definition"] == query
            read = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
            assert read is not None, query
            found.append(f"count by ({read[2]}) ({read[1]})")
    return found


def filled(query: str) -> str:
    """A dashboard query with Grafana's variables as it fills them in; none other is
    left (Grafana would send it as it is written)."""
    for variable, value in sorted(GRAFANA.items(), key=lambda item: -len(item[0])):
        query = re.sub(re.escape(variable) + r"\b", value, query)
    assert "$" not in query, query
    return query


# --- promtool: the rules, their unit tests, the dashboard's queries ---------------


def test_the_rules_are_valid_and_pass_their_unit_tests() -> None:
    """An operator loads a rules file Prometheus accepts, whose every alert does what
    its unit tests say: fires on the series described, stays quiet on the others."""
    assert "SUCCESS: 16 rules found" in promtool("check", "rules", RULES.name)
    assert "SUCCESS" in promtool("test", "rules", UNIT_TESTS.name)


def test_every_alert_is_unit_tested_firing_and_not_firing() -> None:
    """No alert ships untested: each one has a unit test where it fires and one where
    it does not, and no unit test names an alert the rules lack."""
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", ()):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert len(alerts()) == 8
    assert set(alerts()) - firing == set(), "never shown firing"
    assert set(alerts()) - quiet == set(), "never shown quiet"
    assert firing | quiet <= set(alerts())


def test_every_rule_reads_series_recorded_before_it_in_its_group() -> None:
    """An alert says what this evaluation's series say: Prometheus runs a group's
    rules in order and groups side by side, so a rule reading a series recorded in
    another group (or later in its own) would read it as of this evaluation or the
    one before, whichever ran first, and fire or read its value a minute late."""
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        recorded: set[str] = set()
        for rule in group["rules"]:
            name = rule.get("record") or rule["alert"]
            assert set(RECORDED.findall(rule["expr"])) <= recorded, name
            if "record" in rule:
                recorded.add(rule["record"])


def test_every_alert_has_a_runbook_paragraph() -> None:
    """Whoever is paged reads what the alert means and what to do: each alert has a
    summary, a description and a runbook_url pointing at its own paragraph in
    docs/observability.md's Alerts section, and each paragraph there is an alert's."""
    page = RUNBOOKS.read_text()
    section = page.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    paragraphs = re.findall(r"^### (\w+)$", section, re.MULTILINE)
    for name, rule in alerts().items():
        annotations = rule["annotations"]
        assert set(annotations) == {"summary", "description", "runbook_url"}, name
        assert all(annotations.values()), name
        assert annotations["runbook_url"] == RUNBOOK_BASE + name.lower(), name
    assert paragraphs == list(alerts())


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """The dashboard imports with no panel broken by a query Prometheus refuses: each
    one, with Grafana's variables filled in, is checked by promtool."""
    queries = dashboard_queries()
    assert len(queries) > 20
    as_rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{n}:value", "expr": filled(query)}
                    for n, query in enumerate(queries)
                ],
            }
        ]
    }
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(as_rules))
    assert f"SUCCESS: {len(queries)} rules found" in promtool(
        "check", "rules", "dashboard.yml", cwd=tmp_path
    )
    datasource = json.loads(DASHBOARD.read_text())["templating"]["list"][0]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")


# --- a proxy with traffic, and a real Prometheus scraping it -----------------------


@dataclass
class Serving:
    """A supervisor of two workers on PostgreSQL, over TLS with a certificate ending
    in 7 days; route billing answers at once, route slow never (its upstream held),
    route ledger presents a client certificate."""

    proxy: ProxyProcess
    tls: ssl.SSLContext

    async def write(self, route: str, job: str, generation: int) -> int:
        headers = {"Fencing-Job": job, "Fencing-Token": str(generation)}
        url = self.proxy.url.replace("http://", "https://") + f"/{route}/x"
        async with (
            aiohttp.ClientSession() as http,
            http.post(url, json={}, headers=headers, ssl=self.tls) as answer,
        ):
            return answer.status

    async def claim(self, job: str) -> int:
        url = self.proxy.url.replace("http://", "https://") + f"/_leases/{job}/claim"
        async with (
            aiohttp.ClientSession() as http,
            http.post(url, json={"owner": "w1"}, ssl=self.tls) as answer,
        ):
            return answer.status

    async def metrics(self) -> str:
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.proxy.admin_url + "/metrics") as answer,
        ):
            assert answer.status == 200
            return await answer.text()


@pytest.fixture
async def serving(
    tmp_path: Path, database: str, upstream: RecordingUpstream
) -> AsyncIterator[Serving]:
    certs = Certificates(tmp_path / "tls")
    certs.server(not_after=days_from_now(7))
    certs.client("proxy", "client")
    async with RecordingUpstream.serve() as held:
        release = held.hold()
        slow = {"name": "slow", "path": "/slow/", "upstream": held.url, "timeout": "300ms",
                "quarantine": "60s"}  # fmt: skip
        billing = {"name": "billing", "path": "/billing/", "upstream": upstream.url}
        config = tmp_path / "fenceproxy.yaml"
        config.write_text(
            f"store: '{database}?pool=2&require_sync=true'\nworkers: 2\nleases: {{}}\n"
            "shutdown_timeout: 1s\n"
            + yaml.safe_dump({"tls": LISTENER, "routes": [billing, slow, LEDGER]})
        )
        proxy = await ProxyProcess(config, free_port()).start()
        try:
            yield Serving(proxy, trusting(certs.ca_file))
        finally:
            print(proxy.output())  # shown when a test fails
            await proxy.stop()
            release()


def series_labels(text: str) -> dict[str, set[str]]:
    """Each sample name of a metrics page, and the labels its samples carry."""
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def _unknown(query: str, served: dict[str, set[str]], recorded: dict[str, str]) -> list[str]:
    """What ``query`` reads that the proxy does not serve: a metric, a label, or a
    recorded series the rules do not record (whose own query lends it its labels)."""
    names = set(METRIC.findall(query))
    wrong = [f"metric {name}" for name in names if name not in served]
    for series in RECORDED.findall(query):
        if series not in recorded:
            wrong.append(f"recorded series {series}")
        else:
            names |= set(METRIC.findall(recorded[series]))
    labels = TARGET_LABELS.union(*(served.get(name, set()) for name in names))
    used = set(MATCHER.findall(query))
    for grouping in GROUPING.findall(query):
        used |= {label.strip() for label in grouping.split(",") if label.strip()}
    wrong += [f"label {label}" for label in sorted(used - labels)]
    return wrong


@pytest.mark.slow
async def test_every_series_the_rules_and_the_dashboard_read_is_one_a_proxy_serves(
    serving: Serving,
) -> None:
    """Nothing an operator is shown or alerted on reads a series that does not exist:
    every metric and label the rules and the dashboard's queries name is on the
    page of a real proxy (a supervisor of workers on PostgreSQL, over TLS) once it
    has forwarded, refused, quarantined and leased."""
    assert await serving.write("billing", "a", 2) == 200
    assert await serving.write("billing", "a", 1) == 409
    assert await serving.write("slow", "q", 1) == 504
    assert await serving.claim("lease-1") == 200
    served = series_labels(await serving.metrics())
    recorded = {rule["record"]: rule["expr"] for rule in rules() if "record" in rule}
    queries = [*(rule["expr"] for rule in rules()), *dashboard_queries(), *dashboard_variables()]
    unknown = {query: wrong for query in queries if (wrong := _unknown(query, served, recorded))}
    assert not unknown, json.dumps(unknown, indent=2)
    # The check reads what it should: the traffic's labels are there to be found.
    assert {"route", "outcome", "worker"} <= served["fenceproxy_decisions_total"]


class Prometheus:
    """Debian's ``prometheus`` on a free loopback port, scraping ``target`` (an admin
    listener) every second and evaluating ``rules`` as often."""

    def __init__(self, folder: Path, target: str, rules: Path) -> None:
        config = folder / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(rules)],
                    "scrape_configs": [
                        {"job_name": "fenceproxy", "static_configs": [{"targets": [target]}]}
                    ],
                }
            )
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = folder / "prometheus.log"
        self._argv = [
            _tool("prometheus"),
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
        ]

    def __enter__(self) -> Prometheus:
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT)
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        print(self._log.read_text())  # shown when a test fails

    async def alerts(self) -> dict[str, list[dict[str, Any]]]:
        """The alerts firing now (pending ones left out), by name; empty until it
        answers, and while it says it is not ready (503: its storage still opening)."""
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.get(self.url + "/api/v1/alerts") as answer,
            ):
                if answer.status == HTTPStatus.SERVICE_UNAVAILABLE:
                    return {}
                found = (await answer.json())["data"]["alerts"]
        except aiohttp.ClientConnectionError:
            assert self._process.poll() is None, self._log.read_text()
            return {}
        firing: dict[str, list[dict[str, Any]]] = {}
        for alert in found:
            if alert["state"] == "firing":
                firing.setdefault(alert["labels"]["alertname"], []).append(alert)
        return firing

    async def until_firing(self, *names: str, within: float = 20.0) -> dict[str, Any]:
        """Poll until every alert ``names`` says fires; the alerts firing then."""
        async with asyncio.timeout(within):
            while not set(names) <= set(firing := await self.alerts()):
                await asyncio.sleep(0.1)
        return firing


@pytest.fixture
def at_once(tmp_path: Path) -> Path:
    """The rules file with every alert's ``for`` 0s: firing at the first evaluation
    that finds it true."""
    document = yaml.safe_load(RULES.read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            if "alert" in rule:
                rule["for"] = "0s"
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.slow
async def test_prometheus_scraping_a_proxy_fires_the_alert_of_a_job_held_in_quarantine(
    serving: Serving, at_once: Path, tmp_path: Path
) -> None:
    """What an operator is paged on is what the proxy exports: a real Prometheus
    scraping a proxy's admin listener, with the shipped rules (``for`` cut to 0s),
    fires the held-job alert once a write to a hanging upstream has quarantined its
    job, and not before; it fires the certificate's alert for the listener's
    certificate ending in 7 days, and says the test's PostgreSQL has no synchronous
    standby."""
    admin = serving.proxy.admin_url.removeprefix("http://")
    with Prometheus(tmp_path, admin, at_once) as prometheus:
        # Once the certificate's alert fires, the rules have run on a scrape.
        firing = await prometheus.until_firing("FenceproxyCertificateExpiringSoon")
        assert "FenceproxyJobHeldPastQuarantine" not in firing
        (certificate,) = firing["FenceproxyCertificateExpiringSoon"]
        assert certificate["labels"]["listener"] == "proxy"  # once, for both workers

        assert await serving.write("slow", "held", 1) == 504
        firing = await prometheus.until_firing(
            "FenceproxyJobHeldPastQuarantine", "FenceproxyStoreNotSynchronous"
        )
        (held,) = firing["FenceproxyJobHeldPastQuarantine"]
        assert held["labels"]["state"] == "unknown"
        assert held["annotations"]["description"].startswith("1 jobs of the store")
