"""Round trips through a real daemon: what goes in comes back bit-exactly, with its structure and types.

Every test saves through ``ckptstage.client.Client`` into a real ``ckptstaged``
subprocess (shared memory, local tier on disk) and reads the committed part
back, so a change anywhere on the path (tree encoding, file layout, the arena
ring, the persister, restore) shows up here.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from support import assert_same, data_size, raw_bytes, read_data, wait_until

from ckptstage.client import Client
from ckptstage.protos import layout

ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.int8, torch.uint8,
              torch.bool, torch.complex64]


# --- comparison helpers ----------------------------------------------------------------






def part_dirs(local: Path, job: str) -> list[Path]:
    return sorted(local.glob(f"{job}/step-*/rank-*"))


def trained_model_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        train_step(model, opt, torch.randn(8, 16))
    return model, opt


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def clone_state(obj: Any) -> Any:
    """A deep copy that keeps container and key types (tensors cloned)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, torch.Size):
        return obj
    if isinstance(obj, OrderedDict):
        return OrderedDict((k, clone_state(v)) for k, v in obj.items())
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_state(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(clone_state(v) for v in obj)
    return obj


def save_and_load(client: Client, step: int, state: Any) -> Any:
    client.save(step, state).wait("local", timeout=60)
    return client.load(step)


# --- training state ----------------------------------------------------------------------


def test_model_optimizer_and_rng_round_trip(daemon):
    model, opt = trained_model_and_optimizer()
    torch.manual_seed(1234)
    torch.rand(3)  # an RNG state that is not the seed's
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "rng": torch.get_rng_state(), "step": 3}
    expected = clone_state(state)

    with Client("train", socket=daemon.socket) as c:
        loaded = save_and_load(c, 3, state)

    assert_same(loaded, expected)
    assert isinstance(loaded["model"], OrderedDict)
    assert sorted(loaded["optim"]["state"]) == [0, 1, 2, 3, 4, 5]  # int keys stay int
    assert all(type(k) is int for k in loaded["optim"]["state"])

    # The loaded state drives a fresh model and optimizer to exactly the same next step.
    model2, opt2 = trained_model_and_optimizer(seed=99)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optim"])
    torch.set_rng_state(loaded["rng"])
    x = torch.randn(8, 16)
    torch.set_rng_state(expected["rng"])
    assert torch.equal(torch.randn(8, 16), x)
    train_step(model, opt, x)
    train_step(model2, opt2, x)
    for (name, p), p2 in zip(model.named_parameters(), model2.parameters()):
        assert raw_bytes(p) == raw_bytes(p2), name
    assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])


# --- tensors of every kind ---------------------------------------------------------------


def test_every_dtype_and_shape_round_trips(daemon):
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 10, generator=g, dtype=torch.float64)
    tensors: dict[str, Any] = {}
    for dt in ALL_DTYPES:
        name = str(dt).removeprefix("torch.")
        if dt.is_complex:
            t = torch.randn(37, generator=g, dtype=dt)
        elif dt.is_floating_point:
            t = (torch.randn(37, generator=g) * 100).to(dt)
            t[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]).to(dt)
        elif dt == torch.bool:
            t = torch.randint(0, 2, (37,), generator=g).bool()
        else:
            info = torch.iinfo(dt)
            t = torch.randint(info.min, info.max, (37,), generator=g, dtype=dt)
        tensors[name] = {"vec": t, "scalar": t[5].clone(), "empty": t[:0].clone(),
                         "empty2d": torch.empty(0, 3, dtype=dt), "matrix": t[:36].reshape(4, 9)}
    state = {
        "dtypes": tensors,
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(4, dtype=torch.int32).expand(3, 4),
        "column": base[:, 3],
        "scalar": torch.tensor(3.25),
        "bf16_view": base.to(torch.bfloat16).t()[2:],
        "shared_storage": (base[0], base[0]),  # one view twice: stored once, two tensor objects back
    }
    expected = clone_state(state)

    with Client("dtypes", socket=daemon.socket) as c:
        loaded = save_and_load(c, 1, state)

    assert_same(loaded, expected)
    for v in (loaded["transposed"], loaded["strided"], loaded["expanded"], loaded["bf16_view"]):
        assert v.is_contiguous()  # loaded values own dense storage of their own
    assert loaded["shared_storage"][0] is not loaded["shared_storage"][1]
    assert loaded["dtypes"]["float32"]["scalar"].dim() == 0


def test_plain_values_and_containers_round_trip(daemon):
    state = {
        "ints": [0, -1, 2**63, 2**64 + 1, -(2**70), 7],
        "floats": [0.1, -0.0, 0.0, float("inf"), -float("inf"), float("nan"), 5e-324, 1.7976931348623157e308],
        "bools": (True, False),
        "strs": ["", "héllo wörld", "日本", "quote \" and \\ back", "\x00nul"],
        "none": None,
        "bytes": [b"", b"\x00\xff\x80 binary", bytes(range(256))],
        "nested": {"a": [1, (2, [3, {"b": (None,)}])], "empty": {}, "empty_list": [], "empty_tuple": ()},
        "ordered": OrderedDict([("z", 1), ("a", 2), ("m", OrderedDict([("x", torch.ones(2))]))]),
        "keys": {3: "int", -1: "neg", 2.5: "float", None: "none", False: "bool", "s": "str", 2**65: "big"},
        "size": torch.Size([2, 3]),
        "tensor_in_tuple": (torch.arange(3), "tag"),
    }
    expected = clone_state(state)

    with Client("plain", socket=daemon.socket) as c:
        loaded = save_and_load(c, 5, state)

    assert_same(loaded, expected)
    assert math.isnan(loaded["floats"][5])
    assert math.copysign(1.0, loaded["floats"][1]) == -1.0
    assert [type(k) for k in loaded["keys"]] == [int, int, float, type(None), bool, str, int]


def test_data_file_is_a_valid_safetensors_file(daemon, tmp_path):
    g = torch.Generator().manual_seed(3)
    state = {"model": {"w": torch.randn(5, 7, generator=g), "b": torch.randn(7, generator=g).half()},
             "ids": torch.arange(11), "flag": torch.tensor([True, False]),
             "bf": torch.randn(4, generator=g).to(torch.bfloat16), "t": torch.randn(3, 4, generator=g).t(),
             "z": torch.randn(3, generator=g, dtype=torch.complex64), "step": 9}
    with Client("st", socket=daemon.socket) as c:
        c.save(9, state).wait("local", timeout=30)
    [part] = part_dirs(daemon.local, "st")
    data = tmp_path / "data.safetensors"  # the part's data file, whole or put together from its chunks
    data.write_bytes(read_data(part))

    tensors = load_file(str(data))

    expected = {"['model']['w']": state["model"]["w"], "['model']['b']": state["model"]["b"],
                "['ids']": state["ids"], "['flag']": state["flag"], "['bf']": state["bf"], "['t']": state["t"]}
    assert set(tensors) == set(expected) | {"['z']"}
    for name, want in expected.items():
        assert tensors[name].dtype == want.dtype, name
        assert raw_bytes(tensors[name]) == raw_bytes(want), name
    # No safetensors code for complex: stored as raw bytes, the manifest keeps the real dtype.
    assert tensors["['z']"].dtype == torch.uint8
    assert raw_bytes(tensors["['z']"]) == raw_bytes(state["z"])
    with safe_open(str(data), framework="pt") as f:
        assert f.metadata() == {"format": "ckptstage/1"}


def test_load_into_existing_tensors(daemon):
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(4, 5, generator=g), "n": [torch.arange(6, dtype=torch.int16)], "e": torch.empty(0),
             "step": 4}
    target = {"w": torch.zeros(4, 5), "n": [torch.zeros(6, dtype=torch.int16)], "e": torch.empty(0), "step": 0}
    w_obj, n_obj = target["w"], target["n"][0]

    with Client("into", socket=daemon.socket) as c:
        c.save(4, state).wait("local", timeout=30)
        loaded = c.load(4, into=target)
        with pytest.raises(ValueError, match=r"\['w'\].*\(5, 4\)"):
            c.load(4, into={"w": torch.zeros(5, 4), "n": [torch.zeros(6, dtype=torch.int16)], "e": torch.empty(0)})

    assert loaded["w"] is w_obj and loaded["n"][0] is n_obj
    assert torch.equal(w_obj, state["w"]) and torch.equal(n_obj, state["n"][0])
    assert loaded["step"] == 4


def test_state_larger_than_arena_streams_through_it(daemon_factory):
    d = daemon_factory(**{"arena.max_bytes": "4MiB", "arena.min_session_bytes": "1MiB",
                          "persist.chunk_bytes": "1MiB"}).start()
    g = torch.Generator().manual_seed(11)
    state = {"a": torch.randn(1_500_001, generator=g),  # odd sizes: pieces split at chunks and at the ring's end
             "b": torch.randint(0, 256, (3_000_007,), dtype=torch.uint8, generator=g),
             "c": torch.randn(900, 701, generator=g, dtype=torch.float64).t(),
             "d": torch.randn(333_333, generator=g).to(torch.bfloat16)}
    expected = clone_state(state)
    total = sum(t.numel() * t.element_size() for t in state.values())
    assert total > 3 * (4 << 20)

    with Client("stream", socket=d.socket) as c:
        for step in (1, 2):  # the second save reuses the arena, from a new stream position
            loaded = save_and_load(c, step, state)
            assert_same(loaded, expected)
        with d.connection() as conn:
            status = conn.status()
        assert status.arena_used_bytes <= 4 << 20
        [session] = status.sessions
        assert session.arena_bytes <= 4 << 20

    [part1, part2] = part_dirs(d.local, "stream")
    assert read_data(part1) == read_data(part2)


def test_arena_is_reused_across_saves_and_grows_only_between_them(daemon_factory):
    d = daemon_factory(**{"arena.max_bytes": "64MiB", "arena.min_session_bytes": "1MiB",
                          "persist.chunk_bytes": "1MiB"}).start()

    def arena_state() -> tuple[int, list[str]]:
        with d.connection() as conn:
            [session] = conn.status().sessions
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text().splitlines()
        return session.arena_bytes, sorted({line.split()[-2] if line.endswith("(deleted)") else line.split()[-1]
                                            for line in maps if "/ckptstage-" in line})

    with Client("reuse", socket=d.socket) as c:
        sizes = []
        for step, n in enumerate([1000, 2000, 3 << 20, 1000, 3 << 20], 1):
            w = torch.arange(n, dtype=torch.float32)
            c.save(step, {"w": w}).wait("local", timeout=30)
            assert torch.equal(c.load(step)["w"], w)
            size, mapped = arena_state()
            assert len(mapped) == 1, mapped  # one arena per session; a replaced one is unmapped
            sizes.append((size, mapped[0]))
    assert sizes[0] == sizes[1] and sizes[0][0] == 1 << 20       # small saves reuse the first arena
    assert sizes[2][0] >= 12 << 20 and sizes[2][1] != sizes[0][1]  # a larger state grew it once
    assert sizes[2] == sizes[3] == sizes[4]                        # and it is kept, not shrunk or re-made
    with d.connection() as conn:  # the last arena is the memory tier's now, and nothing else is granted
        status = wait_until(lambda: (s := conn.status()).memory_parts == 1 and s, 20, "the last part kept")
        assert status.arena_used_bytes == status.memory_bytes == sizes[-1][0]


class _ThreadsAtCopy(torch.Tensor):
    """Records the intra-op thread count of the thread that copies it into the arena."""

    seen: list[int] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            cls.seen.append(torch.get_num_threads())
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 or more intra-op threads")
def test_snapshot_copies_with_one_thread_until_the_trainer_waits(daemon):
    # Beside a computing trainer the copy uses one intra-op thread; once the trainer waits for the
    # snapshot its cores are idle and the copy uses the trainer's count. The trainer's own count
    # is never changed.
    full = torch.get_num_threads()
    big = torch.ones(64 << 20, dtype=torch.float64)  # 512 MiB, copied first (8-byte elements)
    probe = torch.zeros(4096, dtype=torch.uint8).as_subclass(_ThreadsAtCopy)  # copied last
    with Client("threads", socket=daemon.socket, arena_bytes=1 << 30) as c:
        _ThreadsAtCopy.seen.clear()
        h = c.save(1, {"big": big, "probe": probe})
        while not h.snapshot_done():  # nobody waits: a background copy
            time.sleep(0.001)
        assert _ThreadsAtCopy.seen == [1]
        assert torch.get_num_threads() == full

        _ThreadsAtCopy.seen.clear()
        h = c.save(2, {"big": big, "probe": probe})
        h.wait_snapshot(timeout=60)  # the trainer waits while "big" is still being copied
        assert _ThreadsAtCopy.seen == [full]
        assert torch.get_num_threads() == full
        h.wait("local", timeout=60)
        assert torch.equal(c.load(2)["big"], big)


def test_tied_weights_are_stored_once_and_load_as_one_tensor(daemon):
    # GPT-2 style: the output layer is the embedding. state_dict() returns a separate detach() of
    # the one parameter under each key; they are the same bytes, stored once.
    emb = torch.nn.Embedding(1000, 64)
    head = torch.nn.Linear(64, 1000, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"wte": emb, "lm_head": head})
    sd = model.state_dict()
    assert sd["wte.weight"] is not sd["lm_head.weight"]  # two tensor objects, one storage
    base = torch.arange(4096, dtype=torch.float32)
    state = {"model": sd, "view": base[::2], "slice": base[100:200], "base": base, "again": base,
             "empty": torch.empty(0), "empty2": torch.empty(0)}
    with Client("tied", socket=daemon.socket) as c:
        loaded = save_and_load(c, 1, state)
    [part] = part_dirs(daemon.local, "tied")
    manifest = layout.read_manifest(part)
    names = [t["name"] for t in manifest["tensors"]]
    assert "['model']['lm_head.weight']" not in names and "['again']" not in names
    # Stored once: embedding + base + its two other views + the two empties.
    assert sum(t["nbytes"] for t in manifest["tensors"]) == 1000 * 64 * 4 + 4096 * 4 + 2048 * 4 + 100 * 4
    # One storage under two tensor objects, as torch.load returns tied weights.
    wte, head = loaded["model"]["wte.weight"], loaded["model"]["lm_head.weight"]
    assert wte is not head and wte.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
    assert loaded["base"].data_ptr() == loaded["again"].data_ptr()
    assert loaded["empty"] is not loaded["empty2"]
    assert_same(loaded, clone_state(state))
    # The tie survives into the model: loading the state sets both keys from the one tensor.
    fresh = torch.nn.ModuleDict({"wte": torch.nn.Embedding(1000, 64), "lm_head": torch.nn.Linear(64, 1000, bias=False)})
    fresh["lm_head"].weight = fresh["wte"].weight
    fresh.load_state_dict(loaded["model"])
    assert torch.equal(fresh["lm_head"].weight, emb.weight)


def test_back_to_back_saves_through_a_one_state_arena_stay_exact(daemon_factory):
    # The arena holds one state: every save but the first must wait for the daemon to free the
    # previous one's space, which the client learns from announcements, BeginSave's answer or
    # Progress. The trainer mutates its tensors as soon as each snapshot is done.
    d = daemon_factory(**{"arena.max_bytes": "64MiB", "persist.chunk_bytes": "1MiB", "persist.workers": 1,
                          "local.keep_last": 20, "shared.keep_last": 20}).start()
    w = torch.zeros((3 << 20) // 4 + 999)  # just over 3 MiB: the 4 MiB arena holds one such state
    expected = {}
    with Client("ring", socket=d.socket, arena_bytes=4 << 20) as c:
        handles = []
        for step in range(1, 9):
            w.fill_(float(step))
            h = c.save(step, {"w": w, "step": step})
            h.wait_snapshot(timeout=60)
            expected[step] = float(step)
            handles.append(h)
        for h in handles:
            h.wait("local", timeout=60)
        with d.connection() as conn:
            [session] = conn.status().sessions
        assert session.arena_bytes == 4 << 20  # never grown: the saves took turns in it
        for step, value in expected.items():
            got = c.load(step)
            assert got["step"] == step and torch.equal(got["w"], torch.full_like(w, value)), step


def test_a_state_whose_structure_changes_between_saves_is_laid_out_anew(daemon):
    # The client reuses the last layout while keys, dtypes and shapes stay the same; any change
    # (a shape, a dtype, a key) must produce a new one.
    g = torch.Generator().manual_seed(5)
    states = [{"a": torch.randn(10, 4, generator=g), "b": torch.arange(7)},
              {"a": torch.randn(10, 4, generator=g), "b": torch.arange(7) * 2},       # same structure
              {"a": torch.randn(4, 10, generator=g), "b": torch.arange(7)},           # a shape
              {"a": torch.randn(4, 10, generator=g).double(), "b": torch.arange(7)},  # a dtype
              {"a": torch.randn(4, 10, generator=g), "c": torch.arange(7)},           # a key
              {"a": torch.randn(10, 4, generator=g), "b": torch.arange(7)}]           # back to the first
    with Client("shapes", socket=daemon.socket) as c:
        for step, state in enumerate(states, 1):
            assert_same(save_and_load(c, step, state), clone_state(state))


def test_daemon_announces_freed_arena_space_on_the_session_stream(daemon):
    # What lets the client start its next copy without asking: as the persister frees arena
    # space, the daemon sends RELEASED events with the arena generation and stream position.
    from ckptstage.client.rpc import Connection
    from ckptstage.protos.v1 import ckptstage_pb2 as pb

    with Client("announce", socket=daemon.socket) as c, Connection(daemon.socket) as conn:
        events: list[Any] = []
        stream = conn.stub.Attach(pb.AttachRequest(session_id=c._session.session_id))

        def read() -> None:
            try:
                events.extend(stream)
            except grpc.RpcError:
                pass  # cancelled below

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        h = c.save(1, {"w": torch.ones(1 << 20)})  # 4 MiB: four chunks of the test daemon
        h.wait("local", timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(e.kind == pb.SessionEvent.RELEASED
                                                      and e.released >= 4 << 20 for e in events):
            time.sleep(0.02)
        released = [e for e in events if e.kind == pb.SessionEvent.RELEASED]
        assert events[0].kind == pb.SessionEvent.READY
        assert released and released[-1].released >= 4 << 20, events
        assert {e.arena_generation for e in released} == {c._session.arena.generation}
        assert [e.released for e in released] == sorted(e.released for e in released)  # never goes back
        stream.cancel()  # (the daemon takes this for the client going away and ends the session)


def _thread_nices(pid: int) -> dict[int, int]:
    """Niceness of every thread of ``pid`` (field 19 of /proc/PID/task/TID/stat)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except FileNotFoundError:
            continue  # the thread ended
        out[int(task.name)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


@pytest.mark.parametrize("nice", [10, 0])
def test_writer_threads_run_at_lower_priority_than_the_control_plane(daemon_factory, nice):
    # Under CPU contention the trainer, and the daemon's answers to it, must run before background
    # hashing and writing: [persist] nice is added to the writer threads only.
    d = daemon_factory(**{"persist.nice": nice, "persist.workers": 2}).start()
    with Client("nice", socket=d.socket) as c:
        c.save(1, {"w": torch.ones(1 << 20)}).wait("local", timeout=30)  # 4 chunks: both writers started
        nices = _thread_nices(d.proc.pid)
    assert nices[d.proc.pid] == 0  # the main thread, and with it the gRPC threads, untouched
    assert sum(1 for n in nices.values() if n == nice) >= 2 if nice else set(nices.values()) == {0}
    assert sum(1 for n in nices.values() if n == 0) >= 2  # the gRPC server's threads


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_round_trip(daemon):
    g = torch.Generator().manual_seed(2)
    state = {"w": torch.randn(300, 200, generator=g).cuda().t(), "h": torch.randn(1000, generator=g).half().cuda(),
             "b": torch.randn(77, generator=g).to(torch.bfloat16).cuda(), "cpu": torch.arange(5), "step": 1}
    expected = {k: v.cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    with Client("cuda", socket=daemon.socket) as c:
        c.save(1, state).wait("local", timeout=60)
        loaded = c.load(1)
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        filled = c.load(1, into=target)
    for k in ("w", "h", "b", "cpu"):
        assert raw_bytes(loaded[k]) == raw_bytes(expected[k]), k
        assert filled[k].device == state[k].device and raw_bytes(filled[k]) == raw_bytes(expected[k]), k


# --- concurrency and the catalogue ---------------------------------------------------------------


def test_two_ranks_save_concurrently_and_latest_waits_for_both(daemon):
    states = {r: {"w": torch.full((1000, 50), float(r + 1)), "rank": r, "ids": torch.arange(r, r + 100)}
              for r in (0, 1)}
    clients = {r: Client("ddp", socket=daemon.socket, rank=r, world_size=2) for r in (0, 1)}
    try:
        # Step 1 from rank 0 alone is not restorable.
        clients[0].save(1, states[0]).wait("local", timeout=30)
        assert clients[0].latest() is None and clients[1].latest() is None
        [info] = clients[0].list()
        assert (info.step, info.complete, info.world_size, info.tiers) == (1, False, 2, ())

        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                barrier.wait(timeout=10)
                for step in (2, 3):
                    clients[rank].save(step, states[rank]).wait("local", timeout=60)
            except BaseException as e:  # noqa: BLE001 - re-raised below in the test thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads)

        for r in (0, 1):
            assert clients[r].latest() == 3
            assert_same(clients[r].load(), states[r])
            assert_same(clients[r].load(2), states[r])
        infos = {i.step: i for i in clients[1].list()}
        assert sorted(infos) == [1, 2, 3]
        assert [infos[s].complete for s in (1, 2, 3)] == [False, True, True]

        # Rank 0's part of step 1 left the local tier (keep_last) after it drained, so the step's
        # parts come together, and it is committed, on the shared tier.
        clients[1].save(1, states[1]).wait("shared", timeout=30)
        assert clients[0].latest() == 3  # step 1 is complete now, but not the newest
        assert_same(clients[1].load(1), states[1])
    finally:
        for c in clients.values():
            c.close()


def test_list_reports_steps_tiers_sizes_and_times(daemon_factory):
    daemon = daemon_factory(**{"local.keep_last": 10}).start()
    t0 = time.time()
    with Client("ls", socket=daemon.socket) as c:
        assert c.list() == [] and c.latest() is None
        for step in (10, 20, 5):
            c.save(step, {"w": torch.ones(step * 100), "step": step}).wait("local", timeout=30)
        infos = c.list()
        latest = c.latest()
    t1 = time.time()

    assert [i.step for i in infos] == [5, 10, 20]
    assert latest == 20
    sizes = {int(p.parent.name.removeprefix("step-")): data_size(p)
             for p in part_dirs(daemon.local, "ls")}
    for i in infos:
        assert i.complete and i.world_size == 1 and not i.pinned
        assert "local" in i.tiers
        assert i.bytes == sizes[i.step]
        assert t0 - 1 <= i.created <= t1 + 1
    assert infos[0].bytes < infos[1].bytes < infos[2].bytes


def test_loading_an_older_step_while_retention_evicts_it(daemon_factory, caplog):
    # keep_last=1: each commit makes retention delete the previous step's local
    # copy as soon as it is drained, possibly while it is being read. That is
    # not corruption: the load falls back (or asks the daemon again) and
    # reports nothing.
    d = daemon_factory(**{"local.keep_last": 1}).start()
    w = torch.arange(1 << 20, dtype=torch.float32)
    with caplog.at_level("INFO", logger="ckptstage.client"), Client("churn", socket=d.socket) as c:
        c.save(0, {"w": w, "step": 0}).wait("local", timeout=30)
        for step in range(1, 25):
            c.save(step, {"w": w, "step": step}).wait("local", timeout=30)
            loaded = c.load(step - 1)
            assert loaded["step"] == step - 1 and torch.equal(loaded["w"], w)
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []
    assert "corrupt" not in d.log.read_text()


# --- snapshot semantics ---------------------------------------------------------------------------


def test_mutation_after_wait_snapshot_does_not_reach_the_checkpoint(daemon):
    state = {"w": torch.arange(1 << 20, dtype=torch.float32), "v": [torch.ones(1000, dtype=torch.int64)]}
    expected = clone_state(state)
    with Client("snap", socket=daemon.socket) as c:
        h = c.save(1, state)
        h.wait_snapshot(timeout=30)
        state["w"].mul_(-1)
        state["v"][0].fill_(7)
        h.wait("local", timeout=30)
        loaded = c.load(1)
    assert_same(loaded, expected)


def test_protect_makes_optimizer_step_wait_for_the_snapshot(daemon_factory):
    # A small arena makes the copy stream with back-pressure, so it is still
    # running when optimizer.step() is called right after save().
    d = daemon_factory(**{"arena.max_bytes": "2MiB", "arena.min_session_bytes": "1MiB",
                          "persist.chunk_bytes": "256KiB"}).start()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    train_step(model, opt, torch.randn(4, 512))
    state = {"model": model.state_dict(), "optim": opt.state_dict()}  # references: optimizer.step() mutates them

    with Client("protect", socket=d.socket) as c:
        hook = c.protect(opt)
        train_step(model, opt, torch.randn(4, 512))  # no save in flight: does not block
        before = clone_state(state)
        h = c.save(2, state)
        opt.zero_grad()
        model(torch.randn(4, 512)).pow(2).mean().backward()
        opt.step()  # the pre-hook waits for the snapshot before any parameter changes
        assert h.snapshot_done()
        after = clone_state(state)
        h.wait("local", timeout=60)
        loaded = c.load(2)
        hook.remove()

    assert_same(loaded, before)
    assert raw_bytes(after["model"]["0.weight"]) != raw_bytes(before["model"]["0.weight"])
