"""The size of each tier: TierProbe readings carry the tier's total bytes (Tier.usage), and the metrics
export them as ckptstage_tier_size_bytes{tier}, which the "tier nearly full" alert divides by."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import free_port, scrape, wait_until

from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.metrics import Metrics, StateProbe
from ckptstage.daemon.tiers.interface import Usage
from ckptstage.daemon.tiers.probe import TierProbe


class _Measured(FsTier):
    """A file-system tier whose room is what the test says (the probe's seam is the tier it is given)."""

    def __init__(self, root: Path, usage: Usage | OSError) -> None:
        super().__init__(root)
        self.answer = usage

    def usage(self) -> Usage:
        if isinstance(self.answer, OSError):
            raise self.answer
        return self.answer


def test_a_reading_carries_the_tiers_size_and_keeps_the_last_one_while_the_tier_fails(tmp_path: Path) -> None:
    tier = _Measured(tmp_path, Usage(free_bytes=30, total_bytes=1000))
    probe = TierProbe("local", tier)
    before = probe.reading()
    assert (before.free_bytes, before.total_bytes, before.reachable) == (None, None, None)
    probe.probe()
    assert probe.reading() == type(before)(free_bytes=30, reachable=True, total_bytes=1000)
    tier.answer = OSError(5, "I/O error")
    probe.probe()
    failed = probe.reading()
    assert (failed.free_bytes, failed.total_bytes, failed.reachable) == (30, 1000, False)


def test_the_real_file_systems_size_is_what_statvfs_says(tmp_path: Path) -> None:
    probe = TierProbe("local", FsTier(tmp_path))
    probe.probe()
    st = os.statvfs(tmp_path)
    reading = probe.reading()
    assert reading.total_bytes == st.f_blocks * st.f_frsize
    assert reading.free_bytes is not None and 0 < reading.free_bytes <= reading.total_bytes


def _samples(text: str, name: str) -> dict[str, float]:
    return {s.labels["tier"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def test_the_collector_exports_each_tiers_size_once_it_is_known() -> None:
    sizes = {"local": 1 << 40, "shared": None}
    m = Metrics(CollectorRegistry(auto_describe=True))
    m.add_state(StateProbe(arena_used=lambda: 0, arena_total=lambda: 1, sessions=lambda: 0,
                           tiers=lambda: ["local", "shared"], tier_used=lambda t: 0, tier_free=lambda t: 7,
                           drain_queue=lambda: (0, 0), drain_lag_s=lambda: 0.0, shared_reachable=lambda: True,
                           tier_size=sizes.get))
    text = generate_latest(m.registry).decode()
    assert _samples(text, "ckptstage_tier_size_bytes") == {"local": float(1 << 40)}
    assert _samples(text, "ckptstage_tier_free_bytes") == {"local": 7.0, "shared": 7.0}


def test_a_daemon_exports_the_size_of_both_tiers(daemon_factory: Any) -> None:
    port = free_port()
    d = daemon_factory("size", **{"metrics.listen": f"127.0.0.1:{port}"}).start()
    text = wait_until(lambda: (t := scrape(port)).count("ckptstage_tier_size_bytes{") == 2 and t, 20,
                      "both tiers' size")
    sizes = _samples(text, "ckptstage_tier_size_bytes")
    for tier, where in (("local", d.local), ("shared", d.shared)):
        st = os.statvfs(where)
        assert sizes[tier] == st.f_blocks * st.f_frsize
        assert 0 < _samples(text, "ckptstage_tier_free_bytes")[tier] <= sizes[tier]
