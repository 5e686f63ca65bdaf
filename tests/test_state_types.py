"""The state people hold beyond tensors: numpy, RNG states, paths, enums, dataclasses, namedtuples, dict
subclasses, Namespace, torch dtype/device, datetimes, sets — saved through a real daemon and loaded back as
the same types, with no pickle and no import of anything a manifest names."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import enum
import json
import pathlib
import random
import subprocess
import sys
import textwrap
import typing
import zoneinfo
from collections import Counter, OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from ckptstage.client import Client
from ckptstage.client import consolidate as co
from ckptstage.client import tree
from ckptstage.client.tree import Unresolved, UnresolvedEnum
from ckptstage.protos import layout
from safetensors.torch import load_file

# --- classes a trainer's state might hold (module level: importable, so they load back as themselves) ---


class Color(enum.Enum):
    RED = 1
    GREEN = "g"


class Perm(enum.Flag):
    R = 1
    W = 2
    X = 4


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mode(enum.StrEnum):
    TRAIN = "train"
    EVAL = "eval"


@dataclasses.dataclass
class Schedule:
    warmup: int
    peak: float
    mode: Mode = Mode.TRAIN


@dataclasses.dataclass
class Holder:
    """A dataclass holding a tensor, a nested dataclass and a field set only after __init__."""

    weight: torch.Tensor
    schedule: Schedule
    tags: set[str] = dataclasses.field(default_factory=set)
    derived: int = dataclasses.field(init=False, default=0)


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    x: int
    y: tuple[int, ...]


class Point(typing.NamedTuple):
    x: int
    y: torch.Tensor
    label: str = "p"


class AttrDict(dict):  # type: ignore[type-arg]
    """A dict subclass of the kind configs use (attribute access to items)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError as e:
            raise AttributeError(key) from e


INIT_CALLS: list[str] = []


@dataclasses.dataclass
class Loud:
    """Its __post_init__ has a side effect: loading must not run it."""

    n: int

    def __post_init__(self) -> None:
        INIT_CALLS.append("post_init")


class Opaque:
    pass


# --- comparison -------------------------------------------------------------------------------


def same(a: Any, b: Any, path: str = "state") -> None:
    """Same types all the way down, same values, tensors and arrays bit for bit."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert a.contiguous().view(-1).view(torch.uint8).tolist() == b.contiguous().view(-1).view(torch.uint8).tolist()
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.random.Generator):
        same(a.bit_generator, b.bit_generator, f"{path}.bit_generator")
    elif isinstance(a, np.random.BitGenerator):
        same(a.state, b.state, f"{path}.state")
        sa, sb = a.seed_seq, b.seed_seq  # what spawn() continues from
        assert (sa.entropy, sa.spawn_key, sa.pool_size, sa.n_children_spawned) == \
               (sb.entropy, sb.spawn_key, sb.pool_size, sb.n_children_spawned), path
    elif isinstance(a, np.random.RandomState):
        same(a.get_state(legacy=False), b.get_state(legacy=False), f"{path}.state")
    elif isinstance(a, random.Random):
        same(a.getstate(), b.getstate(), f"{path}.state")
    elif isinstance(a, float):
        assert a.hex() == b.hex(), path
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], path
        for k in a:
            same(a[k], b[k], f"{path}[{k!r}]")
        if isinstance(a, defaultdict):
            assert a.default_factory is b.default_factory, path
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, argparse.Namespace):
        same(vars(a), vars(b), f"{path}.__dict__")
    elif isinstance(a, (datetime.datetime, datetime.time)):
        assert a == b and a.fold == b.fold and a.tzinfo == b.tzinfo and type(a.tzinfo) is type(b.tzinfo), path
        assert a.tzname() == b.tzname() if isinstance(a, datetime.datetime) else True, path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"
        if isinstance(a, (set, frozenset)):
            assert sorted(map(repr, a)) == sorted(map(repr, b)), path


def roundtrip(state: Any) -> Any:
    """flatten -> JSON text -> unflatten, tensors handed back as copies (as a load makes them)."""
    flat = tree.flatten_state(state)
    text = json.dumps(flat.tree)
    copies = [t.detach().clone() for t in flat.tensors]
    return tree.unflatten(json.loads(text), copies.__getitem__)


# --- the values, one case per type --------------------------------------------------------------


def cases() -> dict[str, Any]:
    gen = np.random.default_rng(1234)
    gen.random(3)  # not at its seed state
    legacy = np.random.RandomState(7)
    legacy.standard_normal()  # a cached gaussian in the state
    pyr = random.Random(5)
    pyr.random()
    return {
        "array_small": np.arange(12, dtype=np.float32).reshape(3, 4),
        "array_large": np.arange(3000, dtype=np.int64).reshape(30, 100),  # 24 KB: a tensor of the tensor list
        "array_fortran": np.asfortranarray(np.linspace(0, 1, 1200).reshape(40, 30)),
        "array_reversed": np.arange(2000, dtype=np.float64)[::-1],
        "array_readonly": np.frombuffer(bytes(range(256)) * 20, dtype=np.uint8).reshape(20, 256),
        "array_big_endian": np.arange(1500, dtype=">i4"),
        "array_dtypes": [np.array([True, False]), np.arange(4, dtype=np.uint16), np.arange(3, dtype=np.uint64),
                         np.array([1 + 2j], dtype=np.complex128), np.array([0.1], dtype=np.float16),
                         np.arange(700, dtype=np.uint32), np.zeros((0, 3)), np.array(3.5),
                         np.arange(600).astype("datetime64[s]"), np.array([5], dtype="timedelta64[ms]")],
        "scalars": [np.float32(1.5), np.float64(0.1), np.int8(-3), np.uint64(2**64 - 1), np.bool_(True),
                    np.complex64(1 - 2j), np.float16(0.1), np.datetime64("2024-01-02T03:04:05")],
        "np_global_state": np.random.get_state(),
        "np_dict_state": np.random.get_state(legacy=False),
        "np_generator": gen,
        "np_generators": [np.random.Generator(np.random.Philox(3)), np.random.Generator(np.random.SFC64(4)),
                          np.random.Generator(np.random.MT19937(5)), np.random.Generator(np.random.PCG64DXSM(6))],
        "np_random_state": legacy,
        "np_bit_generator": np.random.PCG64(99),
        "py_random_state": random.getstate(),
        "py_random": pyr,
        "paths": [pathlib.Path("/data/run-3"), pathlib.PurePosixPath("rel/x.bin"),
                  pathlib.PureWindowsPath(r"C:\runs\x"), pathlib.PosixPath("/tmp")],
        "enums": [Color.RED, Color.GREEN, Perm.R | Perm.X, Perm(0), Level.HIGH, Mode.EVAL],
        "enum_and_dtype_keys": {Color.GREEN: 1, Level.LOW: "low", Mode.TRAIN: [1], torch.bfloat16: 0.5},
        "dataclass": Schedule(100, 3e-4),
        "frozen_slots": Frozen(1, (2, 3)),
        "namedtuple": Point(1, torch.arange(3)),
        "namespace": argparse.Namespace(lr=1e-3, name="run", layers=[1, 2], out=pathlib.Path("/o")),
        "dict_subclasses": [AttrDict(a=1, b={"c": 2}), Counter("abca"), defaultdict(list, {"k": [1]}),
                            defaultdict(None)],
        "torch_meta": [torch.float8_e4m3fn, torch.int64, torch.device("cpu"), torch.device("cuda", 3),
                       torch.Size([2, 3])],
        "datetimes": [datetime.datetime(2024, 5, 1, 12, 30, 1, 250),
                      datetime.datetime(2024, 5, 1, tzinfo=datetime.timezone.utc),
                      datetime.datetime(2024, 5, 1, tzinfo=datetime.timezone(datetime.timedelta(hours=-3), "BRT")),
                      datetime.datetime(2024, 11, 3, 1, 30, fold=1, tzinfo=zoneinfo.ZoneInfo("America/New_York")),
                      datetime.date(2020, 2, 29), datetime.time(23, 59, 59, 999999),
                      datetime.time(1, 2, tzinfo=datetime.timezone(datetime.timedelta(minutes=330))),
                      datetime.timedelta(days=-2, seconds=7, microseconds=11)],
        "sets": [{1, "a", (2, 3.5), None}, frozenset({b"x", Color.RED}), frozenset({frozenset({1})}), set()],
    }


@pytest.mark.parametrize("name", list(cases()))
def test_each_type_round_trips_through_the_tree(name: str) -> None:
    value = cases()[name]
    same(value, roundtrip({"v": value})["v"])


def test_nested_state_round_trips_with_tensors_in_the_tensor_list() -> None:
    state = {"runs": [{"holder": Holder(torch.ones(2, 2), Schedule(5, 0.1), {"a"}), "p": Point(2, torch.zeros(1))}],
             "ns": argparse.Namespace(w=torch.arange(4.0))}
    state["runs"][0]["holder"].derived = 9
    flat = tree.flatten_state(state)
    assert flat.fqns == ["runs.0.holder.weight", "runs.0.p.y", "ns.w"]  # fields join the fqn by name
    assert flat.paths[0] == "state['runs'][0]['holder'].weight"
    same(state, roundtrip(state))


def test_numpy_arrays_inline_up_to_4_kib_and_as_tensors_beyond() -> None:
    small, large = np.zeros(1024, np.float32), np.zeros(1025, np.float32)
    flat = tree.flatten_state({"small": small, "large": large, "rng": np.random.get_state()})
    assert flat.fqns == ["large"]
    assert flat.tensors[0].data_ptr() == large.ctypes.data  # the array's own memory: copied by the snapshot
    items = {k["s"]: v for k, v in flat.tree["d"]}
    assert set(items["small"]) == {"a"} and set(items["large"]) == {"A"}
    assert {next(iter(n)) for n in items["rng"]["t"]} == {"s", "a", "i", "f"}  # the RNG key is inline
    assert tree.flatten_state({"large": large}, inline_arrays=True).tensors == []


def test_python_and_numpy_rng_states_continue_the_same_sequence() -> None:
    random.seed(3)
    np.random.seed(3)
    gen = np.random.default_rng(3)
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "gen": gen}
    back = roundtrip(state)
    want = (random.random(), np.random.random(), gen.random())
    random.setstate(back["python"])
    np.random.set_state(back["numpy"])
    assert (random.random(), np.random.random(), back["gen"].random()) == want
    assert [g.random() for g in back["gen"].spawn(2)] == [g.random() for g in gen.spawn(2)]  # its SeedSequence too


# --- through a real daemon ---------------------------------------------------------------------


def test_every_type_saves_and_loads_through_the_daemon(daemon: Any) -> None:
    hf_rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    state = {**cases(), "hf_rng": hf_rng,
             "nested": [{"holder": Holder(torch.randn(3, 2), Schedule(1, 2.0, Mode.EVAL), {"x"})}],
             "model": OrderedDict(w=torch.randn(4, 4))}
    with Client("types", socket=daemon.socket) as c:
        c.save(1, state).wait("local", timeout=30)
        back = c.load(1)
        same(state, back)
        # The HF Trainer's RNG restore works on what comes back.
        random.setstate(back["hf_rng"]["python"])
        np.random.set_state(back["hf_rng"]["numpy"])
        torch.random.set_rng_state(back["hf_rng"]["cpu"])
        drawn = (random.random(), np.random.random(), torch.rand(1).item())
        random.setstate(hf_rng["python"])
        np.random.set_state(hf_rng["numpy"])
        torch.random.set_rng_state(hf_rng["cpu"])
        assert drawn == (random.random(), np.random.random(), torch.rand(1).item())

        # load(into=...): tensors inside dataclasses and large numpy arrays are filled in place.
        into = {**cases(), "hf_rng": {"python": None, "numpy": None, "cpu": torch.zeros_like(hf_rng["cpu"])},
                "nested": [{"holder": Holder(torch.zeros(3, 2), Schedule(0, 0.0), set())}],
                "model": OrderedDict(w=torch.zeros(4, 4))}
        into["array_large"] = np.zeros((30, 100), np.int64)
        filled = c.load(1, into=into)
        assert torch.equal(into["nested"][0]["holder"].weight, state["nested"][0]["holder"].weight)
        assert np.array_equal(into["array_large"], state["array_large"])  # the caller's array, in place
        assert np.shares_memory(filled["array_large"], into["array_large"])
        same(state, filled)


def test_a_saved_file_names_the_tensors_of_dataclasses_and_arrays_by_fqn(daemon: Any, tmp_path: Path) -> None:
    state = {"model": {"cfg": Holder(torch.randn(2, 3), Schedule(1, 1.0)), "table": np.arange(2048.0)},
             "when": datetime.datetime(2024, 1, 1), "keys": {Color.RED: torch.ones(2)}}
    with Client("fqn", socket=daemon.socket) as c:
        c.save(3, state).wait("local", timeout=30)
    co.consolidate("fqn", out=tmp_path / "out", socket=daemon.socket)
    got = load_file(tmp_path / "out" / co.WEIGHTS_NAME)
    assert sorted(got) == ["keys.RED", "model.cfg.weight", "model.table"]
    assert torch.equal(got["model.cfg.weight"], state["model"]["cfg"].weight)
    assert np.array_equal(got["model.table"].numpy(), state["model"]["table"])


def save_sharded_holder(ctx: Any, job: str) -> None:
    """A rank of a 2-rank group saving a dataclass that holds a DTensor, beside a tied tensor in a namedtuple."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    full = torch.arange(24.0).reshape(6, 4)
    tied = torch.ones(3)
    state = {"model": Holder(distribute_tensor(full, mesh, [Shard(0)]), Schedule(1, 1.0)),
             "same": tied, "pair": Point(1, tied), "opt": {Level.LOW: np.arange(1024.0)}}
    with Client(job, socket=ctx.socket) as c:
        c.save(2, state).wait("local", timeout=60)
        c.wait_step(2, "local", timeout=60)
        back = c.load(2, into={**state, "model": Holder(distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]),
                                                        Schedule(0, 0.0))})
    assert torch.equal(back["model"].weight.full_tensor(), full) and type(back["model"]) is Holder


def test_a_dtensor_inside_a_dataclass_is_found_by_fqn_across_ranks(daemon: Any, tmp_path: Path) -> None:
    harness = pytest.importorskip("dist_harness")
    harness.run_ranks(save_sharded_holder, 2, str(daemon.socket), args=("sharded",), timeout=120)
    with Client("sharded", socket=daemon.socket) as c:  # one process, another world size: whole tensors
        back = c.load(2)
    assert torch.equal(back["model"]["weight"], torch.arange(24.0).reshape(6, 4))
    # Saved by ranks that imported this file as "test_state_types", not as this process did: a named dict.
    assert type(back["model"]) is Unresolved and back["model"].cls == "test_state_types:Holder"
    done = co.consolidate("sharded", out=tmp_path / "out", socket=daemon.socket)
    got = load_file(tmp_path / "out" / co.WEIGHTS_NAME)
    assert sorted(got) == ["model.weight", "opt.LOW", "same"]
    assert torch.equal(got["model.weight"], torch.arange(24.0).reshape(6, 4))
    assert done.aliases == {"pair.y": "same"}  # the tied tensor inside the namedtuple, found by its fqn


def test_dcp_stores_the_new_types_as_values_and_loads_them_back(daemon: Any) -> None:
    import torch.distributed.checkpoint as dcp
    from ckptstage.dcp import LoadPlanner, Reader, SavePlanner, Writer

    extra = {"sched": Schedule(3, 0.5, Mode.EVAL), "when": datetime.date(2024, 2, 29), "out": pathlib.Path("/o"),
             "mode": Mode.TRAIN, "small": np.arange(10.0), "big": np.arange(5000.0), "tags": {"a", "b"},
             "rng": np.random.get_state(), "dtype": torch.bfloat16}
    sd = {"w": torch.randn(3, 2), "extra": extra}
    dcp.save(sd, storage_writer=Writer("dcp", 1, socket=daemon.socket), planner=SavePlanner())
    into = {"w": torch.zeros(3, 2), "extra": {k: None for k in extra}}
    dcp.load(into, storage_reader=Reader("dcp", 1, socket=daemon.socket), planner=LoadPlanner())
    same(sd, into)


# --- the class rule: nothing is imported, no __init__ runs, an unknown class is a named dict --------


def test_loading_never_runs_a_classes_init_or_post_init() -> None:
    state = {"loud": Loud(3), "holder": Holder(torch.ones(1), Schedule(1, 1.0))}
    INIT_CALLS.clear()
    flat = tree.flatten_state(state)
    INIT_CALLS.clear()
    back = tree.unflatten(json.loads(json.dumps(flat.tree)), flat.tensors.__getitem__)
    assert type(back["loud"]) is Loud and back["loud"].n == 3
    assert INIT_CALLS == []


def _renamed(node: Any, old: str, new: str) -> Any:
    return json.loads(json.dumps(node).replace(json.dumps(old), json.dumps(new)))


def test_a_module_named_in_a_manifest_is_never_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "ckptstage_evil_mod.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "import dataclasses\n@dataclasses.dataclass\nclass Schedule:\n    warmup: int\n    peak: float\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"{Schedule.__module__}:Schedule"
    nodes = _renamed(tree.flatten_state({"s": Schedule(1, 2.0), "c": Color.RED, "h": AttrDict(a=1)}).tree,
                     name, "ckptstage_evil_mod:Schedule")
    nodes = _renamed(_renamed(nodes, f"{Color.__module__}:Color", "ckptstage_evil_mod:Color"),
                     f"{AttrDict.__module__}:AttrDict", "ckptstage_evil_mod:AttrDict")
    back = tree.unflatten(nodes, lambda i: None)
    assert not marker.exists() and "ckptstage_evil_mod" not in sys.modules
    assert type(back["s"]) is Unresolved and back["s"] == {"warmup": 1, "peak": 2.0, "mode": Mode.TRAIN}
    assert (back["s"].cls, back["s"].kind) == ("ckptstage_evil_mod:Schedule", "dataclass")
    assert back["c"] == UnresolvedEnum("ckptstage_evil_mod:Color", "RED", 1)
    assert type(back["h"]) is Unresolved and back["h"].kind == "dict" and back["h"] == {"a": 1}


@pytest.mark.parametrize("target", ["os:system", "builtins:eval", "subprocess:Popen", "collections:OrderedDict",
                                    f"{__name__}:Opaque", f"{__name__}:INIT_CALLS", f"{__name__}:Color.RED",
                                    f"{__name__}:<locals>.X", "os.path:join"])
def test_a_manifest_naming_something_that_is_not_a_dataclass_gets_a_dict(target: str) -> None:
    node = _renamed(tree.flatten_state(Schedule(1, 2.0)).tree, f"{__name__}:Schedule", target)
    back = tree.unflatten(node, lambda i: None)
    assert type(back) is Unresolved and back.cls == target and back == {"warmup": 1, "peak": 2.0, "mode": Mode.TRAIN}


def test_an_unresolved_value_saves_again_as_its_class(daemon: Any) -> None:
    state = {"s": Schedule(4, 0.5), "k": {Color.GREEN: Point(1, torch.ones(1))}}
    nodes = _renamed(_renamed(tree.flatten_state(state).tree, f"{__name__}:Schedule", "absent_mod:Schedule"),
                     f"{__name__}:Color", "absent_mod:Color")
    loaded = tree.unflatten(nodes, lambda i: torch.ones(1))
    assert type(loaded["s"]) is Unresolved and type(next(iter(loaded["k"]))) is UnresolvedEnum
    again = tree.flatten_state(loaded)
    assert again.tree == nodes  # the class names survive a load and save in a process without the classes
    back = tree.unflatten(_renamed(_renamed(again.tree, "absent_mod:Schedule", f"{__name__}:Schedule"),
                                   "absent_mod:Color", f"{__name__}:Color"), again.tensors.__getitem__)
    same(state, back)


def test_a_changed_dataclass_takes_defaults_for_new_fields_and_falls_back_for_removed_ones() -> None:
    node = tree.flatten_state(Schedule(1, 2.0)).tree
    header, *fields = node["C"]
    without_mode = {"C": [header, *(f for f in fields if f[0] != "mode")]}
    assert tree.unflatten(without_mode, lambda i: None) == Schedule(1, 2.0, Mode.TRAIN)
    extra = {"C": [header, *fields, ["gone", {"i": 1}]]}
    back = tree.unflatten(extra, lambda i: None)
    assert type(back) is Unresolved and back["gone"] == 1


def test_lightning_attribute_dict_loads_as_itself_and_as_a_named_dict_without_lightning(daemon: Any) -> None:
    from lightning.fabric.utilities.data import AttributeDict
    hp = AttributeDict(lr=0.1, layers=4, sched=AttributeDict(kind="cos"))
    with Client("hp", socket=daemon.socket) as c:
        c.save(1, {"hyper_parameters": hp, "w": torch.ones(2)}).wait("local", timeout=30)
        back = c.load(1)["hyper_parameters"]
    same(hp, back)
    assert back.sched.kind == "cos"
    code = textwrap.dedent("""
        import sys
        from ckptstage.client import Client
        with Client("hp", socket=sys.argv[1]) as c:
            hp = c.load(1)["hyper_parameters"]
        assert "lightning" not in sys.modules, "loading imported lightning"
        print(type(hp).__name__, hp.cls, hp.kind, dict(hp["sched"]), hp["lr"])
    """)
    out = subprocess.run([sys.executable, "-c", code, str(daemon.socket)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == ("Unresolved lightning.fabric.utilities.data:AttributeDict dict "
                                         "{'kind': 'cos'} 0.1")


# --- errors and limits -------------------------------------------------------------------------------


BAD = [
    ({"a": [np.array([object()], dtype=object)]}, "state['a'][0]", "dtype object"),
    ({"a": np.zeros(2, dtype=np.longdouble)}, "state['a']", "float128"),
    ({"a": np.zeros(2, dtype="U3")}, "state['a']", "<U3"),
    ({"m": np.ma.masked_array([1, 2])}, "state['m']", "numpy.asarray"),
    ({"o": Opaque()}, "state['o']", "Opaque"),
    ({"s": {1, torch.ones(1)}}, "state['s']<item", "holds a tensor"),
    ({"e": {Color.RED: 1, (1, 2): 2}}, "state['e']", "tuple"),
    ({"d": defaultdict(lambda: 0)}, "state['d']", "default_factory"),
    ({"c": Schedule(1, Opaque())}, "state['c'].peak", "Opaque"),  # type: ignore[arg-type]
    ({"t": datetime.datetime(2024, 1, 1, tzinfo=type("Tz", (datetime.tzinfo,), {})())}, "state['t']", "tzinfo"),
    ({"g": np.random.Generator(type("MyBits", (np.random.PCG64,), {})())}, "state['g']", "MyBits"),
]


@pytest.mark.parametrize("state,path,what", BAD, ids=[b[2] for b in BAD])
def test_what_cannot_be_saved_is_an_error_naming_the_key_path(state: Any, path: str, what: str) -> None:
    with pytest.raises(TypeError) as info:
        tree.flatten_state(state)
    assert path in str(info.value) and what in str(info.value)


def test_cycles_and_depth_are_refused_through_the_new_containers() -> None:
    loop = Holder(torch.ones(1), Schedule(1, 1.0))
    loop.tags = [loop]  # type: ignore[assignment]
    with pytest.raises(TypeError, match=r"state\['x'\]\.tags\[0\] contains itself"):
        tree.flatten_state({"x": loop})
    ns = argparse.Namespace()
    ns.me = {"again": ns}
    with pytest.raises(TypeError, match="contains itself"):
        tree.flatten_state(ns)
    for make in (lambda v: Point(1, v), lambda v: argparse.Namespace(x=v), lambda v: Schedule(1, v),
                 lambda v: AttrDict(x=v), lambda v: frozenset({v})):
        deep: Any = 1
        for _ in range(layout.MAX_TREE_DEPTH):
            deep = make(deep)
        tree.flatten_state(deep)  # at the limit
        with pytest.raises(ValueError, match="nested more than"):
            tree.flatten_state(make(deep))


def _generator_node(**seed: Any) -> Any:
    """A saved numpy Generator's tree node, with ``seed`` changed in its seed sequence."""
    node = tree.flatten_state({"g": np.random.default_rng(1)}).tree
    stack = [node]
    while stack:  # find the seed sequence's {"d": [...]} and edit its fields in place
        n = stack.pop()
        if isinstance(n, dict):
            for k, v in n.get("d", []) if isinstance(n.get("d"), list) else []:
                if k in ({"s": f} for f in seed):
                    v.clear()
                    v.update(tree.flatten_state(seed[k["s"]]).tree)
            stack.extend(n.values())
        elif isinstance(n, list):
            stack.extend(n)
    return node


def test_a_manifest_with_a_bad_node_is_a_clear_error() -> None:
    for node, what in [({"a": {"dtype": "|O", "shape": [1], "data": ""}}, "not one ckptstage writes"),
                       ({"a": {"dtype": "<f4", "shape": [4], "data": "AAAA"}}, "bytes for shape"),
                       ({"B": {"d": [[{"s": "state"}, {"d": [[{"s": "bit_generator"}, {"s": "Evil"}]]}]]}},
                        "not one ckptstage restores"),
                       (_generator_node(pool_size=1 << 40), "pool_size .* is outside"),
                       (_generator_node(spawn_key="x"), "spawn_key in manifest"),
                       ({"dt": "Tensor"}, "unknown torch dtype"), ({"zz": 1}, "unknown tree node")]:
        with pytest.raises(ValueError, match=what):
            tree.unflatten(node, lambda i: None)


def test_consumer_walk_helpers_reach_tensors_inside_the_new_containers() -> None:
    state = {"c": Holder(torch.ones(1), Schedule(1, 1.0)), "k": {Level.LOW: np.zeros(2048)}, "ns": argparse.Namespace(
        p=Point(1, torch.ones(2)))}
    flat = tree.flatten_state(state)
    found: list[tuple[str, int]] = []
    stack: list[tuple[Any, tuple[str, ...]]] = [(flat.tree, ())]
    while stack:
        node, keys = stack.pop()
        if "T" in node:
            found.append((".".join(keys), node["T"]))
        stack.extend((x, keys if seg is None else keys + (seg,)) for seg, x in tree.children(node))
    assert sorted(found) == sorted(zip(flat.fqns, range(len(flat.fqns))))

    def shifted(node: Any) -> Any:
        return {"T": node["T"] + 10} if "T" in node else tree.map_children(node, shifted)

    back = tree.unflatten(shifted(flat.tree), lambda i: torch.full((1,), float(i)))
    assert [back["c"].weight.item(), back["k"][Level.LOW].tolist()[0], back["ns"].p.y.item()] == [10.0, 11.0, 12.0]
