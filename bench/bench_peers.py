"""The peer tier: what replication costs the trainer, how fast it moves, and a lost node's restore from it.

    .venv/bin/python bench/bench_peers.py                       # 512 MiB state, 5 rounds, ~3 min
    .venv/bin/python bench/bench_peers.py --mib 1024 --rounds 3 --json out.json

Four real ``ckptstaged`` on one machine stand for four nodes: A, B and C with
``[peers]`` on loopback ports (one token), D without; all on one shared
directory, drained every step. The state is ``_harness.make_state`` (large
fp32 tensors).

1. **Blocked time.** A trainer on A saves ``--rounds`` steps of a job whose
   nodes are A and B (its part replicated to B) and as many of a job on A
   alone (nothing replicated), alternating, ``--compute-s`` of idle
   "training" after each: ``save()`` + ``wait_snapshot()`` is what the
   trainer waits for. Target: replication on within 1.05x of off (medians).
2. **Replication bandwidth.** Each replica's send, commit to commit on the
   receiver (A's log: bytes over seconds), next to a plain TCP copy of the
   same bytes over loopback in this process (``sendall`` into ``recv_into``
   of a preallocated buffer): the wire's own speed here.
3. **Restore on a replacement node.** A is lost (SIGKILL, its local tier
   deleted). A trainer on C (the job now on C and B) loads the newest step:
   C fetches A's part from B's memory, checked block by block, into its
   replica store, and reads it (``last_load_tier`` must be "peer"). Next to
   it, on the same bytes: a trainer on D loads the step from the shared tier
   cold (evicted from the page cache), and ``torch.load`` of the state saved
   with ``torch.save`` on the same disk, cold. Target: from the peer at
   least 2x faster than the cold shared read.

Not a test: exit 0 unless ``--strict`` and a target is missed.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from _harness import (Daemon, Row, drop_page_cache, free_port, machine_info, make_state, print_machine,
                      print_table, run_args, settle, state_bytes, verdict, workdir, write_json)
from ckptstage.client import Client

MiB = 1 << 20
TOKEN = "bench-peers-" + "0123456789abcdef" * 2


def nodes(root: Path, state_bytes_: int) -> dict[str, Daemon]:
    token = root / "peer.token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    shared = root / "shared"
    budget = f"{max(1024, 4 * state_bytes_ // MiB)}MiB"  # the trainer's arena, a kept copy, and replicas
    out = {}
    for name in "ABCD":
        settings: dict[str, Any] = {"arena.max_bytes": budget, "shared.drain_every": 1}
        if name != "D":
            port = free_port()
            settings.update({"peers.listen": f"127.0.0.1:{port}", "peers.advertise": f"127.0.0.1:{port}",
                             "peers.token_file": str(token)})
        d = Daemon(root / name, root / name / "local", shared, **settings)
        d.peer = settings.get("peers.advertise", "")
        out[name] = d.start()
    return out


def blocked(client: Client, step: int, state: Any) -> tuple[float, Any]:
    began = time.perf_counter()
    h = client.save(step, state)
    h.wait_snapshot()
    return time.perf_counter() - began, h


def tcp_copy_s(nbytes: int) -> float:
    """A plain TCP copy of ``nbytes`` over loopback: sendall of one buffer into recv_into of another."""
    src = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes // (1 << 20)))
    dst = bytearray(len(src))
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def receive() -> None:
        conn, _ = server.accept()
        view, got = memoryview(dst), 0
        while got < len(dst):
            n = conn.recv_into(view[got:], min(1 << 20, len(dst) - got))
            if not n:
                break
            got += n
        conn.close()

    t = threading.Thread(target=receive)
    t.start()
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(src)
    t.join()
    elapsed = time.perf_counter() - began
    server.close()
    return elapsed


def replication_rates(log: Path, job: str) -> list[tuple[int, float]]:
    """(bytes, seconds) of each replica of ``job`` A sent, from its log."""
    pattern = re.compile(rf"replicated {job} step \d+ rank \d+ to \S+: (\d+) bytes in ([\d.]+)s")
    return [(int(m[1]), float(m[2])) for m in pattern.finditer(log.read_text())]


def main() -> int:
    p = run_args(__doc__, "the four nodes' tiers and the torch.save file go")
    p.add_argument("--mib", type=int, default=512, help="state size in MiB (default 512)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--compute-s", type=float, default=3.0, help="idle 'training' after each save (default 3)")
    args = p.parse_args()
    state = make_state(args.mib * MiB)
    nbytes = state_bytes(state)
    results: dict[str, Any] = {"state_bytes": nbytes, "rounds": args.rounds}
    with workdir(args.dir, "bench-peers-") as root:
        info = machine_info(root)
        print_machine(info)
        daemons = nodes(root, nbytes)
        a, b, c, d = (daemons[n] for n in "ABCD")
        try:
            on = Client("replicated", socket=a.socket, rank=0, world_size=1, arena_bytes=nbytes)
            # B takes replicas of the job only once a client of the job told it the job's nodes.
            other = Client("replicated", socket=b.socket, rank=0, world_size=1, arena_bytes=0)
            for client in (on, other):
                client._session.join_peers(sorted([a.peer, b.peer]))
            off = Client("alone", socket=a.socket, rank=0, world_size=1, arena_bytes=nbytes)
            times: dict[str, list[float]] = {"on": [], "off": []}
            peer_s: list[float] = []
            for r in range(args.rounds + 1):  # round 0 warms both up, untimed
                for label, client in (("on", on), ("off", off)) if r % 2 else (("off", off), ("on", on)):
                    settle(args.settle)
                    s, h = blocked(client, r + 1, state)
                    h.wait("local")
                    committed = time.perf_counter()
                    if label == "on":
                        h.wait("peer", timeout=600)
                        peer_s.append(time.perf_counter() - committed)
                    h.wait("shared", timeout=600)
                    if r:
                        times[label].append(s)
                        print(f"  round {r} {label:3}: blocked {s * 1e3:.0f} ms"
                              + (f", replicas committed {peer_s[-1]:.2f}s after the local commit"
                                 if label == "on" else ""))
                    time.sleep(args.compute_s)
            on.close()
            other.close()
            off.close()
            ratio = statistics.median(times["on"]) / statistics.median(times["off"])
            print_table("Trainer blocked per save (save + wait_snapshot)", [
                Row("replication on", statistics.median(times["on"]), nbytes, times["on"]),
                Row("replication off", statistics.median(times["off"]), nbytes, times["off"])], "replication off")
            sent = [(n, s) for n, s in replication_rates(a.log, "replicated") if n >= nbytes // 2]
            tcp = [tcp_copy_s(nbytes) for _ in range(3)]
            rep_s = statistics.median([s for _, s in sent]) if sent else float("nan")
            print_table("Replication of one part, A -> B (commit to commit)", [
                Row("ckptstage replica", rep_s, nbytes, [s for _, s in sent]),
                Row("plain TCP copy", statistics.median(tcp), nbytes, tcp)], "ckptstage replica")

            # A is lost; the job restarts on C and B.
            step = args.rounds + 1
            a.kill(signal.SIGKILL)
            shutil.rmtree(a.local)
            torch_file = root / "state.pt"
            torch.save(state, torch_file)
            os.sync()
            drop_page_cache(torch_file)
            drop_page_cache(root / "shared")
            settle(args.settle)
            began = time.perf_counter()
            with Client("replicated", socket=c.socket, rank=0, world_size=1) as reader:
                reader._session.join_peers(sorted([c.peer, b.peer]))
                got = reader.load(step)
                peer_load = time.perf_counter() - began
                assert reader.last_load_tier == "peer", reader.last_load_tier
            assert all(torch.equal(got[k], state[k]) for k in state if isinstance(state[k], torch.Tensor))
            del got
            settle(args.settle)
            began = time.perf_counter()
            with Client("replicated", socket=d.socket, rank=0, world_size=1) as reader:
                got = reader.load(step)
                shared_load = time.perf_counter() - began
                assert reader.last_load_tier == "shared", reader.last_load_tier
            del got
            settle(args.settle)
            began = time.perf_counter()
            got = torch.load(torch_file)
            torch_load = time.perf_counter() - began
            del got
            print_table("Restore of the lost node's part on a replacement node (Client + load)", [
                Row("from B's memory (peer)", peer_load, nbytes),
                Row("shared tier, cold", shared_load, nbytes),
                Row("torch.load, cold", torch_load, nbytes)], "from B's memory (peer)")
            lines = [verdict("blocked time, replication on / off", ratio, "<=", 1.05, "x"),
                     verdict("restore from a peer vs cold shared read (speed-up)", shared_load / peer_load, ">=",
                             2.0, "x")]
            print("\nTargets")
            for line, _ in lines:
                print(line)
            results.update({"blocked_on_s": times["on"], "blocked_off_s": times["off"], "blocked_ratio": ratio,
                            "replica_s": [s for _, s in sent], "tcp_copy_s": tcp, "peer_commit_s": peer_s,
                            "restore_peer_s": peer_load, "restore_shared_cold_s": shared_load,
                            "torch_load_cold_s": torch_load, "machine": info})
            write_json(args.json, results)
            return 1 if args.strict and not all(ok for _, ok in lines) else 0
        finally:
            for daemon in daemons.values():
                daemon.stop()


if __name__ == "__main__":
    raise SystemExit(main())
