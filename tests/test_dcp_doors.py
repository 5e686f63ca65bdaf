"""One format, two doors: a step saved through either API loads through the other, nested as it was saved.

A step saved with ``dcp.save(..., storage_writer=Writer(...))`` holds the
state's own nesting, so ``Client.load(step, into=nested)`` returns
``{"model": ..., "optim": ...}``; a step saved with ``Client.save`` loads
through ``dcp.load(..., storage_reader=Reader(...))``; and the reader's
``Metadata.planner_data`` is what DCP's ``DefaultSavePlanner`` records, so
PyTorch's own tools that rebuild a state from the metadata alone
(``dcp_to_torch_save``, ``_load_state_dict_from_keys``) return the nested
state they return from DCP's ``FileSystemWriter`` storage. Steps the writer
stored flat (DCP keys at the top of the tree, before it nested) still load
through both doors. Real daemon, real gloo ranks for the world-size changes,
tiny models.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, _load_state_dict_from_keys
from support import assert_same

from ckptstage.client import Client
from ckptstage.dcp import LoadPlanner, Reader, SavePlanner, Writer
from ckptstage.dcp.writer import nest
from dist_harness import RankContext, detached, full_state, run_ranks
from test_dcp import Net, fsdp_model, part_manifests, plain_model, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns when no process group exists


class FlatWriter(Writer):
    """The writer as it was before it nested: the plan's paths dropped, so every DCP key stays at the top
    of the tree (how the steps already on users' disks look). A seam this test owns."""

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        super().prepare_local_plan(dataclasses.replace(plan, planner_data={}))
        return plan


def saved_through(how: str, sock: str, job: str, step: int, state: dict[str, Any]) -> None:
    """Saves ``state`` as ``step`` of ``job`` through one door: DCP with DCP's default planner, with
    ckptstage's planner, the old flat writer, or Client.save."""
    if how == "client":
        with Client(job, socket=sock) as client:
            client.save(step, state).wait("local", timeout=60)
            client.wait_step(step, "local", timeout=60)  # every rank's part (collective with a process group)
        return
    writer = (FlatWriter if how == "flat" else Writer)(job, step, socket=sock)
    dcp.save(state, storage_writer=writer, planner=SavePlanner() if how == "ckptstage" else DefaultSavePlanner())


def to_torch_save(reader: Any, out: Path) -> Any:
    """What ``dcp_to_torch_save`` does (it opens a FileSystemReader itself): the state rebuilt from the
    metadata alone by DCP's _EmptyStateDictLoadPlanner, written with torch.save and read back."""
    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    torch.save(sd, out)
    return torch.load(out)


@pytest.fixture
def sock(daemon: Any) -> str:
    return str(daemon.socket)


def training_state(seed: int = 1) -> dict[str, Any]:
    model, opt = plain_model(seed)
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}


# --- the metadata PyTorch's tools rely on ------------------------------------------------------


@pytest.mark.parametrize("how", ["default", "ckptstage", "client"])
def test_metadata_is_what_dcp_records_for_the_same_state(sock: str, tmp_path: Path, how: str) -> None:
    state = training_state()
    md = dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "fs"))
    saved_through(how, sock, "j", 1, state)
    reader = Reader("j", 1, socket=sock)
    try:
        ours = reader.read_metadata()
    finally:
        reader.close()
    assert ours.planner_data == md.planner_data
    assert ours.planner_data["optim.state.0.exp_avg"] == ("optim", "state", "0", "exp_avg")  # DCP's own form
    assert sorted(ours.state_dict_metadata) == sorted(md.state_dict_metadata)
    for key, meta in md.state_dict_metadata.items():
        assert type(ours.state_dict_metadata[key]) is type(meta), key


@pytest.mark.parametrize("how", ["default", "ckptstage", "client"])
def test_dcp_to_torch_save_returns_the_nested_state(sock: str, tmp_path: Path, how: str) -> None:
    """PyTorch's test_dcp_to_torch_save scenario (a Module saved under "model", converted to a torch.save
    file) on ckptstage's storage: the same nested dict as from DCP's file-system storage."""
    model = Net(0)
    (tmp_path / "fs").mkdir()
    dcp.save({"model": model}, checkpoint_id=tmp_path / "fs")
    dcp_to_torch_save(tmp_path / "fs", tmp_path / "fs.pt")
    theirs = torch.load(tmp_path / "fs.pt")

    saved_through(how, sock, "j", 1, {"model": model} if how != "client" else {"model": model.state_dict()})
    ours = to_torch_save(Reader("j", 1, socket=sock), tmp_path / "ours.pt")
    assert list(ours) == ["model"]
    assert_same(detached(model.state_dict()), ours["model"], exact_dicts=False)
    assert_same(theirs, ours, exact_dicts=False)


@pytest.mark.parametrize("how", ["default", "ckptstage", "client"])
def test_load_state_dict_from_keys_returns_the_model(sock: str, tmp_path: Path, how: str) -> None:
    state = training_state()
    saved = detached(state)
    saved_through(how, sock, "j", 1, state)
    got = _load_state_dict_from_keys({"model"}, storage_reader=Reader("j", 1, socket=sock))
    assert list(got) == ["model"]
    assert_same(saved["model"], got["model"], exact_dicts=False)
    # The same call on DCP's own storage of the state gives the same answer.
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "fs"))
    assert_same(_load_state_dict_from_keys({"model"}, storage_reader=FileSystemReader(tmp_path / "fs")), got,
                exact_dicts=False)
    lr = _load_state_dict_from_keys({"optim.param_groups"}, storage_reader=Reader("j", 1, socket=sock))
    assert lr["optim"]["param_groups"][0]["lr"] == 0.02


# --- door 1: Client.load of a DCP-saved step ---------------------------------------------------


@pytest.mark.parametrize("how", ["default", "ckptstage", "flat"])
def test_client_load_into_the_trainers_nested_state(sock: str, how: str) -> None:
    """``Client.load(step, into={"model": ..., "optim": ...})`` on a DCP-saved step: the nested state
    back, the model's tensors filled in place, the optimizer's state under its int keys (DCP's default
    planner stores them as the strings it made; a flat step has none of the nesting)."""
    state = training_state()
    saved = detached(state)
    saved_through(how, sock, "j", 1, state)
    model2, opt2 = plain_model(5)
    into = {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0}
    with Client("j", socket=sock) as client:
        got = client.load(1, into=into)
    assert sorted(got) == ["model", "optim", "step"] and got["step"] == 3
    assert list(got["optim"]["state"]) == list(range(5))
    assert_same(saved, got, exact_dicts=False)
    assert_same(saved["model"], model2.state_dict(), exact_dicts=False)  # filled in place
    opt2.load_state_dict(got["optim"])
    assert_same(saved["optim"], opt2.state_dict(), exact_dicts=False)


def test_writer_keeps_the_states_containers_and_key_types(daemon: Any, sock: str) -> None:
    """With ckptstage's planner the stored tree is the one Client.save stores (D nodes for tensors aside):
    an OrderedDict, int keys, an empty dict and an empty list survive a reload without ``into``."""
    model, opt = plain_model(1)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "empty": {}, "none": [], "nested": [{"a": 1}]}
    saved = detached(state)
    saved_through("ckptstage", sock, "j", 1, state)
    with Client("j", socket=sock) as client:
        assert_same(saved, client.load(1), exact_dicts=False)
        back = client.load(1)
    assert type(back["model"]) is OrderedDict and list(back["optim"]["state"]) == list(range(5))
    assert back["empty"] == {} and back["none"] == [] and back["nested"] == [{"a": 1}]


def test_async_save_stores_the_nested_tree_too(sock: str) -> None:
    """async_save stages through the writer (its own planner, the state at hand): the same nested tree."""
    state = training_state()
    saved = detached(state)
    dcp.async_save(state, storage_writer=Writer("j", 1, socket=sock), planner=SavePlanner()).result(timeout=60)
    with Client("j", socket=sock) as client:
        back = client.load(1)
    assert_same(saved, back, exact_dicts=False)
    assert type(back["model"]) is OrderedDict and list(back["optim"]["state"]) == list(range(5))


@pytest.mark.parametrize("paths, message", [
    ({"a": ("a",), "a.b": ("a", "b")}, r"'a\.b'.*runs through the value of another key, 'a'"),
    ({"a": ("x",), "a.b": ("x",)}, r"'a\.b'.*same path"),
    ({"a": (), "a.b": ("a", "b")}, r"'a'.*empty path"),
])
def test_paths_that_do_not_nest_name_the_key(paths: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        nest({"a": {"i": 1}, "a.b": {"i": 2}}, paths)



def test_a_state_its_paths_do_not_describe_names_the_key() -> None:
    nodes = {"a": {"i": 1}, "a.b": {"i": 2}}
    with pytest.raises(ValueError, match=r"'a\.b' of the plan is not where"):
        nest(nodes, {"a": ("a",), "a.b": ("z",)}, {"a": 1})
    with pytest.raises(ValueError, match=r"'c\.d': the state holds a value there that the planner made no"):
        nest(nodes, {"a": ("a",), "a.b": ("c", "e")}, {"a": 1, "c": {"d": 2, "e": 3}})


# --- door 2: dcp.load of a Client.save step, and the old flat steps -----------------------------


@pytest.mark.parametrize("how", ["client", "flat"])
def test_dcp_load_reads_plain_and_flat_steps(sock: str, how: str) -> None:
    state = training_state()
    saved = detached(state)
    saved_through(how, sock, "j", 1, state)
    into = training_state(seed=4)
    into["step"] = 0
    dcp.load(into, storage_reader=Reader("j", 1, socket=sock), planner=LoadPlanner())
    assert_same(saved, into, exact_dicts=False)


def test_a_flat_step_is_what_the_old_writer_stored(daemon: Any, sock: str) -> None:
    """The FlatWriter above really writes the old form, and without ``into`` it loads as it always did."""
    saved = detached(training_state())
    saved_through("flat", sock, "j", 1, training_state())
    (manifest,) = part_manifests(daemon, "j", 1)
    top = [k["s"] for k, _ in manifest["tree"]["d"]]
    assert "model.fc1.weight" in top and "optim.param_groups.0.lr" in top and "model" not in top
    with Client("j", socket=sock) as client:
        flat = client.load(1)
    assert_same(saved["model"]["fc1.weight"], flat["model.fc1.weight"])


def test_a_value_in_the_way_is_an_error_naming_the_key(sock: str) -> None:
    """A checkpoint holding a value where the state loaded into has a dict: the error names the key."""
    with Client("j", socket=sock) as client:
        client.save(1, {"model": 5, "model.w": torch.ones(2)}).wait("local", timeout=60)
        with pytest.raises(ValueError, match=r"'model\.w'"):
            client.load(1, into={"model": {"w": torch.zeros(2)}})


# --- real ranks: another world size -------------------------------------------------------------


def rank_save(ctx: RankContext, job: str, step: int, how: str) -> dict[str, Any]:
    """FSDP2 model and optimizer saved through ``how`` (see saved_through); rank 0 returns the full state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = fsdp_model(seed=1)
    train(model, opt, seed=ctx.rank, steps=2)
    msd, osd = get_state_dict(model, opt)
    saved_through(how, ctx.socket, job, step, {"model": msd, "optim": osd, "meta": {"world": ctx.world_size}})
    full = full_state(model, opt)
    return {"full": full if ctx.rank == 0 else None}


def rank_load(ctx: RankContext, job: str, step: int, door: str) -> dict[str, Any]:
    """A fresh FSDP2 model loaded through ``door``: "client" (Client.load into the nested state, whose
    answer is used as the trainer would use it) or "dcp" (dcp.load with the Reader)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = fsdp_model(seed=7)
    msd, osd = get_state_dict(model, opt)
    sd: dict[str, Any] = {"model": msd, "optim": osd, "meta": {"world": -1}}
    if door == "client":
        with Client(job) as client:
            sd = client.load(step, into=sd)
    else:
        dcp.load(sd, storage_reader=Reader(job, step), planner=LoadPlanner())
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    full = full_state(model, opt)
    return {"full": full if ctx.rank == 0 else None, "meta": sd["meta"]}


def rank_load_both(ctx: RankContext, job: str, step: int) -> dict[str, dict[str, Any]]:
    """:func:`rank_load` through each door in turn, each into a fresh model."""
    return {door: rank_load(ctx, job, step, door) for door in ("client", "dcp")}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["default", "flat"])
def test_dcp_step_loads_into_the_nested_state_at_any_world_size(daemon: Any, how: str) -> None:
    """Saved through DCP by 2 ranks (nested, or the old flat form); Client.load(into=) and dcp.load at 2
    ranks and at 1 give back the same full model and optimizer."""
    sock = str(daemon.socket)
    saved = run_ranks(rank_save, 2, sock, args=(how, 10, how))
    for world in (2, 1):
        both = run_ranks(rank_load_both, world, sock, args=(how, 10))  # one set of processes, both doors
        for door, got in both[0].items():
            assert got["meta"] == {"world": 2}, (world, door)
            assert_same(saved[0]["full"], got["full"], exact_dicts=False)


@pytest.mark.slow
def test_client_save_step_loads_through_the_reader_at_another_world_size(daemon: Any) -> None:
    sock = str(daemon.socket)
    saved = run_ranks(rank_save, 2, sock, args=("plain", 20, "client"))
    got = run_ranks(rank_load, 1, sock, args=("plain", 20, "dcp"))
    assert got[0]["meta"] == {"world": 2}
    assert_same(saved[0]["full"], got[0]["full"], exact_dicts=False)
