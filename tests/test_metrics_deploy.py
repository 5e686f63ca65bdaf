"""Metrics an operator alerts on, and the alert rules and dashboard built on them.

The per-job collector is tested at its seam (a StateProbe returning real
JobSummary records) and through a real daemon; then every metric name and
label used by deploy/prometheus/alerts.yml and deploy/grafana/ckptstage.json
must exist in a real daemon's scrape, every metric must be documented in
docs/OPERATIONS.md, and the alerts must fire (promtool's rule unit tests) for
what they are meant to and not for a finished job.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ckptstage.client import Client
from conftest import DaemonProc
from ckptstage.daemon.drain.health import DrainHealth
from ckptstage.daemon.node.jobs import JobSummary
from ckptstage.daemon.metrics import JOB_LABEL, MAX_JOB_SERIES, OTHER_JOB, Metrics, StateProbe, package_version
from support import drain, free_port, metric, scrape, wait_until

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "ckptstage.json"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"

# Names and labels the expressions may use that do not come from ckptstaged's scrape: Prometheus' own
# series per target, and the labels Prometheus attaches to every scraped series.
EXTERNAL_METRICS = {"up"}
TARGET_LABELS = {"job", "instance"}


def stored_label(exposed: str) -> str:
    """A label of ckptstaged's exposition as Prometheus stores it, so as PromQL selects it.

    Prometheus' rule (scrape config honor_labels: false, the default): a scraped
    label named like a target label keeps its value under ``exported_<name>``,
    and the target's value stays in ``<name>``. So the training job, ``job`` in
    the exposition, is ``exported_job`` in the alerts and the dashboard.
    """
    return f"exported_{exposed}" if exposed in TARGET_LABELS else exposed


def stored_labels(exposed: set[str]) -> set[str]:
    """The labels PromQL may use on a series scraped with these: its own (renamed) and the target's."""
    return {stored_label(label) for label in exposed} | TARGET_LABELS


# --- PromQL: the metric names and labels an expression uses -----------------------------------------

PROMQL_KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                   "offset", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^{}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_CALL = re.compile(r"\b([a-zA-Z_][a-zA-Z0-9_]*)\s*\(")
_NAME = re.compile(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)")
_DURATION = re.compile(r"(?<![\w.])(?:\d+(?:ms|[smhdwy]))+(?!\w)")  # offset 5m, 1h30m
_NUMBER = re.compile(r"(?<![\w])\d+(?:\.\d+)?(?:e[+-]?\d+)?")
# Grafana's variables, replaced by something PromQL accepts before parsing.
_GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


class PromQLRefs:
    """The metric names an expression selects, the labels it matches on each, and its grouping labels."""

    def __init__(self, expr: str) -> None:
        for var, value in _GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        expr = re.sub(r"\$\{?\w+\}?", "x", expr)  # $instance, ${job}: inside label values only
        self.matchers: dict[str, set[str]] = {}  # metric -> labels in its {...} matchers
        self.grouping: set[str] = set()
        text = _STRING.sub('""', expr)

        def selector(m: re.Match[str]) -> str:
            name = m.group(1) or ""
            labels = set(_MATCHER.findall(m.group(2)))
            if name:
                self.matchers.setdefault(name, set()).update(labels)
            else:  # {__name__="..."} and bare selectors: not used here; refuse to guess
                raise AssertionError(f"a selector without a metric name in {expr!r}")
            return f" {name} "

        text = _SELECTOR.sub(selector, text)

        def grouping(m: re.Match[str]) -> str:
            self.grouping.update(x.strip() for x in m.group(2).split(",") if x.strip())
            return " "

        text = _GROUPING.sub(grouping, text)
        text = _RANGE.sub(" ", text)
        self.functions = set(_CALL.findall(text))
        text = _CALL.sub(" ( ", text)
        text = _DURATION.sub(" ", text)
        text = _NUMBER.sub(" ", text)
        names = {n for n in _NAME.findall(text) if n.lower() not in PROMQL_KEYWORDS}
        self.metrics = names | set(self.matchers)


def test_promql_parser_finds_names_labels_and_skips_functions_keywords_and_strings() -> None:
    r = PromQLRefs('histogram_quantile(0.9, sum by (le) (rate(a_bucket{instance=~"$instance", x!="b c"}'
                   '[$__rate_interval]))) > 2 * on (instance) group_left (tier) b offset 5m '
                   'and ignoring(tier) c_total unless absent(up{job="ckptstaged"}) or vector(1e3)')
    assert r.metrics == {"a_bucket", "b", "c_total", "up"}
    assert r.matchers == {"a_bucket": {"instance", "x"}, "up": {"job"}}
    assert r.grouping == {"le", "instance", "tier"}
    assert {"histogram_quantile", "rate", "absent", "vector"} <= r.functions
    assert PromQLRefs("time() - max without (tier) (m)").metrics == {"m"}


# --- the scrape: which names exist, with which labels ----------------------------------------------


def scraped_names(text: str) -> dict[str, set[str]]:
    """Every series name a scrape offers -> the labels seen on it.

    Sample names as exposed (``_total``, ``_bucket``/``_sum``/``_count``,
    ``_info``), plus, for a family with no sample yet (a labelled counter no
    one incremented), the names it will have, with its labels unknown (empty).
    """
    names: dict[str, set[str]] = {}
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "summary": ["_sum", "_count", ""],
                "info": ["_info"]}
    for family in text_string_to_metric_families(text):
        for suffix in suffixes.get(family.type, [""]):
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def families_in(text: str) -> set[str]:
    return {f.name for f in text_string_to_metric_families(text)}


# --- the collector at its seam --------------------------------------------------------------------


def probe(jobs: list[JobSummary]) -> StateProbe:
    return StateProbe(arena_used=lambda: 0, arena_total=lambda: 1 << 30, sessions=lambda: 0,
                      tiers=lambda: ["local", "shared"], tier_used=lambda t: 0, tier_free=lambda t: None,
                      drain_queue=lambda: (0, 0), drain_lag_s=lambda: 0.0, shared_reachable=lambda: True,
                      jobs=lambda: jobs)


def exposition(jobs: list[JobSummary]) -> str:
    m = Metrics(CollectorRegistry(auto_describe=True), version="9.8.7")
    m.add_state(probe(jobs))
    return generate_latest(m.registry).decode()


def summary(job: str, commit: float, sessions: int = 0, state: str = "idle", local: int = 100,
            failures: int = 0, error_time: float = 0.0, queued: tuple[int, int] = (0, 0)) -> JobSummary:
    drain_health = DrainHealth(state, queued[0], queued[1], "boom" if failures else "", error_time, failures)
    return JobSummary(job, checkpoints=3, latest_step=30, last_commit_time={"local": commit, "shared": commit - 5},
                      bytes={"local": local, "shared": 2 * local}, sessions=sessions, drain=drain_health)


def test_build_info_carries_the_installed_version() -> None:
    text = exposition([])
    assert metric(text, "ckptstage_build_info", version="9.8.7") == 1
    m = Metrics(CollectorRegistry())
    installed = package_version()
    assert installed not in ("", "unknown")  # the test environment installs ckptstage
    assert metric(generate_latest(m.registry).decode(), "ckptstage_build_info", version=installed) == 1


def test_collector_exports_each_job_summary_under_the_label_job() -> None:
    jobs = [summary("llama-7b", commit=1_700_000_100.5, sessions=4, state="retrying", local=1 << 30,
                    failures=3, error_time=1_700_000_200.0, queued=(2, 5 << 20)),
            summary("bert", commit=1_700_000_000.0)]
    text = exposition(jobs)
    assert metric(text, "ckptstage_jobs") == 2
    assert metric(text, "ckptstage_jobs_folded") == 0
    assert JOB_LABEL == "job"
    j = {"job": "llama-7b"}
    assert metric(text, "ckptstage_job_checkpoints", **j) == 3
    assert metric(text, "ckptstage_job_latest_step", **j) == 30
    assert metric(text, "ckptstage_last_commit_timestamp_seconds", tier="local", **j) == 1_700_000_100.5
    assert metric(text, "ckptstage_last_commit_timestamp_seconds", tier="shared", **j) == 1_700_000_095.5
    assert metric(text, "ckptstage_job_bytes", tier="local", **j) == 1 << 30
    assert metric(text, "ckptstage_job_bytes", tier="shared", **j) == 2 << 30
    assert metric(text, "ckptstage_job_sessions", **j) == 4
    assert metric(text, "ckptstage_job_drain_failing", **j) == 1
    assert metric(text, "ckptstage_job_drain_consecutive_failures", **j) == 3
    assert metric(text, "ckptstage_job_drain_last_error_timestamp_seconds", **j) == 1_700_000_200.0
    assert metric(text, "ckptstage_job_drain_queue_parts", **j) == 2
    assert metric(text, "ckptstage_job_drain_queue_bytes", **j) == 5 << 20
    b = {"job": "bert"}
    assert metric(text, "ckptstage_job_drain_failing", **b) == 0
    assert metric(text, "ckptstage_job_sessions", **b) == 0
    # No drain error: no timestamp series (a 0 would read as "failed in 1970" in time() - x).
    assert not re.search(r'ckptstage_job_drain_last_error_timestamp_seconds\{job="bert"', text)
    # `job` is the training job on every per-job series, and only there; no other label names a job (no
    # series carries both the training job and something meant as a scrape job).
    per_job = {"ckptstage_job_checkpoints", "ckptstage_job_latest_step", "ckptstage_last_commit_timestamp_seconds",
               "ckptstage_job_bytes", "ckptstage_job_sessions", "ckptstage_job_drain_failing",
               "ckptstage_job_drain_consecutive_failures", "ckptstage_job_drain_last_error_timestamp_seconds",
               "ckptstage_job_drain_queue_parts", "ckptstage_job_drain_queue_bytes"}
    seen = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert not {k for k in sample.labels if "job" in k} - {"job"}, sample
            if family.name in per_job:
                seen.add(family.name)
                assert sample.labels["job"] in {"llama-7b", "bert"}, sample
            else:
                assert "job" not in sample.labels, sample
    assert seen == per_job


@pytest.mark.parametrize("state, failing", [("idle", 0), ("draining", 0), ("disabled", 0), ("retrying", 1),
                                            ("failed", 1)])
def test_drain_failing_follows_the_drain_state(state: str, failing: int) -> None:
    text = exposition([summary("j", commit=1.0, state=state)])
    assert metric(text, "ckptstage_job_drain_failing", **{JOB_LABEL: "j"}) == failing


def test_a_job_without_commits_has_no_commit_timestamp_nor_latest_step() -> None:
    fresh = JobSummary("new-run", 0, None, {}, {}, 1, DrainHealth("idle", 0, 0))
    text = exposition([fresh])
    assert metric(text, "ckptstage_job_sessions", **{JOB_LABEL: "new-run"}) == 1
    assert "ckptstage_last_commit_timestamp_seconds{" not in text
    assert "ckptstage_job_latest_step{" not in text


def test_job_series_are_capped_active_and_newest_first_the_rest_folded() -> None:
    n = MAX_JOB_SERIES + 6
    now = 1_800_000_000.0
    # Finished jobs, newest first by number; plus two old ones that matter: one with a trainer connected,
    # one whose drains fail. Those two must keep their own series although their commits are the oldest.
    jobs = [summary(f"done-{i:03d}", commit=now - i) for i in range(n)]
    jobs += [summary("old-running", commit=1.0, sessions=2), summary("old-failing", commit=2.0, state="failed")]
    text = exposition(jobs)
    shown = {s.labels[JOB_LABEL] for f in text_string_to_metric_families(text)
             if f.name == "ckptstage_job_checkpoints" for s in f.samples}
    assert len(shown) == MAX_JOB_SERIES + 1
    assert {"old-running", "old-failing", OTHER_JOB} <= shown
    newest = {f"done-{i:03d}" for i in range(MAX_JOB_SERIES - 2)}
    assert newest <= shown
    folded = {f"done-{i:03d}" for i in range(MAX_JOB_SERIES - 2, n)}
    assert not folded & shown
    assert metric(text, "ckptstage_jobs") == n + 2
    assert metric(text, "ckptstage_jobs_folded") == len(folded) == 8
    other = {JOB_LABEL: OTHER_JOB}
    assert metric(text, "ckptstage_job_checkpoints", **other) == 3 * len(folded)
    assert metric(text, "ckptstage_job_bytes", tier="local", **other) == 100 * len(folded)
    newest_folded = now - (MAX_JOB_SERIES - 2)
    assert metric(text, "ckptstage_last_commit_timestamp_seconds", tier="local", **other) == newest_folded
    assert metric(text, "ckptstage_job_drain_failing", **other) == 0
    # The bytes summed over the exported series are every job's bytes: nothing is lost by folding.
    total = sum(s.value for f in text_string_to_metric_families(text) if f.name == "ckptstage_job_bytes"
                for s in f.samples if s.labels["tier"] == "local")
    assert total == 100 * len(jobs)


# --- a real daemon ----------------------------------------------------------------------------------

JOB = "metricsjob"


def state_of(step: int) -> dict[str, Any]:
    return {"w": torch.full((4096,), float(step)), "step": step}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real daemon with metrics on a free loopback port, after two saves drained (the first evicted
    from the local tier by keep_last = 1), with the client still connected; yields its scrape."""
    port = free_port()
    d = DaemonProc(tmp_path_factory.mktemp("metrics") / "node", **{"metrics.listen": f"127.0.0.1:{port}",
                                                                   "local.keep_last": 1})
    d.start()
    try:
        t0 = time.time()
        with Client(JOB, socket=d.socket) as c:
            for step in (1, 2):
                c.save(step, state_of(step)).wait("shared", timeout=60)
            drain(d)
            wait_until(lambda: metric(scrape(port), "ckptstage_evictions_total", tier="local",
                                      rule="keep_last") >= 1, 20, "the local eviction of step 1")
            wait_until(lambda: "ckptstage_tier_free_bytes{" in scrape(port), 20, "a tier free-space reading")
            yield {"text": scrape(port), "port": port, "t0": t0, "t1": time.time(), "daemon": d}
    finally:
        d.stop()


def test_real_daemon_exports_build_info_and_its_jobs(live: dict[str, Any]) -> None:
    text = live["text"]
    assert metric(text, "ckptstage_build_info", version=package_version()) == 1
    j = {JOB_LABEL: JOB}
    assert metric(text, "ckptstage_jobs") == 1
    assert metric(text, "ckptstage_job_checkpoints", **j) == 2  # step 1 on shared only, step 2 on both
    assert metric(text, "ckptstage_job_latest_step", **j) == 2
    assert metric(text, "ckptstage_job_sessions", **j) == 1
    assert metric(text, "ckptstage_job_drain_failing", **j) == 0
    assert metric(text, "ckptstage_job_drain_queue_bytes", **j) == 0
    for tier in ("local", "shared"):
        t = metric(text, "ckptstage_last_commit_timestamp_seconds", tier=tier, **j)
        assert live["t0"] - 1 <= t <= live["t1"] + 1, (tier, t)
        assert metric(text, "ckptstage_job_bytes", tier=tier, **j) > 0
    # keep_last = 1 locally: the local tier holds one step, the shared tier two.
    assert metric(text, "ckptstage_job_bytes", tier="shared", **j) > metric(text, "ckptstage_job_bytes",
                                                                            tier="local", **j)


def test_real_daemon_reports_a_job_whose_drains_fail_until_they_succeed(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory(**{"metrics.listen": f"127.0.0.1:{port}"}).start()
    assert d.shared is not None
    blocker = d.shared / "faultyjob"
    blocker.write_bytes(b"not a directory")  # the job's directory on the shared tier cannot be created
    j = {JOB_LABEL: "faultyjob"}
    with Client("faultyjob", socket=d.socket) as c:
        before = time.time()
        c.save(1, state_of(1)).wait("local", timeout=60)
        wait_until(lambda: metric(scrape(port), "ckptstage_job_drain_failing", **j) == 1, 30, "drain_failing == 1")
        text = scrape(port)
        assert metric(text, "ckptstage_job_drain_consecutive_failures", **j) >= 1
        assert metric(text, "ckptstage_job_drain_last_error_timestamp_seconds", **j) >= before - 1
        assert metric(text, "ckptstage_job_drain_queue_parts", **j) == 1
        assert metric(text, "ckptstage_job_drain_queue_bytes", **j) > 0
        blocker.unlink()
        drain(d)
        wait_until(lambda: metric(scrape(port), "ckptstage_job_drain_failing", **j) == 0, 30, "drain_failing == 0")
        text = scrape(port)
        assert metric(text, "ckptstage_job_drain_queue_parts", **j) == 0
        assert "ckptstage_job_drain_last_error_timestamp_seconds{" not in text  # cleared by the success


# --- the alert rules ----------------------------------------------------------------------------------


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression) of every panel target and query variable of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    found = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["definition"])
            assert m, var["definition"]
            found.append((f"${var['name']}", f"count by ({m.group(2)}) ({m.group(1)})"))
    return found


def test_alert_rules_are_well_formed() -> None:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"}
    names = set()
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert re.fullmatch(r"Ckptstage[A-Z]\w+", rule["alert"]), rule["alert"]
            assert rule["alert"] not in names, f"duplicate alert {rule['alert']}"
            names.add(rule["alert"])
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            if "for" in rule:
                assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
            assert rule["labels"]["severity"] in {"critical", "warning", "info"}
            notes = rule["annotations"]
            assert {"summary", "description", "runbook_url"} <= set(notes), rule["alert"]
            assert notes["runbook_url"] == f"docs/OPERATIONS.md#{rule['alert'].lower()}"
    assert len(names) >= 8


def test_every_alert_has_its_runbook_section_and_every_metric_its_reference_entry(live: dict[str, Any]) -> None:
    doc = OPERATIONS.read_text()
    anchors = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", doc, flags=re.M)}
    for rule in alert_rules():
        assert rule["annotations"]["runbook_url"].split("#")[1] in anchors, rule["alert"]
    documented = set(re.findall(r"`(ckptstage_\w+)(?:\{[^`]*\})?`", doc))
    missing = {name for name in families_in(live["text"]) if name.startswith("ckptstage_")}
    missing = {n for n in missing if not {n, n + "_total", n + "_info"} & documented}
    assert not missing, f"metrics not in docs/OPERATIONS.md: {sorted(missing)}"


def check_refs(where: str, expr: str, names: dict[str, set[str]]) -> PromQLRefs:
    refs = PromQLRefs(expr)
    assert refs.metrics, f"{where}: no metric in {expr!r}"
    for name in refs.metrics:
        assert name in names or name in EXTERNAL_METRICS, f"{where}: {name} is not in the daemon's scrape"
    for name, labels in refs.matchers.items():
        known = stored_labels(names.get(name, set()))
        assert labels <= known, f"{where}: {name} has no label {sorted(labels - known)}"
        # On a series that exposes `job` itself, `job` in PromQL is the scrape job's: never what is meant.
        shadowed = labels & names.get(name, set()) & TARGET_LABELS
        assert not shadowed, f"{where}: {name} matches the target's {sorted(shadowed)}, not exported_*"
    exposed = set().union(*(names.get(n, set()) for n in refs.metrics))
    known = stored_labels(exposed)
    assert refs.grouping <= known, f"{where}: no metric of {expr!r} has label(s) {sorted(refs.grouping - known)}"
    shadowed = refs.grouping & exposed & TARGET_LABELS
    assert not shadowed, f"{where}: {expr!r} groups by the target's {sorted(shadowed)}, not exported_*"
    return refs


def test_every_name_and_label_the_alerts_use_is_in_a_real_scrape(live: dict[str, Any]) -> None:
    names = scraped_names(live["text"])
    for rule in alert_rules():
        refs = check_refs(rule["alert"], rule["expr"], names)
        exposed = set().union(*(names.get(n, set()) for n in refs.metrics))
        known = stored_labels(exposed) - (exposed & TARGET_LABELS)  # $labels.job would name the scrape job
        for text in rule["annotations"].values():
            used = set(re.findall(r"\$labels\.(\w+)", text))
            assert used <= known, f"{rule['alert']}: annotations use label(s) {sorted(used - known)}"


def test_every_name_and_label_the_dashboard_uses_is_in_a_real_scrape(live: dict[str, Any]) -> None:
    names = scraped_names(live["text"])
    exprs = dashboard_exprs()
    assert len(exprs) >= 30
    for title, expr in exprs:
        check_refs(title, expr, names)


def test_dashboard_is_a_grafana_model_with_a_datasource_variable_and_no_overlapping_panels() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"instance", "job"} <= set(variables)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert 'instance=~"$instance"' in t["expr"], f"{p['title']}: {t['expr']} ignores the daemon filter"
    titles = " / ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("save rate", "persist duration", "drain duration", "drain queue", "drain lag", "tier used",
                  "tier free", "last commit", "drain failing", "arena used vs budget", "memory tier", "sessions",
                  "corrupt"):
        assert topic in titles, f"no panel about {topic}"


# --- promtool: Prometheus' own check of the rules, and unit tests of when they fire ---------------------

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install "
                                                             "prometheus)")


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    assert PROMTOOL is not None
    out = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in out.stdout


TARGET = {"job": "ckptstaged", "instance": "node-1"}  # the scrape target's labels in the cases below


def series(name: str, values: str, **exposed: str) -> dict[str, str]:
    """An input series as Prometheus stores one scraped with the labels ``exposed``: renamed by
    stored_label (the training job's `job` becomes `exported_job`), plus the target's labels."""
    labels = {**{stored_label(k): v for k, v in exposed.items()}, **TARGET}
    return {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}",
            "values": values}


def fires(alert: str, at: str, *labelsets: dict[str, str]) -> dict[str, Any]:
    """An expectation: at ``at``, ``alert`` fires exactly for these label sets (target labels added)."""
    severity = next(r["labels"]["severity"] for r in alert_rules() if r["alert"] == alert)
    return {"eval_time": at, "alertname": alert,
            "exp_alerts": [{"exp_labels": {**TARGET, "severity": severity, **ls}} for ls in labelsets]}


# Minutes are the unit of the input series below (interval 1m); time() starts at 0.
PROMTOOL_CASES: list[dict[str, Any]] = [
    {"interval": "1m",
     "input_series": [
         # "running" has a trainer connected and committed last at t=0; "finished" too, but nobody is
         # connected any more; "fresh" commits every minute.
         series("ckptstage_last_commit_timestamp_seconds", "0x130", job="running", tier="local"),
         series("ckptstage_job_sessions", "1x130", job="running"),
         series("ckptstage_last_commit_timestamp_seconds", "0x130", job="finished", tier="local"),
         series("ckptstage_job_sessions", "0x130", job="finished"),
         series("ckptstage_last_commit_timestamp_seconds", "0+60x130", job="fresh", tier="memory"),
         series("ckptstage_job_sessions", "8x130", job="fresh")],
     "alert_rule_test": [
         fires("CkptstageNoRecentCommit", "65m"),  # an hour old, but not yet for 10 minutes
         fires("CkptstageNoRecentCommit", "75m", {"exported_job": "running"}),
         fires("CkptstageNoRecentCommit", "120m", {"exported_job": "running"})]},
    {"interval": "1m",
     "input_series": [
         series("ckptstage_job_drain_failing", "0x10 1x20 0x10", job="a"),
         series("ckptstage_job_drain_failing", "0x40", job="b"),
         series("ckptstage_drain_lag_seconds", "0+120x40")],  # grows 2 min per minute: 1800 s at 15m
     "alert_rule_test": [
         fires("CkptstageDrainFailing", "15m"),
         fires("CkptstageDrainFailing", "25m", {"exported_job": "a"}),
         fires("CkptstageDrainFailing", "40m"),  # drains succeed again
         fires("CkptstageDrainLagHigh", "25m"),
         fires("CkptstageDrainLagHigh", "35m", {})]},
    {"interval": "1m",
     "input_series": [
         series("up", "1x10 0x20"),
         series("ckptstage_tier_free_bytes", "10x30", tier="local"),
         series("ckptstage_tier_used_bytes", "100x30", tier="local"),
         series("ckptstage_tier_size_bytes", "1000x30", tier="local"),  # 1% free
         series("ckptstage_tier_free_bytes", "1000x30", tier="shared"),
         series("ckptstage_tier_used_bytes", "3000x30", tier="shared"),
         series("ckptstage_tier_size_bytes", "5000x30", tier="shared"),  # 20% free: not nearly full
         series("ckptstage_corrupt_parts_total", "0x5 1x25", tier="shared"),
         series("ckptstage_corrupt_parts_total", "0x30", tier="local"),
         series("ckptstage_shared_tier_up", "1x5 0x25"),
         series("ckptstage_incomplete_steps", "0x30")],
     "alert_rule_test": [
         fires("CkptstageDaemonDown", "20m", {}),
         fires("CkptstageTierNearlyFull", "20m", {"tier": "local"}),
         fires("CkptstageCorruptParts", "10m", {"tier": "shared"}),
         fires("CkptstageSharedTierUnreachable", "15m", {}),
         fires("CkptstageIncompleteSteps", "25m")]},
    {"interval": "1m",
     "input_series": [
         series("ckptstage_saves_failed_total", "0+1x60"),
         series("ckptstage_saves_committed_total", "5x60", tier="local"),
         series("ckptstage_saves_committed_total", "0x60", tier="shared"),
         series("ckptstage_tier_free_bytes", "1000-10x60", tier="local")],  # 10 per minute: empty at 100m
     "alert_rule_test": [
         fires("CkptstageSavesFailing", "50m", {}),
         fires("CkptstageTierFillingUp", "59m", {"tier": "local"})]},
    {"interval": "1m",
     "input_series": [
         # A peer went away at 5m: the oldest queued part's wait grows a minute per minute; back at 40m.
         series("ckptstage_peer_replication_lag_seconds", "0x5 0+60x35 0x10")],
     "alert_rule_test": [
         fires("CkptstageReplicationLagging", "20m"),  # 10 min of lag at 15m, not yet for 10 minutes
         fires("CkptstageReplicationLagging", "30m", {}),
         fires("CkptstageReplicationLagging", "45m")]},
]


@needs_promtool
def test_promtool_alerts_fire_as_meant_and_not_for_finished_jobs(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    # promtool compares annotations too; what fires, and with which labels, is the point here (the
    # annotation templates are checked by `promtool check rules`).
    doc = yaml.safe_load(ALERTS.read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(doc))
    tested = {t["alertname"] for case in PROMTOOL_CASES for t in case["alert_rule_test"]}
    untested = {r["alert"] for r in alert_rules()} - tested - {"CkptstageDaemonAbsent"}
    assert not untested, f"alerts without a promtool case: {sorted(untested)}"
    spec = tmp_path / "tests.yml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m",
                                    "tests": PROMTOOL_CASES}))
    out = subprocess.run([PROMTOOL, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
