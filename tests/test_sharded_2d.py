"""A 2-D (FSDP over ``dp`` x tensor parallel over ``tp``) state saved by 4 ranks on two nodes, reloaded at other meshes.

The model, the rank functions and the helpers are test_sharded's. Modules
without a TP plan (``emb``, ``odd``) are FSDP-sharded over ``dp`` only, as in
real FSDP x TP training: their DTensors live on the ``dp`` sub-mesh, so the
two ``tp`` ranks of a ``dp`` row hold the same shard.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dist_harness import run_ranks
from test_sharded import (
    DIM,
    GRID,
    REP1D,
    STEP,
    assert_states_equal,
    fragments,
    load_sharded,
    manifests,
    nodes,  # noqa: F401 - the module-scoped fixture (this module gets its own two daemons)
    save_sharded,
    two_nodes,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

@pytest.fixture(scope="module")
def ckpt_2d(nodes: SimpleNamespace) -> SimpleNamespace:
    """State of a 2x2 (dp x tp) mesh saved by 4 ranks on two nodes."""
    job = "fsdp-tp-job"
    res = run_ranks(save_sharded, 4, two_nodes(nodes, 2), args=(job, "2d", (2, 2)), timeout=180)
    return SimpleNamespace(job=job, saved=res, full=res[0]["full"], out=res[0]["out"])


def test_2d_replicate_is_stored_once(ckpt_2d: SimpleNamespace, nodes: SimpleNamespace) -> None:
    parts = manifests(nodes.shared, ckpt_2d.job, STEP)
    assert sorted(m["rank"] for m in parts) == [0, 1, 2, 3]
    rep = fragments(parts, lambda f: "rep1d" in f)
    assert [r[0] for r in rep] == [0], f"a tensor Replicate on 4 ranks stored by ranks {[r[0] for r in rep]}"
    assert rep[0][1:] == ([4, DIM], [0, 0], [4, DIM])
    grid = fragments(parts, lambda f: "grid" in f)
    assert sorted((r[0], tuple(r[2]), tuple(r[3])) for r in grid) == [
        (0, (0, 0), (12, 12)), (1, (0, 12), (12, 12)), (2, (12, 0), (12, 12)), (3, (12, 12), (12, 12))], grid
    # fc2.bias is (Shard(0) over dp, Replicate over tp): stored by tp coordinate 0 of each dp row only.
    bias = fragments(parts, lambda f: "fc2.bias" in f and "exp_avg" not in f)
    assert sorted((r[0], r[2][0]) for r in bias) == [(0, 0), (2, DIM // 2)], f"fc2.bias fragments: {bias}"
    # Every tensor of the full 2x2 mesh is covered exactly once (TP's strided FSDP shards included).
    # (Modules FSDP shards over the dp sub-mesh only, emb and odd, are stored by both tp slices: nothing
    # local tells a copy on another slice from a different tensor of the same name, e.g. a pipeline stage.)
    for name in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        for kind in ("", "exp_avg", "exp_avg_sq"):
            frs = fragments(parts, lambda f, n=name, k=kind: n in f and (k in f if k else "exp_avg" not in f)
                            and not (k == "exp_avg" and "exp_avg_sq" in f))
            assert frs, f"no fragment of {name} {kind}"
            total = sum(math.prod(r[3]) for r in frs)
            assert total == math.prod(frs[0][1]), f"{name} {kind}: fragments hold {total} elements of " \
                                                  f"{math.prod(frs[0][1])}: {frs}"


@pytest.mark.parametrize(("layout", "mesh_shape"), [("2d", (1, 4)), ("fsdp", (3,))], ids=["2d-1x4", "fsdp-3"])
def test_2d_loads_at_another_mesh(ckpt_2d: SimpleNamespace, nodes: SimpleNamespace, layout: str,
                                  mesh_shape: tuple[int, ...]) -> None:
    """(dp=2, tp=2) -> (dp=1, tp=4) at the same world size, and -> 1-D FSDP at 3 ranks."""
    world = math.prod(mesh_shape)
    res = run_ranks(load_sharded, world, two_nodes(nodes, 2), args=(ckpt_2d.job, layout, mesh_shape, False, True),
                    timeout=180)
    assert_states_equal(res[0]["full"]["model"], ckpt_2d.full["model"], "model")
    assert_states_equal(res[0]["full"]["optim"], ckpt_2d.full["optim"], "optim")
    for rank, r in enumerate(res):
        # Plain values: per rank at the world size they were saved at, rank 0's at another.
        src = rank if world == 4 else 0
        assert (r["rank"], r["rank_t"].tolist(), r["note"]) == (100 + src, [100 + src, -src], f"from rank {src}")
        assert torch.equal(r["rep1d"], REP1D)
        assert torch.equal(r["grid"], GRID), f"rank {rank}: the Replicate target is not the whole saved grid"
        torch.testing.assert_close(r["out"], ckpt_2d.out)  # TP sums partial products in another order


def test_2d_single_process_load_gives_full_tensors(ckpt_2d: SimpleNamespace, nodes: SimpleNamespace) -> None:
    from ckptstage.client import Client

    with Client(ckpt_2d.job, socket=nodes.a.socket) as client:
        state = client.load(STEP)
    assert_states_equal(state["model"], ckpt_2d.full["model"], "model")
    assert_states_equal(state["optim"], ckpt_2d.full["optim"], "optim")
    assert torch.equal(state["rep1d"], REP1D)
    assert torch.equal(state["grid"], GRID)
