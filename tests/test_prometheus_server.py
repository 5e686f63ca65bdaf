"""The dashboard, the runbook's queries and the alert rules, asked of a real Prometheus server.

A real ``prometheus`` on loopback scrapes a real daemon every second, named
as docs/OPERATIONS.md says (scrape job ``ckptstaged``), and evaluates
deploy/prometheus/alerts.yml as shipped. Once the daemon has committed a save
locally and drained it to the shared tier, every query of
deploy/grafana/ckptstage.json and every PromQL query docs/OPERATIONS.md gives
must return a sample, and every alert's expression must find the series it
compares; then a read-only shared tier must make ``CkptstageDrainFailing``
pending, and a writable one again must end it.

Skips where the ``prometheus`` binary is absent (.ci/run installs Debian's
package), and the fault where this machine does not permit a bind mount.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.error import HTTPError
from urllib.parse import urlencode
from urllib.request import urlopen

import pytest
import torch
import yaml

from ckptstage.client import Client
from conftest import DaemonProc
from support import drain, free_port, read_only_mount, wait_until

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ckptstage.json"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"

PROMETHEUS = shutil.which("prometheus")

SCRAPE_JOB = "ckptstaged"  # the scrape job's name docs/OPERATIONS.md asks for
JOB = "promjob"            # the training job the daemon checkpoints
# Grafana's $__rate_interval is at least four scrape intervals and grows with the time range shown; a
# dashboard opened over this module's life (under a minute) sees the whole of it in one minute.
RATE_WINDOW = "1m"


# --- the queries: what the dashboard and the runbook ask, made concrete --------------------------------


@dataclass(frozen=True)
class Query:
    where: str               # where the query comes from, for the failure message
    expr: str                # as sent to Prometheus
    label: str | None = None  # a label every series must carry (a dashboard variable's label_values)


def grafana_expr(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana's variables replaced: ``$__rate_interval`` and the like by :data:`RATE_WINDOW`,
    the dashboard's own (``$instance``, ``${job}``) by ``values``. An unknown variable is an error."""
    for var in ("$__rate_interval", "$__interval", "$__range"):
        expr = expr.replace(var, RATE_WINDOW)

    def value(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"unknown dashboard variable ${name} in {expr!r}"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def dashboard_queries(values: dict[str, str]) -> list[Query]:
    """Every panel target's expression and every query variable's ``label_values`` of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    found = [Query(f"dashboard panel {p.get('title')!r} ({t.get('refId')})", grafana_expr(t["expr"], values))
             for p in panels(dash["panels"]) for t in p.get("targets", []) if t.get("expr")]
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert m, f"dashboard variable ${var['name']}: not a label_values() query: {query!r}"
        selector, label = grafana_expr(m.group(1), values), m.group(2)
        found.append(Query(f"dashboard variable ${var['name']}", f"group by ({label}) ({selector})", label))
    return found


_COMPARISON = re.compile(r"==|!=|>=|<=|>|<")


def with_bool(expr: str) -> str:
    """``expr`` with ``bool`` after each comparison operator (outside label matchers and strings), so a
    condition that is false still returns its sample (0): what is left to see is whether the series it
    compares exist at all."""
    out: list[str] = []
    i, depth, quote = 0, 0, ""
    while i < len(expr):
        c = expr[i]
        if quote:
            out.append(c)
            if c == "\\":
                out.append(expr[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c in "\"'`":
            quote = c
            out.append(c)
        elif c in "{}":
            depth += 1 if c == "{" else -1
            out.append(c)
        elif depth == 0 and (m := _COMPARISON.match(expr, i)):
            out.append(m.group(0))
            i = m.end()
            if not re.match(r"\s*bool\b", expr[i:]):
                out.append(" bool" if expr[i:i + 1].isspace() else " bool ")
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def runbook_queries() -> list[Query]:
    """What docs/OPERATIONS.md gives to type into Prometheus: each line of its ```promql blocks, and each
    inline expression (one that selects a ckptstage_ metric or ``up``) in the alerts' runbook, with its
    comparison made ``bool`` (a healthy daemon rightly fails the alert's condition)."""
    doc = OPERATIONS.read_text()
    found: list[Query] = []
    for block in re.findall(r"^```promql\n(.*?)^```", doc, flags=re.M | re.S):
        for line in block.splitlines():
            expr = re.sub(r"\s+#.*$", "", line).strip()
            if expr:
                found.append(Query("docs/OPERATIONS.md, a promql block", expr))
    runbook = re.search(r"^## Alerts and what to do\n(.*?)(?=^## )", doc, flags=re.M | re.S)
    assert runbook, "docs/OPERATIONS.md has no section '## Alerts and what to do'"
    section = ""
    for line in runbook.group(1).splitlines():
        if line.startswith("### "):
            section = line[4:].strip()
        for span in re.findall(r"`([^`]+)`", line):
            if re.match(r"(ckptstage_\w+|up)\s*(\{|$|\s)", span):
                found.append(Query(f"docs/OPERATIONS.md, runbook of {section}", with_bool(span)))
    return found


# An alert expression may rightly return nothing while all is well, whatever the series.
ALERTS_EMPTY_WHEN_HEALTHY = {
    "CkptstageDaemonAbsent": "absent() returns a sample only while no target of the job is scraped",
}


def alert_queries() -> list[Query]:
    """Every alert's expression, its comparisons made ``bool``: it must find the series it compares."""
    doc = yaml.safe_load(ALERTS.read_text())
    return [Query(f"alert {rule['alert']} (its comparisons made bool)", with_bool(rule["expr"]))
            for group in doc["groups"] for rule in group["rules"]
            if rule["alert"] not in ALERTS_EMPTY_WHEN_HEALTHY]


def test_with_bool_keeps_label_matchers_and_strings() -> None:
    assert with_bool('up{job="ckptstaged"} == 0') == 'up{job="ckptstaged"} == bool 0'
    assert (with_bool('a{x!="1", y=~"<>"} >= 0.1 * b and c > bool 2 or d<3')
            == 'a{x!="1", y=~"<>"} >= bool 0.1 * b and c > bool 2 or d< bool 3')


# --- a real Prometheus ---------------------------------------------------------------------------------


class PrometheusServer:
    """``prometheus`` on a free loopback port with its own storage, scraping and evaluating every second."""

    def __init__(self, root: Path, targets: list[str], rule_files: list[Path]) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "prometheus.log"
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(p) for p in rule_files],
                  "scrape_configs": [{"job_name": SCRAPE_JOB, "static_configs": [{"targets": targets}]}]}
        self.config = root / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> None:
        assert PROMETHEUS is not None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [PROMETHEUS, f"--config.file={self.config}", f"--storage.tsdb.path={self.root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._ready, timeout, f"prometheus ready on {self.url} (log {self.log})", poll=0.1)

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            pytest.fail(f"prometheus exited with status {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def api(self, path: str, **params: str) -> Any:
        """``/api/v1/PATH``'s data; a PromQL error raises :class:`PromQLError` with Prometheus' message."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urlencode(params)}" if params else "")
        try:
            with urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except HTTPError as e:
            body = json.load(e)
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now (a scalar as one sample without labels)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "vector":
            return list(data["result"])
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        raise PromQLError(f"not an instant vector but a {data['resultType']}")

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])


class PromQLError(Exception):
    pass


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((4096,), float(step)), "step": step}


@dataclass
class Stack:
    daemon: DaemonProc
    prometheus: PrometheusServer
    instance: str  # the daemon's `instance` label in Prometheus


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A daemon with metrics on a free loopback port and a Prometheus scraping it, after one save that
    committed locally and drained to the shared tier, and once Prometheus has scraped and evaluated the
    rules on that state."""
    if PROMETHEUS is None:
        pytest.skip("no prometheus binary on PATH (Debian: apt-get install prometheus)")
    root = tmp_path_factory.mktemp("prometheus")
    mport = free_port()
    instance = f"127.0.0.1:{mport}"
    d = DaemonProc(root / "node", **{"metrics.listen": instance})
    prom = PrometheusServer(root, [instance], [ALERTS])
    try:
        d.start()
        prom.start()
        # A scrape before the save, so rate() and increase() see the save's counts go up.
        wait_until(lambda: prom.query(f'up{{job="{SCRAPE_JOB}"}} == 1'), 20, "a first successful scrape", poll=0.2)
        with Client(JOB, socket=d.socket) as c:
            c.save(1, state_of(1)).wait("shared", timeout=60)
        drain(d)
        saved = time.time()
        wait_until(lambda: prom.query(f'ckptstage_saves_committed_total{{tier="shared"}} >= 1 '
                                      f'and timestamp(ckptstage_saves_committed_total) > {saved}'),
                   20, "a scrape after the drain", poll=0.2)
        wait_until(lambda: len(prom.query("ckptstage_tier_free_bytes")) == 2, 20,
                   "both tiers' free space in Prometheus", poll=0.2)
        scraped = time.time()
        wait_until(lambda: rules_evaluated_after(prom, scraped), 20, "an evaluation of the rules on it", poll=0.2)
        yield Stack(d, prom, instance)
    finally:
        prom.stop()
        d.stop()


def rules_evaluated_after(prom: PrometheusServer, t: float) -> bool:
    groups = prom.api("rules")["groups"]
    return bool(groups) and all(rfc3339(g["lastEvaluation"]) > t for g in groups)


def rfc3339(text: str) -> float:
    """Seconds since the epoch of Prometheus' RFC 3339 timestamps (nanoseconds, 'Z' or an offset)."""
    m = re.fullmatch(r"(.+?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", text)
    assert m, text
    base = datetime.fromisoformat(m.group(1) + ("+00:00" if m.group(3) == "Z" else m.group(3)))
    return base.timestamp() + float("0." + (m.group(2) or "0"))


def unanswered(prom: PrometheusServer, queries: list[Query]) -> list[str]:
    """A line for each query that fails, returns nothing, only NaN, or a series without its label."""
    problems = []
    for q in queries:
        try:
            result = prom.query(q.expr)
        except PromQLError as e:
            problems.append(f"{q.where}: {q.expr!r} is refused: {e}")
            continue
        if not result:
            problems.append(f"{q.where}: {q.expr!r} returned nothing")
        elif all(math.isnan(float(s["value"][1])) for s in result):
            problems.append(f"{q.where}: {q.expr!r} returned only NaN")
        elif q.label and not all(s["metric"].get(q.label) for s in result):
            problems.append(f"{q.where}: {q.expr!r} returned series without the label {q.label}")
    return problems


# --- the tests -----------------------------------------------------------------------------------------


def test_the_daemon_is_an_up_target_of_the_job_the_docs_name(stack: Stack) -> None:
    targets = stack.prometheus.api("targets")["activeTargets"]
    assert [(t["labels"]["job"], t["labels"]["instance"], t["health"]) for t in targets] == \
        [(SCRAPE_JOB, stack.instance, "up")], targets
    assert [s["value"][1] for s in stack.prometheus.query(f'up{{job="{SCRAPE_JOB}"}}')] == ["1"]
    # The training job is stored as exported_job; `job` stays the scrape job's (honor_labels off).
    assert {s["metric"]["job"] for s in stack.prometheus.query(f'ckptstage_job_checkpoints{{exported_job="{JOB}"}}')} \
        == {SCRAPE_JOB}


def test_every_dashboard_query_returns_a_sample(stack: Stack) -> None:
    queries = dashboard_queries({"instance": stack.instance, "job": JOB})
    assert len(queries) >= 30
    problems = unanswered(stack.prometheus, queries)
    assert not problems, "dashboard queries without data after a save drained:\n" + "\n".join(problems)
    jobs = stack.prometheus.query(next(q.expr for q in queries if q.where == "dashboard variable $job"))
    assert JOB in {s["metric"]["exported_job"] for s in jobs}


def test_every_runbook_query_returns_a_sample(stack: Stack) -> None:
    queries = runbook_queries()
    assert len(queries) >= 4
    problems = unanswered(stack.prometheus, queries)
    assert not problems, "docs/OPERATIONS.md queries without data after a save drained:\n" + "\n".join(problems)


def test_every_alert_rule_is_loaded_healthy_and_finds_its_series(stack: Stack) -> None:
    loaded = {r["name"]: r for g in stack.prometheus.api("rules")["groups"] for r in g["rules"]}
    shipped = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    assert set(loaded) == shipped
    sick = {name: r.get("lastError") for name, r in loaded.items() if r["health"] != "ok"}
    assert not sick, f"rules Prometheus could not evaluate: {sick}"
    firing = {r["name"]: r["state"] for r in loaded.values() if r["state"] != "inactive"}
    assert not firing, f"alerts active on a healthy daemon: {firing}"
    problems = unanswered(stack.prometheus, alert_queries())
    assert not problems, "alert expressions that find no series on a healthy daemon:\n" + "\n".join(problems)


def drain_failing_alerts(prom: PrometheusServer) -> list[dict[str, Any]]:
    return [a for a in prom.alerts() if a["labels"]["alertname"] == "CkptstageDrainFailing"]


def test_a_read_only_shared_tier_makes_drain_failing_pending(stack: Stack) -> None:
    d, prom = stack.daemon, stack.prometheus
    assert d.shared is not None
    assert not drain_failing_alerts(prom)
    with read_only_mount(d.shared) as writable:
        with Client(JOB, socket=d.socket) as c:
            c.save(2, state_of(2)).wait("local", timeout=30)
        committed = time.monotonic()
        alerts = wait_until(lambda: drain_failing_alerts(prom), 30, "CkptstageDrainFailing pending", poll=0.2)
        print(f"CkptstageDrainFailing {alerts[0]['state']} {time.monotonic() - committed:.1f}s after the "
              "local commit of a save whose drain fails")
        # Pending: the rule's `for:` (minutes) has not passed yet; firing, were it shorter.
        assert [(a["labels"]["exported_job"], a["labels"]["instance"]) for a in alerts] == [(JOB, stack.instance)]
        assert alerts[0]["state"] in ("pending", "firing"), alerts
        writable()
        drain(d)
    wait_until(lambda: not drain_failing_alerts(prom), 30, "CkptstageDrainFailing to end once drains succeed",
               poll=0.2)


def test_every_eviction_rule_and_retention_trigger_starts_at_zero() -> None:
    """The dashboard's retention panel rates these: a series born at 1 would hide the first eviction."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from ckptstage.daemon.metrics import Metrics
    from ckptstage.daemon.retention.planner import DELETE_REASONS

    text = generate_latest(Metrics(CollectorRegistry()).registry).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    for tier in ("local", "shared"):
        for rule in DELETE_REASONS:
            assert samples[("ckptstage_evictions_total", (("rule", rule), ("tier", tier)))] == 0
    for trigger in ("commit", "drain", "timer", "gc", "start"):
        assert samples[("ckptstage_retention_passes_total", (("trigger", trigger),))] == 0
