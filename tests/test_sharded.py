"""Sharded state (FSDP2, tensor parallel, a 2-D mesh) saved by real ranks and reloaded at other world sizes.

Two daemons stand for two nodes: each its own local tier, one shared tier
(ranks 0-1 talk to node a, ranks 2-3 to node b). Loads at another world size
run on a third, fresh daemon that never saw the job and finds it on the
shared tier. Every comparison is bit-exact on full (unsharded) tensors
gathered with ``get_state_dict(full_state_dict=True)``.

Ranks are separate processes joined in a gloo group (tests/dist_harness.py);
the rank functions below are module-level so the rank processes can import
them. Models are tiny: the module runs in about a minute on 2 cores.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn

from dist_harness import RankContext, RanksFailed, full_state, kill_self, node_sockets, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DIM = 24      # divisible by 1, 2, 3, 4 (and 12): every layer but ``odd`` shards evenly at any world size here
ODD = 13      # deliberately uneven: FSDP pads it (4 ranks hold 4, 4, 4, 1 rows; 3 ranks 5, 5, 3)
HEAD = 2      # fewer rows than ranks: at 3 and 4 ranks some hold an empty shard
VOCAB = 36
STEP = 40
REP1D = torch.arange(4.0 * DIM).view(4, DIM)            # saved Replicate on the 4-rank world mesh
GRID = torch.arange(DIM * DIM, dtype=torch.int64).view(DIM, DIM)  # saved (Shard(0), Shard(1)) on the 2x2 mesh


# --- the model and its parallelisms (used inside the rank processes) ---------------------


class Net(nn.Module):
    scale: torch.Tensor

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM, dtype=torch.bfloat16)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.odd = nn.Linear(DIM, ODD)
        self.head = nn.Linear(ODD, HEAD)
        self.register_buffer("scale", torch.arange(12, dtype=torch.float32) + seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.emb(torch.arange(4)).float().mean(0)
        return self.head(self.odd(self.fc2(torch.relu(self.fc1(h))))) * self.scale[0]


def build(layout: str, mesh_shape: tuple[int, ...], seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Net parallelised as ``layout`` ("fsdp": 1-D FSDP2; "2d": FSDP over ``dp`` x TP over ``tp``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = Net(seed)
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", mesh_shape)
        dp = mesh
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        dp = mesh["dp"]
    for sub in (model.emb, model.fc1, model.fc2, model.odd, model.head):
        fully_shard(sub, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    return model, opt, mesh


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    """One real step, so that the optimizer has state (exp_avg, exp_avg_sq, step)."""
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(4, DIM, generator=g)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def probe_output(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        return model(torch.randn(3, DIM, generator=g)).detach().clone()


def per_rank_values(rank: int) -> dict[str, Any]:
    """Plain (non-DTensor) values that differ by rank."""
    return {"rank": 100 + rank, "rank_t": torch.tensor([100 + rank, -rank], dtype=torch.int32),
            "note": f"from rank {rank}"}


def placeholders() -> dict[str, Any]:
    return {"rank": -1, "rank_t": torch.zeros(2, dtype=torch.int32), "note": ""}


# --- rank functions ------------------------------------------------------------------------


def save_sharded(ctx: RankContext, job: str, layout: str, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from ckptstage.client import Client

    model, opt, mesh = build(layout, mesh_shape, seed=0)
    train_step(model, opt, seed=1)
    msd, osd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": msd, "optim": osd, **per_rank_values(ctx.rank)}
    if layout == "2d":
        world = init_device_mesh("cpu", (ctx.world_size,))
        state["rep1d"] = distribute_tensor(REP1D, world, [Replicate()])
        state["grid"] = distribute_tensor(GRID, mesh, [Shard(0), Shard(1)])
    with Client(job, socket=ctx.socket) as client:
        h = client.save(STEP, state)
        h.wait_snapshot(timeout=60)
        h.wait("local", timeout=60)
        client.wait_step(STEP, "shared", timeout=90)
        latest = client.latest()
    full = full_state(model, opt)
    return {"latest": latest, "full": full if ctx.rank == 0 else None, "out": probe_output(model)}


def load_sharded(ctx: RankContext, job: str, layout: str, mesh_shape: tuple[int, ...],
                 probe_errors: bool = False, extras: bool = False) -> dict[str, Any]:
    """Loads into ``layout``; ``extras``: the checkpoint also has save_sharded's 2-D extras (rep1d, grid)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from ckptstage.client import Client

    model, opt, mesh = build(layout, mesh_shape, seed=1000 + ctx.world_size)  # other values than the saved ones
    train_step(model, opt, seed=2)
    train_step(model, opt, seed=3)  # and another optimizer step count
    msd, osd = get_state_dict(model, opt)
    into: dict[str, Any] = {"model": msd, "optim": osd, **placeholders()}
    if extras:
        world = init_device_mesh("cpu", (ctx.world_size,))
        into["rep1d"] = distribute_tensor(torch.zeros_like(REP1D), world, [Shard(0)])  # saved Replicate
        into["grid"] = distribute_tensor(torch.zeros_like(GRID), world, [Replicate()])  # saved (Shard(0), Shard(1))
        if ctx.rank % 2:
            # Ranks may list their keys in different orders (DCP tests this: a collective per key would hang).
            into = dict(reversed(list(into.items())))
            into["model"] = dict(reversed(list(msd.items())))
    before = {k: v for k, v in msd.items() if isinstance(v, DTensor)}
    with Client(job, socket=ctx.socket) as client:
        latest = client.latest()
        got = client.load(STEP, into=into)
        errors = _probe_errors(client, into, mesh) if probe_errors else None
    in_place = sorted(k for k, v in before.items() if got["model"].get(k) is v)
    set_state_dict(model, opt, model_state_dict=got["model"], optim_state_dict=got["optim"])
    out: dict[str, Any] = {"latest": latest, "rank": got["rank"], "rank_t": got["rank_t"].clone(),
                           "note": got["note"], "in_place": in_place, "dtensor_keys": sorted(before),
                           "errors": errors}
    full = full_state(model, opt)
    out["full"] = full if ctx.rank == 0 else None
    out["out"] = probe_output(model)
    if extras:
        out["rep1d"] = got["rep1d"].full_tensor()
        out["grid"] = got["grid"].to_local().clone()  # Replicate: this rank's own copy, read from every fragment
    return out


def _probe_errors(client: Any, into: dict[str, Any], mesh: Any) -> dict[str, str | None]:
    """Loads into states that disagree with the checkpoint; what each raised (None: nothing)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def attempt(state: dict[str, Any]) -> str | None:
        try:
            client.load(STEP, into=state)
        except Exception as e:  # noqa: BLE001 - the test asserts on type and message
            return f"{type(e).__name__}: {e}"
        return None

    wrong_shape = dict(into, model=dict(into["model"], **{"odd.weight": distribute_tensor(
        torch.zeros(ODD + 1, DIM), mesh, [Shard(0)])}))
    wrong_dtype = dict(into, model=dict(into["model"], **{"fc2.bias": distribute_tensor(
        torch.zeros(DIM, dtype=torch.float64), mesh, [Shard(0)])}))
    extra_key = dict(into, model=dict(into["model"], **{"extra.weight": distribute_tensor(
        torch.zeros(DIM, DIM), mesh, [Shard(0)])}))
    return {"shape": attempt(wrong_shape), "dtype": attempt(wrong_dtype), "missing": attempt(extra_key)}


def save_two_steps_and_die(ctx: RankContext, job: str, victim: int) -> dict[str, Any]:
    """Step 1 completes; at step 2 rank ``victim`` is SIGKILLed right after ``save()`` returned."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstage.client import Client

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    with Client(job, socket=ctx.socket) as client:
        s1 = {"w": distribute_tensor(torch.full((DIM, DIM), 1.0), mesh, [Shard(0)]), "attempt": "first"}
        client.save(1, s1).wait("local", timeout=60)
        client.wait_step(1, "shared", timeout=90)
        # 16 MiB that the snapshot thread is still copying (or has not begun) when the rank dies.
        s2 = {"w": distribute_tensor(torch.full((DIM, DIM), 2.0), mesh, [Shard(0)]), "attempt": "first",
              "bulk": torch.ones(4 << 20)}
        h = client.save(2, s2)
        if ctx.rank == victim:
            kill_self()
        h.wait("local", timeout=60)
        try:
            client.wait_step(2, "shared", timeout=3)
            waited = "returned"
        except TimeoutError as e:
            waited = f"TimeoutError: {e}"
        return {"wait_step_2": waited}


def restart_and_resave(ctx: RankContext, job: str) -> dict[str, Any]:
    """A new attempt (new group, new Client): step 2 is not there; it saves step 2 again and loads it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstage.client import Client

    mesh = init_device_mesh("cpu", (ctx.world_size,))

    def fresh() -> dict[str, Any]:
        return {"w": distribute_tensor(torch.zeros(DIM, DIM), mesh, [Shard(0)]), "attempt": ""}

    with Client(job, socket=ctx.socket) as client:
        latest_before = client.latest()
        try:
            client.load(2, into=fresh())
            load_2 = None
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            load_2 = f"{type(e).__name__}: {e}"
        step1 = client.load(1, into=fresh())["w"].full_tensor()
        s2 = {"w": distribute_tensor(torch.full((DIM, DIM), 3.0), mesh, [Shard(0)]), "attempt": "second",
              **per_rank_values(ctx.rank)}
        client.save(2, s2).wait("local", timeout=60)
        client.wait_step(2, "shared", timeout=90)
        latest_after = client.latest()
        got = client.load(2, into=dict(fresh(), **placeholders()))
        return {"latest_before": latest_before, "load_2": load_2, "step1": step1, "latest_after": latest_after,
                "w": got["w"].full_tensor(), "attempt": got["attempt"], "rank": got["rank"],
                "rank_t": got["rank_t"].tolist(), "note": got["note"]}


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """Daemons ``a`` and ``b`` (two nodes) on one shared tier."""
    from conftest import DaemonProc

    root = tmp_path_factory.mktemp("sharded")
    shared = root / "shared"
    a = DaemonProc(root / "a", **{"shared.dir": str(shared)}).start()
    b = DaemonProc(root / "b", **{"shared.dir": str(shared)}).start()
    ns = SimpleNamespace(root=root, shared=shared, a=a, b=b, made=[a, b])

    def fresh(name: str) -> Any:
        d = DaemonProc(root / name, **{"shared.dir": str(shared)}).start()
        ns.made.append(d)
        return d

    ns.fresh = fresh
    yield ns
    for d in ns.made:
        d.stop()


def two_nodes(ns: SimpleNamespace, ranks_per_node: int) -> Any:
    return node_sockets([str(ns.a.socket), str(ns.b.socket)], ranks_per_node)


@pytest.fixture(scope="module")
def fsdp_ckpt(nodes: SimpleNamespace) -> SimpleNamespace:
    """FSDP2 state saved by 4 ranks on two nodes and drained to the shared tier."""
    job = "fsdp-job"
    res = run_ranks(save_sharded, 4, two_nodes(nodes, 2), args=(job, "fsdp", (4,)), timeout=180)
    return SimpleNamespace(job=job, saved=res, full=res[0]["full"], out=res[0]["out"])


@pytest.fixture(scope="module")
def fresh_node(nodes: SimpleNamespace, fsdp_ckpt: SimpleNamespace) -> SimpleNamespace:
    """A daemon started after the save, with its own (empty) local tier and the same shared tier."""
    d = nodes.fresh("c")
    assert not (d.local / fsdp_ckpt.job).exists()
    return d


# --- helpers for the test process ----------------------------------------------------------


def assert_states_equal(got: Any, want: Any, path: str = "") -> None:
    """Same structure, tensors bit-exact (dtype and shape too), plain values equal."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: a {type(got).__name__}, want a tensor"
        assert not hasattr(got, "device_mesh"), f"{path}: a DTensor, want a plain torch.Tensor"
        assert (got.dtype, tuple(got.shape)) == (want.dtype, tuple(want.shape)), \
            f"{path}: {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
        assert torch.equal(got, want), f"{path}: values differ (max abs diff {(got.double() - want.double()).abs().max()})"
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: a {type(got).__name__}, want a dict"
        assert set(got) == set(want), f"{path}: keys {sorted(map(str, got))}, want {sorted(map(str, want))}"
        for k in want:
            assert_states_equal(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{path}: {got!r}, want {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_states_equal(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r}, want {want!r}"


def manifests(tier: Path, job: str, step: int) -> list[dict[str, Any]]:
    """The first (JSON) line of every part's manifest.json of ``step`` on ``tier``."""
    step_dir = tier / job / f"step-{step:012d}"
    found = [json.loads(p.read_text().splitlines()[0]) for p in sorted(step_dir.rglob("manifest.json"))]
    assert found, f"no manifest under {step_dir}"
    return found


def fragments(parts: list[dict[str, Any]], match: Any) -> list[tuple[int, list[int], list[int], list[int]]]:
    """(rank, global_shape, global_offset, local shape) of every stored fragment whose fqn ``match`` accepts."""
    out = []
    for m in parts:
        for t in m["tensors"]:
            if "global_shape" in t and match(str(t.get("fqn", ""))):
                out.append((m["rank"], t["global_shape"], t["global_offset"], t["shape"]))
    return out


def shapes_named(msg: str, key: str, *shapes: tuple[int, ...]) -> bool:
    flat = re.sub(r"\s", "", msg)
    return key in msg and all(",".join(map(str, s)) in flat for s in shapes)


# --- harness self-checks (no ckptstage feature involved) ----------------------------------------


def rank_hangs_or_raises(ctx: RankContext, how: str) -> int:
    if ctx.rank == 1 and how == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    if ctx.rank == 1 and how == "hang":
        time.sleep(3600)
    if how == "collective":
        import torch.distributed as dist

        t = torch.tensor([ctx.rank])
        dist.all_reduce(t)
        return int(t.item())
    return ctx.rank


def test_harness_returns_values_and_reports_failures(tmp_path: Path) -> None:
    assert run_ranks(rank_hangs_or_raises, 2, "/unused", args=("collective",), timeout=60) == [1, 1]
    with pytest.raises(RanksFailed, match=r"(?s)rank 1 .*RuntimeError: rank 1 fails on purpose"):
        run_ranks(rank_hangs_or_raises, 2, "/unused", args=("raise",), timeout=60)
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match=r"(?s)rank 1 \(exit -9\): timed out.*in rank_hangs_or_raises"):
        run_ranks(rank_hangs_or_raises, 2, "/unused", args=("hang",), timeout=5)
    assert time.monotonic() - t0 < 30


# --- FSDP2: 4 ranks on two nodes -> 1, 2, 3 ranks on a fresh node, and one process ------------------


def test_fsdp_save_completes_on_the_shared_tier(fsdp_ckpt: SimpleNamespace, nodes: SimpleNamespace) -> None:
    assert [r["latest"] for r in fsdp_ckpt.saved] == [STEP] * 4
    ranks = sorted(m["rank"] for m in manifests(nodes.shared, fsdp_ckpt.job, STEP))
    assert ranks == [0, 1, 2, 3]
    # Each node's local tier holds its own ranks' parts only.
    for d, own in ((nodes.a, {0, 1}), (nodes.b, {2, 3})):
        local = {m["rank"] for m in manifests(d.local, fsdp_ckpt.job, STEP)}
        assert local == own, f"{d.root.name}: local parts of ranks {sorted(local)}, want {sorted(own)}"


def test_fresh_daemon_finds_the_job_on_the_shared_tier(fsdp_ckpt: SimpleNamespace, fresh_node: Any) -> None:
    from ckptstage.client import Client

    t0 = time.monotonic()
    with Client(fsdp_ckpt.job, socket=fresh_node.socket) as client:
        latest = None
        while latest != STEP and time.monotonic() - t0 < 2.0:
            latest = client.latest()
            time.sleep(0.05)
    assert latest == STEP, f"a fresh daemon answered latest()={latest} after {time.monotonic() - t0:.1f}s"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp_loads_at_another_world_size(fsdp_ckpt: SimpleNamespace, fresh_node: Any, world: int) -> None:
    res = run_ranks(load_sharded, world, str(fresh_node.socket), args=(fsdp_ckpt.job, "fsdp", (world,), world == 2),
                    timeout=180)
    assert [r["latest"] for r in res] == [STEP] * world
    assert_states_equal(res[0]["full"]["model"], fsdp_ckpt.full["model"], "model")
    assert_states_equal(res[0]["full"]["optim"], fsdp_ckpt.full["optim"], "optim")
    for r in res:
        assert torch.equal(r["out"], fsdp_ckpt.out), "the reloaded model computes another output"
        # Plain values of another world size come back as rank 0's.
        assert (r["rank"], r["rank_t"].tolist(), r["note"]) == (100, [100, 0], "from rank 0")
        assert r["in_place"] == r["dtensor_keys"], "load(into=) replaced DTensors instead of filling them"
    if world == 2:
        errors = res[0]["errors"]
        assert errors["shape"] is not None and shapes_named(errors["shape"], "odd.weight", (ODD, DIM), (ODD + 1, DIM)), \
            f"a wrong global shape: {errors['shape']}"
        assert errors["shape"].startswith(("ValueError", "InvalidRequest")), errors["shape"]
        assert errors["dtype"] is not None and "fc2.bias" in errors["dtype"], f"a wrong dtype: {errors['dtype']}"
        assert errors["missing"] is not None and "extra.weight" in errors["missing"], \
            f"a key not in the checkpoint: {errors['missing']}"


def test_fsdp_single_process_load_gives_full_tensors(fsdp_ckpt: SimpleNamespace, fresh_node: Any) -> None:
    from ckptstage.client import Client

    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    with Client(fsdp_ckpt.job, socket=fresh_node.socket) as client:
        state = client.load(STEP)
    assert_states_equal(state["model"], fsdp_ckpt.full["model"], "model")
    assert_states_equal(state["optim"], fsdp_ckpt.full["optim"], "optim")
    assert (state["rank"], state["rank_t"].tolist(), state["note"]) == (100, [100, 0], "from rank 0")


# --- a rank killed mid-save ---------------------------------------------------------------------


def test_rank_killed_mid_save_leaves_the_step_incomplete_and_a_restart_saves_it(nodes: SimpleNamespace) -> None:
    job, victim = "killed-job", 1
    sockets = two_nodes(nodes, 1)
    res = run_ranks(save_two_steps_and_die, 2, sockets, args=(job, victim), timeout=180, expect_killed=[victim])
    assert res[0]["wait_step_2"].startswith("TimeoutError"), f"wait_step(2) with a rank dead: {res[0]['wait_step_2']}"
    # The premise: the victim died before its part of step 2 was committed anywhere.
    for tier in (nodes.b.local, nodes.shared):
        step2 = tier / job / f"step-{2:012d}"
        assert not (step2 / "commit.json").exists(), f"{step2} has a commit record with rank {victim} dead"
        assert not any(json.loads(p.read_text().splitlines()[0])["rank"] == victim
                       for p in step2.rglob("manifest.json")), f"rank {victim}'s part of step 2 was committed"

    res = run_ranks(restart_and_resave, 2, sockets, args=(job,), timeout=180)
    for r in res:
        assert r["latest_before"] == 1, f"latest() before the restart saved: {r['latest_before']}"
        assert r["load_2"] is not None, "load(2) of an incomplete step returned"
        assert torch.equal(r["step1"], torch.full((DIM, DIM), 1.0))
        assert r["latest_after"] == 2
        assert torch.equal(r["w"], torch.full((DIM, DIM), 3.0)), "step 2 mixes the dead attempt's part in"
        assert r["attempt"] == "second"
    # Plain values at the world size they were saved at come back per rank.
    assert [(r["rank"], r["rank_t"], r["note"]) for r in res] == \
        [(100 + rank, [100 + rank, -rank], f"from rank {rank}") for rank in range(2)]
