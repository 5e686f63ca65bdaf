"""Data-parallel training that checkpoints through ckptstage and resumes after a crash.

    ckptstaged &                                   # one daemon per node (see README.md here)
    torchrun --standalone --nproc-per-node 2 examples/torchrun_train.py --job demo-ddp

Kill the whole job at any moment (``kill -9``) and run the same line again: it
resumes from the newest step that every rank committed, and ends with the same
parameters, bit for bit, as a run that was never interrupted (its last line
prints their digest). Each rank saves its own part of every checkpoint (the
model, the optimizer and *its own* RNG state); the daemon persists it while
training goes on.
"""

import argparse
import hashlib
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ckptstage.client import Client

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--job", required=True, help="checkpoints are kept per job name: reuse it to resume")
p.add_argument("--socket", help="the daemon's socket (default: $CKPTSTAGE_SOCKET, else the daemon's default)")
p.add_argument("--steps", type=int, default=200, help="train up to this step")
p.add_argument("--save-every", type=int, default=20, help="checkpoint every this many steps")
p.add_argument("--step-time", type=float, default=0.0, help="sleep this long per step, to have time to kill it")
p.add_argument("--device", choices=["cpu", "cuda"],  # default: one GPU per local rank if there are enough
               default="cuda" if torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1)) else "cpu")
args = p.parse_args()

# torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address for each worker.
if args.device == "cuda":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")

torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))
model = DistributedDataParallel(net.to(device))  # train through model; save and load net's state
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
# Dropout draws from the global RNG, seeded per rank so that ranks drop different units:
# each rank's RNG state is its own, so each rank saves and restores it in its own part.
torch.manual_seed(1000 + rank)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch for ``step``: a pure function of (step, rank), so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(32, 16, generator=g)
    return x.to(device), x.sin().sum(dim=1, keepdim=True).to(device)


def rng_state() -> dict:
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def set_rng_state(rng: dict) -> None:
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


# Client() joins this rank to the job's checkpoint world: rank and world size come from the
# process group. Collective: every rank constructs it (rank 0 hands out this run's attempt id).
client = Client(args.job, socket=args.socket)

step = client.latest()  # the newest step complete on every rank (the same answer on all ranks), or None
if step is None:
    step = 0
else:
    # Without into=, every tensor comes back on the CPU; load_state_dict copies it into place.
    # (into= fills existing tensors in place instead, but it needs every tensor of the checkpoint to
    # exist already, and an optimizer has no state before its first step.)
    saved = client.load(step)  # this rank's own part: its RNG state, not rank 0's
    net.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    set_rng_state(saved["rng"])
    if rank == 0:
        print(f"resumed from step {step} (loss there {saved['loss']:.6f})", flush=True)

# save() returns at once and copies the tensors out in the background; protect() makes
# optimizer.step() wait for a copy still in progress, so no checkpoint sees half an update.
client.protect(optimizer)
handle = None
while step < args.steps:
    step += 1
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()  # DDP averages the gradients across ranks here
    optimizer.step()
    if step % args.save_every == 0 or step == args.steps:
        # Every rank saves its part; the step is complete (latest() sees it) once all parts are committed.
        # net's state, not DDP's: no "module." prefix, so it loads without DDP too.
        state = {"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                 "rng": rng_state(), "step": step, "loss": loss.item()}
        handle = client.save(step, state, metrics={"loss": loss.item()})
    time.sleep(args.step_time)

if handle is not None:
    handle.wait("local")  # the last checkpoint is on this node's disk (the drain to shared goes on)
client.close()

if rank == 0:
    digest = hashlib.sha256()
    for name, t in net.state_dict().items():
        digest.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
    print(f"final step={step} params_sha256={digest.hexdigest()}", flush=True)
dist.destroy_process_group()
