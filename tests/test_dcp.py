"""ckptstage as a DCP storage backend: dcp.save / async_save / load through Writer and Reader, real daemon.

Single-process tests cover the storage seam itself (values, planners, key
errors, step choice, the plain API on either side); the multi-rank tests run
real gloo ranks (tests/dist_harness.py) with FSDP2 models and compare full
(unsharded) model and optimizer state bit for bit after a reload at the same
and at another world size. Models are tiny; the module runs in about a minute
on 2 cores.
"""

from __future__ import annotations

import concurrent.futures
import fractions
import io
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from support import assert_same

from ckptstage.client import Client
from ckptstage.dcp import LoadPlanner, Reader, SavePlanner, Writer
from ckptstage.dcp import values
from ckptstage.protos import layout
from dist_harness import RankContext, detached, full_state, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns when no process group exists

_FAILED = (CheckpointException, Exception)  # DCP wraps a rank's error in a CheckpointException (a BaseException)
DIM = 8
ODD = 5  # uneven: FSDP2 pads it at 2 ranks


# --- models -------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, ODD, dtype=torch.float64)
        self.emb = nn.Embedding(6, DIM, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x + self.emb(torch.arange(x.shape[0]) % 6).float()))
        return self.fc2(h.double())


def train(model: nn.Module, opt: torch.optim.Optimizer, seed: int, steps: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(4, DIM, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def plain_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    train(model, opt, seed)
    return model, opt


def fsdp_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Net(seed)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for sub in (model.fc1, model.fc2, model.emb):
        fully_shard(sub, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (seed + 1))
    return model, opt




def part_manifests(d: Any, job: str, step: int) -> list[dict[str, Any]]:
    step_dir = d.local / job / layout.step_dirname(step)
    return [layout.read_manifest(p) for p in sorted(step_dir.glob("rank-*"))]


def tree_tags(node: Any) -> set[str]:
    """Every tag of a manifest tree (see ckptstage.client.tree)."""
    tags, stack = set(), [node]
    while stack:
        (tag, v), = stack.pop().items()
        tags.add(tag)
        if tag in ("l", "t"):
            stack.extend(v)
        elif tag in ("d", "o"):
            stack.extend(x for kv in v for x in kv)
    return tags


# --- single process -----------------------------------------------------------------------


@pytest.fixture
def sock(daemon: Any) -> str:
    return str(daemon.socket)


def test_save_and_load_roundtrip_with_values(sock: str) -> None:
    model, opt = plain_model(1)
    sd = {"model": model.state_dict(), "optim": opt.state_dict(),
          "extra": {"epoch": 3, "name": "run", "pair": (1, "a"), "blob": b"\x00\xff", "none": None,
                    "big": 2**70, "nan": float("nan"), "ints": [1, 2, 3]}}
    saved = detached(sd)
    md = dcp.save(sd, storage_writer=Writer("j", 10, socket=sock), planner=SavePlanner())
    assert "optim.param_groups.0.lr" in md.state_dict_metadata

    model2, opt2 = plain_model(2)
    into = {"model": model2.state_dict(), "optim": opt2.state_dict(),
            "extra": {"epoch": 0, "name": "", "pair": None, "blob": b"", "none": 1, "big": 0, "nan": 0.0,
                      "ints": []}}
    reader = Reader("j", 10, socket=sock)
    dcp.load(into, storage_reader=reader, planner=LoadPlanner())
    assert reader.loaded_step == 10
    nan = into["extra"].pop("nan")
    assert nan != nan
    saved["extra"].pop("nan")
    assert_same(saved, into, exact_dicts=False)
    for p in model2.state_dict().values():  # the model's own tensors were filled in place
        assert any(torch.equal(p, q) for q in saved["model"].values())


def test_dcp_checkpoint_is_the_universal_format(daemon: Any, sock: str) -> None:
    """Tensors are fragments by fqn (the DCP key), the tree the state's own nesting with D nodes and values
    (as Client.save nests it: int keys and OrderedDicts kept): Client.load returns the nested state."""
    model, opt = plain_model(1)
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}
    saved = detached(sd)
    dcp.save(sd, storage_writer=Writer("j", 5, socket=sock), planner=SavePlanner())

    (manifest,) = part_manifests(daemon, "j", 5)
    assert all("global_shape" in t and t["fqn"] for t in manifest["tensors"])
    items = dict((k["s"], v) for k, v in manifest["tree"]["d"])
    model_items = dict((k["s"], v) for k, v in items["model"]["o"])
    assert model_items["fc1.weight"] == {"D": {"fqn": "model.fc1.weight", "dtype": "float32", "shape": [2 * DIM, DIM]}}
    group = dict((k["s"], v) for k, v in items["optim"]["d"][1][1]["l"][0]["d"])
    assert group["lr"] == {"f": (0.02).hex()}
    assert items["step"] == {"i": 7}

    with Client("j", socket=sock) as client:
        back = client.load(5)
        assert_same(saved, back, exact_dicts=False)
        assert list(back["optim"]["state"]) == list(range(5))  # int keys, as the optimizer has them
        assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.999) and back["step"] == 7
        model2, opt2 = plain_model(3)
        into = {"model": model2.state_dict(), "optim": opt2.state_dict()}
        client.load(5, into=into)  # tensors matched by fqn, filled in place
    assert_same(saved["model"], model2.state_dict(), exact_dicts=False)


def test_default_planners_work_and_pickles_stay_marked(daemon: Any, sock: str) -> None:
    """DCP's own planners round-trip; a value only pickle can hold is stored as marked torch.save bytes,
    which ckptstage's LoadPlanner refuses (naming the key) instead of unpickling."""
    model, opt = plain_model(1)
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "frac": fractions.Fraction(1, 3)}
    saved = detached(sd)
    with pytest.raises(_FAILED, match="frac"):
        dcp.save(sd, storage_writer=Writer("j", 1, socket=sock), planner=SavePlanner())
    dcp.save(sd, storage_writer=Writer("j", 2, socket=sock), planner=DefaultSavePlanner())

    (manifest,) = part_manifests(daemon, "j", 2)
    items = dict((k["s"], v) for k, v in manifest["tree"]["d"])
    group = dict((k["s"], v) for k, v in dict((k["s"], v) for k, v in items["optim"]["d"])["param_groups"]["l"][0]["d"])
    assert group["lr"] == {"f": (0.02).hex()}  # a value, not a pickle
    assert items["frac"]["d"][0][0] == {"s": values.TORCH_SAVE_KEY}

    model2, opt2 = plain_model(2)
    into = {"model": model2.state_dict(), "optim": opt2.state_dict(), "frac": None}
    dcp.load(into, storage_reader=Reader("j", 2, socket=sock), planner=DefaultLoadPlanner())
    assert_same(saved, into, exact_dicts=False)

    with pytest.raises(_FAILED, match="frac.*never unpickles"):
        dcp.load({"frac": None}, storage_reader=Reader("j", 2, socket=sock), planner=LoadPlanner())
    with Client("j", socket=sock) as client:
        assert type(client.load(2)["frac"][values.TORCH_SAVE_KEY]) is bytes


class RecordingLoadPlanner(LoadPlanner):
    """ckptstage's LoadPlanner, recording what it is handed (a seam this test owns)."""

    def __init__(self) -> None:
        super().__init__()
        self.got_bytes: list[bytes] = []
        self.got_values: dict[str, Any] = {}

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        self.got_bytes.append(value.getvalue())
        super().load_bytes(read_item, value)

    def load_value(self, read_item: Any, value: Any) -> None:
        self.got_values[read_item.dest_index.fqn] = value
        super().load_value(read_item, value)


def test_loading_never_unpickles_with_ckptstage_planners(daemon: Any, sock: str) -> None:
    model, opt = plain_model(1)
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "meta": {"tag": "a", "n": [1, 2]}}
    dcp.save(sd, storage_writer=Writer("j", 3, socket=sock), planner=SavePlanner())
    # What is stored: tensors in the safetensors file, every value a JSON tree node (no bytes node at all).
    (manifest,) = part_manifests(daemon, "j", 3)
    assert "y" not in tree_tags(manifest["tree"]) and "T" not in tree_tags(manifest["tree"])
    seen: list[str] = []

    def hook(event: str, args: Any) -> None:
        if event == "pickle.find_class":
            seen.append(str(args))

    sys.addaudithook(hook)
    model2, opt2 = plain_model(2)
    into = {"model": model2.state_dict(), "optim": opt2.state_dict(), "meta": {"tag": "", "n": []}}
    planner = RecordingLoadPlanner()
    dcp.load(into, storage_reader=Reader("j", 3, socket=sock), planner=planner)
    assert into["meta"] == {"tag": "a", "n": [1, 2]}
    assert planner.got_values["meta.n"] == [1, 2] and planner.got_values["optim.param_groups.0.lr"] == 0.02
    assert all(raw.startswith(values.MAGIC) for raw in planner.got_bytes)
    assert seen == []
    # The check can fail: DCP's default planner unpickles what it is handed.
    dcp.save({"frac": fractions.Fraction(1, 3)}, storage_writer=Writer("j", 4, socket=sock))
    dcp.load({"frac": None}, storage_reader=Reader("j", 4, socket=sock), planner=DefaultLoadPlanner())
    assert any("Fraction" in s for s in seen)


def test_reader_picks_newest_complete_step(sock: str) -> None:
    for step in (20, 30):
        dcp.save({"w": torch.full((3,), float(step))}, storage_writer=Writer("j", step, socket=sock))
    # Step 40 of a 2-rank run with only rank 0's part: not complete, never chosen.
    with Client("j", socket=sock, rank=0, world_size=2, attempt="other") as client:
        client.save(40, {"w": torch.full((3,), 40.0)}).wait("local", timeout=60)
    into = {"w": torch.zeros(3)}
    reader = Reader("j", socket=sock)
    dcp.load(into, storage_reader=reader)
    assert reader.loaded_step == 30 and into["w"].tolist() == [30.0] * 3
    with pytest.raises(_FAILED, match="no complete step"):
        dcp.load({"w": torch.zeros(3)}, storage_reader=Reader("nothing-here", socket=sock))


def test_bad_key_and_shape_name_the_key(sock: str) -> None:
    dcp.save({"model": {"w": torch.ones(2, 3)}, "lr": 0.1}, storage_writer=Writer("j", 1, socket=sock))
    with pytest.raises(_FAILED, match=r"model\.extra"):
        dcp.load({"model": {"w": torch.zeros(2, 3), "extra": torch.zeros(1)}, "lr": 0.0},
                 storage_reader=Reader("j", 1, socket=sock), planner=LoadPlanner())
    with pytest.raises(_FAILED, match=r"model\.w"):
        dcp.load({"model": {"w": torch.zeros(3, 2)}, "lr": 0.0},
                 storage_reader=Reader("j", 1, socket=sock), planner=LoadPlanner())
    # The same checkpoint still loads.
    into: dict[str, Any] = {"model": {"w": torch.zeros(2, 3)}, "lr": 0.0}
    dcp.load(into, storage_reader=Reader("j", 1, socket=sock), planner=LoadPlanner())
    assert into["lr"] == 0.1 and into["model"]["w"].sum() == 6


def test_dtype_conversion_and_non_contiguous_targets(sock: str) -> None:
    w = torch.arange(24, dtype=torch.float32).view(4, 6)
    dcp.save({"w": w, "v": w.t()}, storage_writer=Writer("j", 1, socket=sock))
    into = {"w": torch.zeros(4, 6, dtype=torch.float64), "v": torch.zeros(4, 6).t()}
    dcp.load(into, storage_reader=Reader("j", 1, socket=sock))
    assert torch.equal(into["w"], w.double()) and torch.equal(into["v"], w.t())


def test_checkpoint_id_is_the_step(sock: str) -> None:
    dcp.save({"w": torch.ones(2)}, checkpoint_id=7, storage_writer=Writer("j", 0, socket=sock))
    into = {"w": torch.zeros(2)}
    dcp.load(into, checkpoint_id="7", storage_reader=Reader("j", socket=sock))
    assert into["w"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="step"):
        Writer("j", 0, socket=sock).reset("/some/path")


def test_async_save_single_process(sock: str) -> None:
    model, opt = plain_model(1)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    saved = detached(sd)
    writer = Writer("j", 9, socket=sock)
    fut = dcp.async_save(sd, storage_writer=writer, planner=SavePlanner())
    assert isinstance(fut, concurrent.futures.Future)  # not DCP's AsyncSaveResponse: stage() returned the state
    with torch.no_grad():  # the copy is done when async_save returns: training may go on
        for p in model.parameters():
            p.zero_()
    assert isinstance(fut.result(timeout=60), Metadata)
    into = {"model": Net(5).state_dict(), "optim": plain_model(5)[1].state_dict()}
    dcp.load(into, storage_reader=Reader("j", 9, socket=sock), planner=LoadPlanner())
    assert_same(saved["model"], into["model"], exact_dicts=False)


# --- real ranks ---------------------------------------------------------------------------


def rank_save(ctx: RankContext, job: str, step: int, how: str) -> dict[str, Any]:
    """Trains an FSDP2 model and saves it ``how``: "dcp", "async" (DCP), or "plain" (Client.save)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = fsdp_model(seed=1)
    train(model, opt, seed=ctx.rank, steps=2)
    msd, osd = get_state_dict(model, opt)
    sd: dict[str, Any] = {"model": msd, "optim": osd, "meta": {"step": step, "world": ctx.world_size}}
    full = full_state(model, opt)
    out: dict[str, Any] = {"full": full if ctx.rank == 0 else None}
    if how == "dcp":
        md = dcp.save(sd, storage_writer=Writer(job, step), planner=SavePlanner())
        out["keys"] = sorted(md.state_dict_metadata)
    elif how == "async":
        created: list[str] = []

        def hook(event: str, args: Any) -> None:
            if event == "open" and (args[1] and any(c in str(args[1]) for c in "wxa+")
                                    or (isinstance(args[2], int) and args[2] & (os.O_CREAT | os.O_TRUNC))):
                created.append(str(args[0]))
            elif event in ("os.mkdir", "os.rename", "os.symlink", "os.link", "shutil.copyfile"):
                created.append(f"{event} {args[:2]}")

        sys.addaudithook(hook)
        writer = Writer(job, step)
        fut = dcp.async_save(sd, storage_writer=writer, planner=SavePlanner())
        assert isinstance(fut, concurrent.futures.Future)
        with torch.no_grad():  # staged: the saved bytes no longer depend on these tensors
            for p in model.parameters():
                p.to_local().zero_()  # type: ignore[attr-defined]
        md = fut.result(timeout=120)
        out["result"] = type(md).__name__
        out["keys"] = sorted(md.state_dict_metadata)
        out["created"] = list(created)
        probe = os.path.join(ctx.workdir, f"probe-{ctx.rank}")
        with open(probe, "w"):
            pass
        out["hook_sees_files"] = probe in created  # the check above could have failed
    else:
        with Client(job) as client:
            client.save(step, sd).wait("local", timeout=60)
            client.wait_step(step, "local", timeout=60)
    return out


def rank_load(ctx: RankContext, job: str, step: int | None, how: str) -> dict[str, Any]:
    """Loads into a fresh FSDP2 model ``how``: "dcp" (Reader), "client" (Client.load into=)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = fsdp_model(seed=7)
    msd, osd = get_state_dict(model, opt)
    sd: dict[str, Any] = {"model": msd, "optim": osd, "meta": {"step": -1, "world": -1}}
    loaded = None
    if how == "dcp":
        reader = Reader(job, step)
        dcp.load(sd, storage_reader=reader, planner=LoadPlanner())
        loaded = reader.loaded_step
    else:
        with Client(job) as client:
            sd = client.load(step, into=sd)  # the nested state: DTensors filled in place, values as saved
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full = full_state(model, opt)
    return {"full": full if ctx.rank == 0 else None, "meta": sd["meta"], "loaded": loaded}


@pytest.mark.slow
def test_fsdp2_dcp_save_reload_same_and_other_world_size(daemon: Any) -> None:
    sock = str(daemon.socket)
    saved = run_ranks(rank_save, 2, sock, args=("fsdp", 50, "dcp"))
    assert "model.fc2.weight" in saved[0]["keys"] and "optim.param_groups.0.lr" in saved[0]["keys"]
    for world in (2, 1):
        got = run_ranks(rank_load, world, sock, args=("fsdp", None, "dcp"))
        assert got[0]["loaded"] == 50
        assert got[0]["meta"] == {"step": 50, "world": 2}
        assert_same(saved[0]["full"], got[0]["full"], exact_dicts=False)
    # and the plain API reads the DCP-saved step into DTensors
    got = run_ranks(rank_load, 2, sock, args=("fsdp", 50, "client"))
    assert_same(saved[0]["full"], got[0]["full"], exact_dicts=False)


@pytest.mark.slow
def test_fsdp2_async_save_copies_once_and_writes_no_file(daemon: Any) -> None:
    sock = str(daemon.socket)
    saved = run_ranks(rank_save, 2, sock, args=("fsdp-async", 60, "async"))
    for r in saved:
        assert r["result"] == "Metadata" and "model.fc1.weight" in r["keys"]
        assert r["created"] == [] and r["hook_sees_files"]
    got = run_ranks(rank_load, 2, sock, args=("fsdp-async", 60, "dcp"))
    assert_same(saved[0]["full"], got[0]["full"], exact_dicts=False)  # not the zeros written after staging


@pytest.mark.slow
def test_fsdp2_plain_api_save_loads_through_reader(daemon: Any) -> None:
    sock = str(daemon.socket)
    saved = run_ranks(rank_save, 2, sock, args=("fsdp-plain", 70, "plain"))
    for world in (2, 1):
        got = run_ranks(rank_load, world, sock, args=("fsdp-plain", 70, "dcp"))
        assert_same(saved[0]["full"], got[0]["full"], exact_dicts=False)
        assert got[0]["meta"] == {"step": 70, "world": 2}



@pytest.mark.slow
def test_two_nodes_save_completes_on_the_shared_tier(daemon_factory: Any, tmp_path: Any) -> None:
    """Ranks on two daemons (two nodes, one shared tier): dcp.save returns once the step is complete
    there, and a fresh node that never saw the job loads it through the Reader."""
    shared = tmp_path / "shared-tier"
    a = daemon_factory("a", **{"shared.dir": str(shared)}).start()
    b = daemon_factory("b", **{"shared.dir": str(shared)}).start()
    saved = run_ranks(rank_save, 2, [str(a.socket), str(b.socket)], args=("two-nodes", 80, "dcp"))
    assert (shared / "two-nodes" / layout.step_dirname(80) / layout.COMMIT_FILE).is_file()  # before save returned
    fresh = daemon_factory("c", **{"shared.dir": str(shared)}).start()
    got = run_ranks(rank_load, 1, str(fresh.socket), args=("two-nodes", None, "dcp"))
    assert got[0]["loaded"] == 80
    assert_same(saved[0]["full"], got[0]["full"], exact_dicts=False)


def test_writer_refuses_the_process_executor(sock: str) -> None:
    import pickle

    with pytest.raises(TypeError, match="thread executor"):
        pickle.dumps(Writer("j", 1, socket=sock))


def test_empty_and_scalar_states(sock: str) -> None:
    dcp.save({}, storage_writer=Writer("j", 1, socket=sock))
    dcp.load({}, storage_reader=Reader("j", 1, socket=sock))
    sd = {"zero_d": torch.tensor(3.5), "empty": torch.zeros(0, 4), "flag": True}
    dcp.save(sd, storage_writer=Writer("j", 2, socket=sock), planner=SavePlanner())
    into = {"zero_d": torch.tensor(0.0), "empty": torch.ones(0, 4), "flag": False}
    dcp.load(into, storage_reader=Reader("j", 2, socket=sock), planner=LoadPlanner())
    assert_same(sd, into, exact_dicts=False)


def test_consolidate_reads_a_dcp_step(sock: str, tmp_path: Any) -> None:
    from safetensors.torch import load_file

    from ckptstage.client.consolidate import consolidate

    model, _ = plain_model(1)
    dcp.save({"model": model.state_dict(), "step": 3}, storage_writer=Writer("j", 1, socket=sock),
             planner=SavePlanner())
    consolidate("j", 1, out=tmp_path / "hf", prefix="model.", socket=sock)
    assert_same(detached(model.state_dict()), load_file(tmp_path / "hf" / "model.safetensors"), exact_dicts=False)
