"""The scale simulator's two references: a fresh daemon against a big shared tier, and DCP's file-system peer.

For ``bench_scale.py`` (directory mode): ``--tier-jobs`` x ``--tier-steps``
one-part steps written straight in the format, then a fresh daemon's READY,
first ``latest()`` and idle shared-tier operations (:func:`big_tier`); DCP's
``FileSystemWriter``/``FileSystemReader`` at a few gloo world sizes, timed,
then counted under ``strace -f`` (:func:`dcp_peer`; its ranks run as
``bench_scale.py --dcp-child``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import _harness as h
from _scale_job import start_daemons, stop_daemons
from _scale_ranks import COLS, rank_flat, wait_commit
from _syscounts import Tracer, count_trace, metadata, strace_from_start

ENTRY = Path(__file__).resolve().with_name("bench_scale.py")  # runs dcp_main for --dcp-child

# ------------------------------------------------------------------ a big shared tier


def write_big_tier(shared: Path, seed_root: Path, jobs: int, steps_per_job: int) -> int:
    """``jobs`` x ``steps_per_job`` one-part steps written in the format: a seed part saved by a real daemon,
    its manifest re-addressed per step, its data file hard-linked; returns the steps written."""
    from ckptstage.client import Client
    from ckptstage.protos import layout

    seed_shared = seed_root / "shared"
    settings: dict[str, Any] = {"arena.min_session_bytes": "64KiB", "persist.chunk_bytes": "256KiB",
                                "arena.max_bytes": "4MiB",
                                "persist.incremental": False}  # the seed's data file is linked into every step
    with h.Daemon(seed_root / "d", seed_root / "local", seed_shared, **settings) as d:
        with Client("seed", socket=d.socket, rank=0, world_size=1, arena_bytes=1 << 20) as c:
            c.save_flat(1, rank_flat(0, 1, 16)).wait("local")
        wait_commit(seed_shared, 1, "seed", timeout=60.0)
    part = layout.part_dir(seed_shared, "seed", 1, 0)
    manifest = layout.read_manifest(part)
    record = layout.read_commit_record(part.parent)
    assert record is not None
    nbytes = record.parts[0].nbytes
    source = part / layout.DATA_FILE
    for j in range(jobs):
        job = f"job{j:05d}"
        for s in range(1, steps_per_job + 1):
            dst = layout.part_dir(shared, job, s, 0)
            dst.mkdir(parents=True)
            if (j * steps_per_job + s) % 60000 == 0:  # ext4 allows 65,000 links to one file
                source = shared / f".seed-{j}-{s}"
                shutil.copyfile(part / layout.DATA_FILE, source)
            os.link(source, dst / layout.DATA_FILE)
            raw = layout.manifest_file_bytes({**manifest, "job": job, "step": s})
            (dst / layout.MANIFEST_FILE).write_bytes(raw)
            rec = layout.CommitRecord(job, s, str(manifest["attempt"]), 1, time.time(),
                                      {0: layout.CommittedPart(nbytes, layout.chunk_digest(raw))})
            layout.commit_path(shared, job, s).write_bytes(layout.commit_record_bytes(rec))
    return jobs * steps_per_job


def big_tier(work: Path, droot: Path, args: argparse.Namespace) -> dict[str, float]:
    """READY, first ``latest()`` and idle shared-tier operations of a fresh daemon against a big shared tier."""
    from ckptstage.client import errors, steps
    from ckptstage.client.rpc import Connection

    shared = work / "big-shared"
    with h.Timer() as wt:
        n = write_big_tier(shared, work / "seed", args.tier_jobs, args.tier_steps)
    d = h.Daemon(droot / "big", droot / "big" / "local", shared)
    out: dict[str, float] = {"jobs": args.tier_jobs, "steps": n, "write_s": wt.s}
    with h.Timer() as t:
        d.start()
    try:
        out["ready_s"] = t.s
        job = f"job{args.tier_jobs // 2:05d}"
        with Connection(d.socket) as conn:
            for name in ("first_latest_s", "second_latest_s"):
                t0 = time.perf_counter()
                try:
                    got = steps.complete_steps(conn, job, 1)
                except errors.CkptStageError:
                    got = []
                out[name] = time.perf_counter() - t0
                out[name.replace("_s", "_found")] = float(got == [args.tier_steps])
        tracer = Tracer([d.pid], work / "strace-big")
        t0 = time.time()
        time.sleep(args.idle_s)
        window = (t0, time.time())
        tracer.stop()
        counts = count_trace(tracer.logs[0], shared, {"idle": window})["idle"]
        out["idle_ops_per_s"] = metadata(counts) / (window[1] - window[0])
    finally:
        d.stop()
    shutil.rmtree(shared, ignore_errors=True)
    return out


# ------------------------------------------------------------------ the DCP peer


def _timed(cls: type) -> type:
    """``cls`` (a DCP storage writer or reader) noting when DCP hands it the final plan: the end of planning
    (the local plans, their gather, the global plan and its scatter)."""
    class Timed(cls):  # type: ignore[misc, valid-type]
        planned = float("nan")

        def write_data(self, plan: Any, planner: Any) -> Any:
            self.planned = time.perf_counter()
            return super().write_data(plan, planner)

        def read_data(self, plan: Any, planner: Any) -> Any:
            self.planned = time.perf_counter()
            return super().read_data(plan, planner)

    return Timed


def dcp_rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        rows = spec["rows"]

        def state(fill: float) -> dict[str, Any]:
            local = torch.full((rows, COLS), fill)
            return {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                            shape=torch.Size([world * rows, COLS]), stride=(COLS, 1))}

        def save_load(writer: Any, reader: Any) -> dict[str, Any]:
            """One timed save and load (the planning: until DCP hands over the final plan), wall-clock windows."""
            dist.barrier()
            t0, w0 = time.perf_counter(), time.time()
            dcp.save(state(float(rank)), storage_writer=writer)
            out: dict[str, Any] = {"save_s": time.perf_counter() - t0, "save_plan_s": writer.planned - t0}
            dist.barrier()
            w1 = time.time()
            into = state(-1.0)
            dist.barrier()
            t0, w2 = time.perf_counter(), time.time()
            dcp.load(into, storage_reader=reader)
            out.update(load_s=time.perf_counter() - t0, load_plan_s=reader.planned - t0)
            dist.barrier()
            out.update(ok=bool(into["w"].to_local()[0, 0].item() == rank), save=[w0, w1], load=[w2, time.time()])
            return out

        warm = Path(spec["dir"]) / "warm-up"  # untimed: each door's first save and load (imports, sessions)
        dcp.save(state(float(rank)), storage_writer=dcp.FileSystemWriter(warm))
        dcp.load(state(-1.0), storage_reader=dcp.FileSystemReader(warm))
        path = Path(spec["dir"]) / "step-1"
        mine = save_load(_timed(dcp.FileSystemWriter)(path), _timed(dcp.FileSystemReader)(path))
        if spec.get("sockets"):  # the same through ckptstage.dcp, each rank on its node's daemon
            from ckptstage.dcp import Reader, Writer

            sock = spec["sockets"][rank * len(spec["sockets"]) // world]
            dcp.save(state(float(rank)), storage_writer=Writer("dcp-peer", 1, socket=sock))
            dcp.load(state(-1.0), storage_reader=Reader("dcp-peer", 1, socket=sock))
            ours = save_load(_timed(Writer)("dcp-peer", 2, socket=sock), _timed(Reader)("dcp-peer", 2, socket=sock))
            mine.update({f"ours_{k}": v for k, v in ours.items()})
        got: list[Any] = [None] * world
        dist.all_gather_object(got, mine)
        if rank == 0:
            Path(spec["out"]).write_text(json.dumps({"ranks": got, "save": mine["save"], "load": mine["load"]}))
    finally:
        dist.destroy_process_group()


def dcp_main(world: int, directory: Path, out: Path, rows: int, sockets: list[str]) -> None:
    import torch.multiprocessing as tmp

    spec = {"port": h.free_port(), "dir": str(directory), "out": str(out), "rows": rows, "sockets": sockets}
    tmp.spawn(dcp_rank, args=(world, spec), nprocs=world, join=True)


def dcp_peer(world: int, work: Path, rows: int, sockets: Sequence[Path] = ()) -> dict[str, float]:
    """DCP's FileSystemWriter/Reader at ``world`` gloo ranks: times (untraced; with ``sockets``, the daemons
    of the nodes, the same through ``ckptstage.dcp`` too), then metadata operations (a second run under
    ``strace -f``, DCP's own only), on the checkpoint's directory. Each time is the slowest rank's."""
    out: dict[str, float] = {"world": world, "nodes": len(sockets)}
    for traced in (False, True):
        d = work / f"dcp-{world}-{int(traced)}"
        d.mkdir(parents=True)
        result, log = work / f"dcp-{world}.json", work / f"dcp-{world}.strace"
        cmd = [sys.executable, str(ENTRY), "--dcp-child", str(world), str(d), str(result), str(rows),
               *([] if traced else map(str, sockets))]
        if traced:
            cmd = [*strace_from_start(log), *cmd]
        with open(work / f"dcp-{world}.out", "w+") as output:
            if subprocess.run(cmd, stdout=output, stderr=subprocess.STDOUT, timeout=1200).returncode:
                output.seek(0)
                raise RuntimeError(f"the DCP peer at W = {world} failed:\n{output.read()[-3000:]}")
        res = json.loads(result.read_text())
        if not all(r["ok"] and r.get("ours_ok", True) for r in res["ranks"]):
            raise RuntimeError("a DCP load read wrong values")
        if traced:
            counts = count_trace(log, d, {"save": tuple(res["save"]), "load": tuple(res["load"])})
            out["save_ops"], out["load_ops"] = metadata(counts["save"]), metadata(counts["load"])
            out["load_opens_per_rank"] = (counts["load"]["open"] + counts["load"]["create"]) / world
        else:
            for key in res["ranks"][0]:
                if key.endswith("_s"):
                    out[key] = max(r[key] for r in res["ranks"])
        shutil.rmtree(d, ignore_errors=True)
    return out


def dcp_against_ours(world: int, work: Path, droot: Path, rows: int, nodes: int) -> dict[str, float]:
    """The DCP peer at ``world`` ranks; with ``nodes`` daemons (one shared directory), also through ckptstage.dcp."""
    if not nodes:
        return dcp_peer(world, work, rows)
    arena = rows * COLS * 4 + (256 << 10)
    daemons = start_daemons(droot / f"dcp{world}", work / f"dcp{world}-shared", nodes, -(-world // nodes), arena)
    try:
        return dcp_peer(world, work, rows, [d.socket for d in daemons])
    finally:
        stop_daemons(daemons)
