"""``consolidate``: a step as Hugging Face style safetensors files, against a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckptstage.client import CheckpointNotFound, Client
from ckptstage.client import consolidate as co
from ckptstage.client import shards, tree


def saved(daemon: Any, job: str, state: Any, step: int = 1) -> None:
    with Client(job, socket=daemon.socket) as c:
        c.save(step, state).wait("local", timeout=30)


def read_out(out: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of the output, by name, checked against the index: (tensors, index)."""
    index = json.loads((out / co.INDEX_NAME).read_text())
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted({*index["weight_map"].values(), co.INDEX_NAME}), "stray or missing files"
    for name in set(index["weight_map"].values()):
        with safe_open(str(out / name), "pt") as f:
            assert f.metadata()["format"] == "pt"  # transformers refuses a file without it
        got = load_file(out / name)
        assert {k for k, v in index["weight_map"].items() if v == name} == set(got), name
        tensors.update(got)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors, index


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, w in want.items():
        assert (got[k].dtype, tuple(got[k].shape)) == (w.dtype, tuple(w.shape)), k
        assert torch.equal(got[k], w), k


def mixed_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A nested trainer state, and its tensors by fqn."""
    g = torch.Generator().manual_seed(0)
    model = {"fc.weight": torch.randn(6, 5, generator=g), "emb": torch.randn(7, 3, generator=g).bfloat16(),
             "half": torch.randn(4, generator=g).half(), "ids": torch.arange(9).reshape(3, 3),
             "mask": torch.rand(5, generator=g) > 0.5, "scale": torch.tensor(2.5, dtype=torch.float64),
             "empty": torch.empty(0, 4), "t_view": torch.randn(5, 4, generator=g).t()}
    optim = {"state": {0: {"exp_avg": torch.randn(6, 5, generator=g), "step": torch.tensor(3.0)}},
             "param_groups": [{"lr": 0.1, "params": [0]}]}
    state = {"model": model, "optim": optim, "step": 7, "note": "plain values are not written"}
    want = {f"model.{k}": v for k, v in model.items()}
    want.update({"optim.state.0.exp_avg": optim["state"][0]["exp_avg"], "optim.state.0.step": optim["state"][0]["step"]})
    return state, want


def test_plain_state_comes_back_whole_with_dtypes(daemon: Any, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    state, want = mixed_state()
    saved(daemon, "co-plain", state, step=3)
    done = co.consolidate("co-plain", out=tmp_path / "out", socket=daemon.socket, progress="bar")
    assert "co-plain step 3" in capsys.readouterr().err  # the tqdm bar's label
    assert (done.step, done.tensors, done.files) == (3, len(want), [co.WEIGHTS_NAME, co.INDEX_NAME])
    got, index = read_out(tmp_path / "out")
    assert_same(got, want)
    assert done.bytes == index["metadata"]["total_size"]
    assert set(index["weight_map"].values()) == {co.WEIGHTS_NAME}


def test_prefix_strips_and_max_shard_size_splits(daemon: Any, tmp_path: Path) -> None:
    state, want = mixed_state()
    state["model"]["big"] = torch.arange(2000, dtype=torch.float32)  # 8000 bytes: over the limit, a file alone
    tied = torch.randn(3, 4)
    state["model"]["wte.weight"], state["model"]["lm_head.weight"] = tied, tied.detach()  # stored once
    saved(daemon, "co-shards", state)
    done = co.consolidate("co-shards", out=tmp_path / "out", prefix="model.", max_shard_size="200B",
                          socket=daemon.socket)
    got, index = read_out(tmp_path / "out")
    model_want = {k.removeprefix("model."): v for k, v in want.items() if k.startswith("model.")}
    model_want.update(big=state["model"]["big"], **{"wte.weight": tied})
    assert_same(got, model_want)
    assert done.aliases == {"lm_head.weight": "wte.weight"}
    n = len(done.files) - 1
    assert n > 3 and done.files[:-1] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for name in done.files[:-1]:  # each file within the limit, unless it holds one tensor alone
        sizes = [got[k].numel() * got[k].element_size() for k, f in index["weight_map"].items() if f == name]
        assert sum(sizes) <= 200 or len(sizes) == 1, (name, sizes)


def test_out_dir_holding_a_model_is_refused_unless_overwrite(daemon: Any, tmp_path: Path) -> None:
    saved(daemon, "co-over", {"a": torch.ones(100), "b": torch.zeros(100)})
    co.consolidate("co-over", out=tmp_path / "out", max_shard_size="400B", socket=daemon.socket)
    assert len(list((tmp_path / "out").glob("model-*.safetensors"))) == 2
    with pytest.raises(FileExistsError, match="model-00001-of-00002.safetensors"):
        co.consolidate("co-over", out=tmp_path / "out", socket=daemon.socket)
    done = co.consolidate("co-over", out=tmp_path / "out", overwrite=True, socket=daemon.socket)
    assert done.files == [co.WEIGHTS_NAME, co.INDEX_NAME]
    got, _ = read_out(tmp_path / "out")  # also: the two files of the first output are gone
    assert_same(got, {"a": torch.ones(100), "b": torch.zeros(100)})


def test_unsupported_dtype_names_the_key_and_writes_nothing(daemon: Any, tmp_path: Path) -> None:
    saved(daemon, "co-cplx", {"model": {"w": torch.ones(3)}, "optim": {"z": torch.ones(2, dtype=torch.complex64)}})
    with pytest.raises(co.ConsolidateError, match=r"'optim\.z' is torch\.complex64"):
        co.consolidate("co-cplx", out=tmp_path / "out", socket=daemon.socket)
    assert not (tmp_path / "out").exists()
    co.consolidate("co-cplx", out=tmp_path / "out", prefix="model.", socket=daemon.socket)
    assert_same(read_out(tmp_path / "out")[0], {"w": torch.ones(3)})
    with pytest.raises(co.ConsolidateError, match=r"no tensor whose key starts with 'nothing\.'"):
        co.consolidate("co-cplx", out=tmp_path / "other", prefix="nothing.", socket=daemon.socket)


def test_failed_write_leaves_no_file_named_like_a_finished_one(daemon: Any, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    saved(daemon, "co-crash", {"a": torch.ones(100), "b": torch.zeros(100)})
    real = co._write_out
    calls = []

    def fail_on_third(f: Any, data: memoryview) -> None:
        calls.append(len(data))
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(f, data)

    monkeypatch.setattr(co, "_write_out", fail_on_third)
    with pytest.raises(OSError, match="No space left"):
        co.consolidate("co-crash", out=tmp_path / "out", max_shard_size="400B", socket=daemon.socket)
    assert list((tmp_path / "out").iterdir()) == []


def test_parse_size_is_decimal_like_transformers() -> None:
    assert co.parse_size("5GB") == 5 * 10**9
    assert co.parse_size("500mb") == 500 * 10**6
    assert co.parse_size("2GiB") == 2 * 2**30
    assert co.parse_size("1.5KB") == 1500
    assert co.parse_size(1234) == 1234
    for bad in ("", "GB", "5XB", "-1GB", "0", "5 G B"):
        with pytest.raises(ValueError, match="invalid size"):
            co.parse_size(bad)


# --- sharded steps ----------------------------------------------------------------------------


def _flat_fragments(pieces: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]]) -> tree.Flat:
    """A state of DTensor fragments built by hand (no process group): fqn -> (full, local box, its offset)."""
    flat = tree.Flat({"d": [[{"s": "model"}, {"d": []}]]})
    for fqn, (full, local, offset) in pieces.items():
        key = fqn.removeprefix("model.")
        node = {"fqn": fqn, "dtype": str(full.dtype).removeprefix("torch."), "shape": list(full.shape)}
        flat.tree["d"][0][1]["d"].append([{"s": key}, {"D": node}])
        flat.tensors.append(local.contiguous())
        flat.paths.append(f"state['model'][{key!r}]")
        flat.fqns.append(fqn)
        flat.fragments.append(shards.Fragment(fqn, tuple(full.shape), offset))
    return flat


def test_fragments_of_two_ranks_come_back_whole(daemon: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(7, 6, generator=g)                   # Shard(0), uneven: 4 + 3 rows
    cols = torch.randn(5, 10, generator=g).bfloat16()       # Shard(1): 5 + 5 columns
    for rank, (r, c) in enumerate([((0, 4), (0, 5)), ((4, 7), (5, 10))]):
        flat = _flat_fragments({"model.rows": (rows, rows[r[0]:r[1]], (r[0], 0)),
                                "model.cols": (cols, cols[:, c[0]:c[1]], (0, c[0]))})
        with Client("co-frag", socket=daemon.socket, rank=rank, world_size=2, attempt="a1") as c:
            c.save_flat(5, flat).wait("local", timeout=30)
    monkeypatch.setattr(co, "SLAB_BYTES", 24)  # slabs of a row or two: each read spans both ranks' fragments
    done = co.consolidate("co-frag", 5, out=tmp_path / "out", prefix="model.", socket=daemon.socket)
    assert done.step == 5
    assert_same(read_out(tmp_path / "out")[0], {"rows": rows, "cols": cols})


def save_dtensors(ctx: Any, job: str) -> None:
    """A rank of a real 2-rank process group saving DTensors (Shard(0) uneven, Shard(1), Replicate)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = dtensor_state()
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    state = {"model": {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
                       "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
                       "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
                       "plain": full["plain"]}, "step": 9}
    with Client(job, socket=ctx.socket) as c:
        c.save(9, state).wait("local", timeout=60)
        c.wait_step(9, "local", timeout=60)


def dtensor_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return {"rows": torch.randn(9, 4, generator=g), "cols": torch.randn(3, 8, generator=g).half(),
            "rep": torch.arange(6), "plain": torch.ones(2, dtype=torch.bool)}


def test_dtensors_saved_by_two_ranks_come_back_whole(daemon: Any, tmp_path: Path) -> None:
    harness = pytest.importorskip("dist_harness")
    harness.run_ranks(save_dtensors, 2, str(daemon.socket), args=("co-dt",), timeout=120)
    co.consolidate("co-dt", out=tmp_path / "out", prefix="model.", socket=daemon.socket)
    assert_same(read_out(tmp_path / "out")[0], dtensor_state())


# --- memory ----------------------------------------------------------------------------------


# Run in a fresh process. glibc's malloc is given a fixed mmap threshold, so that a freed buffer goes back
# to the OS at once: the peak then measures the buffers alive at one time, not what the allocator keeps
# cached. The peak (VmHWM) is reset before each run, after a first run has paged in the code.
_MEASURE = """
import json, os, re, sys
from ckptstage.client import consolidate as co
co.SLAB_BYTES = 4 << 20
def status(field):
    return int(re.search(field + r":\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
grew = []
for job in sys.argv[2:]:
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    before = status("VmRSS")
    co.consolidate(job, out=os.path.join(sys.argv[1], job), socket=os.environ["CKPTSTAGE_SOCKET"],
                   progress="none")
    grew.append(status("VmHWM") - before)
print(json.dumps(grew))
"""


def test_peak_memory_does_not_grow_with_the_model(daemon: Any, tmp_path: Path) -> None:
    """Consolidating a 100 MiB step whose largest tensor is 32 MiB raises the process's peak memory by far
    less than either: tensors are streamed in slabs (4 MiB here). Reading the 32 MiB tensor whole would
    fail this (measured: +38 MiB with one slab per tensor, +14 MiB with 4 MiB slabs)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak")
    mib = 1 << 20
    saved(daemon, "co-mem-small", {"w": torch.ones(mib // 4), "e": torch.ones(2 * mib // 4, 4)})
    big = {f"layer{i}": torch.full((mib // 4, 4), float(i)) for i in range(17)}  # 17 x 4 MiB
    big["emb"] = torch.ones(8 * mib // 4, 4)  # 32 MiB
    saved(daemon, "co-mem-big", big)
    env = dict(os.environ, CKPTSTAGE_SOCKET=str(daemon.socket), MALLOC_MMAP_THRESHOLD_="131072")
    res = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path), "co-mem-small", "co-mem-big"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    _, big_grew = json.loads(res.stdout)
    assert big_grew < 24 * mib, f"peak grew by {big_grew / mib:.1f} MiB for a 100 MiB step"
    got, _ = read_out(tmp_path / "co-mem-big")
    assert_same(got, big)


# --- transformers ------------------------------------------------------------------------------


def test_gpt2_from_pretrained_gets_identical_weights(daemon: Any, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    saved(daemon, "co-gpt2", {"model": model.state_dict(), "optim": {"lr": 0.1}, "step": 4})
    co.consolidate("co-gpt2", out=tmp_path / "out", prefix="model.", max_shard_size="100KB", socket=daemon.socket)
    config.save_pretrained(tmp_path / "out")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    got = loaded.state_dict()
    assert set(got) == set(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again


# --- command line ------------------------------------------------------------------------------


def ckptstage(*args: str, socket: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptstage.client.cli", "--socket", str(socket), *args],
                          capture_output=True, text=True, timeout=120)


def test_cli_consolidate_json_and_errors(daemon: Any, tmp_path: Path) -> None:
    state, want = mixed_state()
    saved(daemon, "co-cli", state, step=12)
    res = ckptstage("consolidate", "co-cli", "--out", str(tmp_path / "o"), "--max-shard-size", "300B", "--json",
                    socket=daemon.socket)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert (report["job"], report["step"], report["tensors"]) == ("co-cli", 12, len(want))
    assert report["files"][-1] == co.INDEX_NAME and len(report["files"]) > 2
    assert "wrote model-00001-of-" in res.stderr  # not a terminal: a plain line per file
    assert_same(read_out(tmp_path / "o")[0], want)

    refused = [["consolidate", "co-cli", "12", "--out", str(tmp_path / "o")],
               ["consolidate", "co-cli", "13", "--out", str(tmp_path / "x")],
               ["consolidate", "no-such-job", "--out", str(tmp_path / "x")],
               ["consolidate", "co-cli", "--out", str(tmp_path / "x"), "--max-shard-size", "5XB"]]
    with ThreadPoolExecutor(len(refused)) as pool:  # each CLI process mostly waits for its imports
        again, missing_step, missing_job, bad_size = pool.map(lambda a: ckptstage(*a, socket=daemon.socket), refused)
    assert again.returncode == 1 and "--overwrite" in again.stderr
    assert missing_step.returncode == 1 and "step 13 of job 'co-cli'" in missing_step.stderr
    assert missing_job.returncode == 1 and "'no-such-job'" in missing_job.stderr
    assert bad_size.returncode == 2 and "invalid size '5XB'" in bad_size.stderr
    assert not (tmp_path / "x").exists()
    human = ckptstage("consolidate", "co-cli", "12", "--out", str(tmp_path / "o"), "--overwrite", "--prefix",
                      "model.", socket=daemon.socket)
    assert human.returncode == 0 and human.stdout.startswith("co-cli step 12: 8 tensors"), human.stdout


def test_api_unknown_step_raises_not_found(daemon: Any, tmp_path: Path) -> None:
    saved(daemon, "co-nf", {"w": torch.ones(2)})
    with pytest.raises(CheckpointNotFound, match="step 2 of job 'co-nf'"):
        co.consolidate("co-nf", 2, out=tmp_path / "out", socket=daemon.socket)
