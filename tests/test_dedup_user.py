"""``[persist] dedup = "user"``: one chunk store per tier for every job of the daemon's user.

The commonest workload of all, many fine-tunes of one base model, stores the
base once per tier instead of once per job; and retention of one job never
removes a chunk that a step of another job names. Real daemons, both tiers,
real files.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from ckptstage.daemon.tiers import fspacks
from ckptstage.protos import chunks, layout, packs
from support import wait_until

USER = {"persist.incremental": True, "persist.dedup": "user", "persist.chunk_grace_s": 0.01}
BASE = 2 << 20  # fp32 elements of the base model: 8 MiB
ADAPTER = 4096  # fp32 elements each fine-tune trains: 16 KiB


def fine_tune(job: str, step: int) -> dict[str, Any]:
    base = torch.Generator().manual_seed(0)
    trained = torch.Generator().manual_seed(zlib.crc32(f"{job}/{step}".encode()))
    return {"base": torch.randn(BASE, generator=base), "adapter": torch.randn(ADAPTER, generator=trained),
            "step": step}


def held(tier: Path) -> int:
    """The bytes of every file of the tier's checkpoints and chunk stores (not the daemon's state)."""
    return sum(p.stat().st_size for p in tier.rglob("*") if p.is_file()
               and p.relative_to(tier).parts[0] not in (".state", ".tmp", ".peers"))


def part(tier: Path, job: str, step: int) -> Path:
    return layout.part_dir(tier, job, step, 0)


def names(tier: Path, job: str, step: int) -> set[str]:
    return chunks.referenced(layout.read_manifest(part(tier, job, step)))


def user_store(tier: Path) -> Path:
    return chunks.store_dir(tier, chunks.USER_STORE)


@pytest.mark.parametrize("dedup, most", [("user", 0.02), ("job", None)])
def test_a_second_fine_tune_of_one_base_stores_almost_nothing_on_either_tier_with_dedup_user(
        daemon_factory: Any, dedup: str, most: float | None) -> None:
    d = daemon_factory("n", **{**USER, "persist.dedup": dedup}).start()
    with Client("ft-a", socket=d.socket) as a:
        a.save(1, fine_tune("ft-a", 1)).wait("shared", timeout=60)
    before = {tier: held(tier) for tier in (d.local, d.shared)}
    with Client("ft-b", socket=d.socket) as b:
        b.save(1, fine_tune("ft-b", 1)).wait("shared", timeout=60)
        full = layout.part_bytes(layout.read_manifest(part(d.local, "ft-b", 1)))
        for tier in (d.local, d.shared):
            cost = held(tier) - before[tier]
            if most is not None:
                assert cost <= most * full, f"{tier}: the second job stored {cost} bytes of {full}"
            else:
                assert cost >= 0.95 * full  # each job its own store: the base again
            manifest = layout.read_manifest(part(tier, "ft-b", 1))
            assert manifest.get(chunks.STORE_FIELD) == ("user" if dedup == "user" else None)
            chunks.verify_part(part(tier, "ft-b", 1))
        assert torch.equal(b.load(1)["adapter"], fine_tune("ft-b", 1)["adapter"])
    assert user_store(d.local).is_dir() == (dedup == "user")


def test_retention_of_one_job_never_removes_a_chunk_that_another_jobs_step_names(daemon_factory: Any) -> None:
    d = daemon_factory("n", **USER, **{"local.keep_last": 1, "shared.keep_last": 1}).start()
    with Client("ft-a", socket=d.socket) as a:
        a.save(1, fine_tune("ft-a", 1)).wait("shared", timeout=60)
        a.save(2, fine_tune("ft-a", 2)).wait("shared", timeout=60)
        # Job B forks from A's step 2: it names the base and step 2's adapter, which sit in a pack of their own.
        with Client("ft-b", socket=d.socket) as b:
            b.save(1, fine_tune("ft-a", 2)).wait("shared", timeout=60)
        for step in (3, 4):
            a.save(step, fine_tune("ft-a", step)).wait("shared", timeout=60)
    fork = names(d.local, "ft-b", 1)
    assert fork - names(d.local, "ft-a", 4), "B names chunks that A's last step does not"
    for tier in (d.local, d.shared):
        # A's retention deleted steps 1 to 3; the user store's sweep marked B's step too.
        wait_until(lambda: not any(layout.part_dir(tier, "ft-a", s, 0).exists() for s in (1, 2, 3)), timeout=30,
                   what=f"ft-a's older steps deleted on {tier}")
        live = names(tier, "ft-a", 4) | names(tier, "ft-b", 1)

        def swept() -> bool:
            stored = fspacks.list_packs(user_store(tier))
            return all(any(n in live for n in p.names) for p in stored)  # a pack nothing names is gone

        wait_until(swept, timeout=30, what=f"the packs of ft-a's step 3 swept from {tier}")
        index = packs.StoreIndex(user_store(tier))
        index.refresh()
        assert fork <= set(index.packed())
        chunks.verify_part(part(tier, "ft-b", 1))
        chunks.verify_part(part(tier, "ft-a", 4))
    with Client("ft-b", socket=d.socket) as b:
        got = b.load(1)
        assert torch.equal(got["adapter"], fine_tune("ft-a", 2)["adapter"])
        assert torch.equal(got["base"], fine_tune("ft-b", 1)["base"])
