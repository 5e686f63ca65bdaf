"""Metrics scraped from another machine, as docs/OPERATIONS.md ("Scraping") tells Prometheus to.

The unit keeps the daemon to localhost (``IPAddressDeny=any``, ``IPAddressAllow=localhost``), so a scrape
of ``gpu-01:9464`` needs deploy/systemd/metrics.conf as a drop-in and a config listening beyond loopback.
These tests merge the drop-in into the unit as systemd does, check what the docs tell operators to set
against it, and have systemd-analyze load the pair. ``deploy/systemd/check-in-container.sh`` scrapes a
daemon under a real systemd from another address (allowed) and from one outside the network (dropped).
"""
from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support import unit_directives

from ckptstage.daemon.config import load_config
from ckptstage.daemon.configvalues import split_host_port

ROOT = Path(__file__).resolve().parent.parent
SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "ckptstaged@.service"
DROP_IN = SYSTEMD / "metrics.conf"
EXAMPLE = SYSTEMD / "example.toml"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
SYSTEMD_README = SYSTEMD / "README.md"
LISTS = ("IPAddressAllow", "IPAddressDeny")


def merged(unit: str, *drop_ins: str) -> dict[str, list[str]]:
    """The address lists of ``[Service]`` after the drop-ins, as systemd merges them.

    Each assignment adds its space-separated entries; an empty one resets the list.
    """
    lists: dict[str, list[str]] = {key: [] for key in LISTS}
    for text in (unit, *drop_ins):
        directives = unit_directives(text, "[Service]")
        for key in LISTS:
            for value in directives.get(key, []):
                lists[key] = lists[key] + value.split() if value.strip() else []
    return lists


def networks(entries: list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    named = {"localhost": ["127.0.0.0/8", "::1/128"], "any": ["0.0.0.0/0", "::/0"],
             "link-local": ["169.254.0.0/16", "fe80::/64"], "multicast": ["224.0.0.0/4", "ff00::/8"]}
    return [ipaddress.ip_network(n, strict=False) for e in entries for n in named.get(e, [e])]


def test_merge_follows_systemd() -> None:
    unit = "[Service]\nIPAddressDeny=any\nIPAddressAllow=localhost\n"
    assert merged(unit, "[Service]\nIPAddressAllow=10.0.0.0/8 10.1.0.0/16\n") == {
        "IPAddressAllow": ["localhost", "10.0.0.0/8", "10.1.0.0/16"], "IPAddressDeny": ["any"]}
    assert merged(unit, "[Service]\nIPAddressDeny=\n")["IPAddressDeny"] == []


def test_the_unit_alone_refuses_a_scraper_on_another_machine() -> None:
    lists = merged(UNIT.read_text())
    assert lists["IPAddressDeny"] == ["any"]
    assert all(n.is_loopback for n in networks(lists["IPAddressAllow"]))


def test_the_metrics_drop_in_allows_a_scraper_on_another_machine_and_nothing_else() -> None:
    lists = merged(UNIT.read_text(), DROP_IN.read_text())
    # The deny list stays: only the allowed network gets through, and the exposure does not change.
    assert lists["IPAddressDeny"] == ["any"]
    allowed = networks(lists["IPAddressAllow"])
    assert any(n.is_loopback for n in allowed), "the drop-in must add to localhost, not replace it"
    remote = [n for n in allowed if not n.is_loopback]
    assert remote, lists
    # An example to edit, not "any": no network wider than a /8.
    assert all(n.prefixlen >= 8 for n in remote), remote
    # The drop-in's header names where it is installed, beside deploy/s3's.
    assert "/etc/systemd/system/ckptstaged@.service.d/metrics.conf" in DROP_IN.read_text()


def _documented_listens(text: str) -> set[str]:
    """The ``[metrics] listen`` values a page shows (a ``listen`` under another section, ``[peers]``, is not
    the metrics port)."""
    found, section = set(), ""
    for line in text.splitlines():
        header = re.match(r"\s*#?\s*\[(\w+)\]\s*(#.*)?$", line)
        if header:
            section = header.group(1)
        value = re.search(r'listen = "([\d.:\[\]a-f]+:\d+)"', line)
        if value and section != "peers":
            found.add(value.group(1))
    return found


def test_the_docs_and_the_drop_in_give_one_listen_value_the_daemon_accepts(tmp_path: Path) -> None:
    remote = {v for doc in (OPERATIONS, SYSTEMD_README, DROP_IN)
              for v in _documented_listens(doc.read_text()) if not v.startswith("127.")}
    assert remote == {"0.0.0.0:9464"}, remote
    # example.toml stays on loopback and points to the remote value in its comment.
    example = EXAMPLE.read_text()
    assert load_config(EXAMPLE).metrics.listen == "127.0.0.1:9464"
    assert '"0.0.0.0:9464"' in example and "metrics.conf" in example
    # The config with the documented value loads, and listens on every address.
    config = tmp_path / "alice.toml"
    config.write_text(example.replace('listen = "127.0.0.1:9464"', 'listen = "0.0.0.0:9464"'))
    host, port = split_host_port(load_config(config).metrics.listen or "")
    assert ipaddress.ip_address(host).is_unspecified
    # Prometheus is told to scrape that port on the node's name.
    scraping = OPERATIONS.read_text().split("## Scraping", 1)[1].split("\n## ", 1)[0]
    targets = re.findall(r'"([\w.-]+):(\d+)"', scraping)
    assert targets and {int(p) for _, p in targets} == {port}
    assert "deploy/systemd/metrics.conf" in scraping


def _analyze(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{directory}:"}
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, cwd=directory, env=env,
                          timeout=60)


def test_systemd_loads_the_drop_in_and_the_exposure_stays(tmp_path: Path) -> None:
    from test_systemd import _unit_copy

    unit = _unit_copy(tmp_path)
    instance = unit.rename(unit.with_name("ckptstaged@alice.service"))
    before = _analyze(tmp_path, "security", "--offline=yes", instance.name)
    (tmp_path / "ckptstaged@.service.d").mkdir()
    (tmp_path / "ckptstaged@.service.d" / "metrics.conf").write_text(DROP_IN.read_text())
    verify = _analyze(tmp_path, "verify", "--man=no", instance.name)
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")
    after = _analyze(tmp_path, "security", "--offline=yes", instance.name)
    exposure = [re.search(r"Overall exposure level for \S+: (\d+\.\d)", out.stdout) for out in (before, after)]
    assert all(exposure), after.stdout + after.stderr
    # The allow list beyond localhost costs 0.1 ("IPAddressAllow= ... other than localhost"): documented.
    assert [m.group(1) for m in exposure if m] == ["1.3", "1.4"]
    for doc in (DROP_IN, SYSTEMD_README):
        assert re.search(r"1\.3\s+to\s+1\.4", doc.read_text()), f"{doc.name} gives another exposure"
