"""Writes prometheusrule.yaml beside this file from deploy/prometheus/alerts.yml (one source for the alerts).

    python deploy/kubernetes/monitoring/gen_prometheusrule.py
"""

from __future__ import annotations

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ALERTS = HERE.parents[1] / "prometheus" / "alerts.yml"
OUT = HERE / "prometheusrule.yaml"
HEADER = """\
# deploy/prometheus/alerts.yml as a PrometheusRule, for the Prometheus Operator.
# Generated: edit alerts.yml, then run
#   python deploy/kubernetes/monitoring/gen_prometheusrule.py
# (tests/test_deploy_kubernetes.py fails while the two differ).
"""


def render() -> str:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "ckptstage", "labels": {"app.kubernetes.io/part-of": "ckptstage"}},
            "spec": {"groups": groups}}
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=120, default_flow_style=False)


if __name__ == "__main__":
    OUT.write_text(render())
