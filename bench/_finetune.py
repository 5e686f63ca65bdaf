"""What the fine-tuning benchmarks share: GPT-2 124M trained fully or with LoRA, a daemon with both tiers,
and what a tier holds on disk (``bench_incremental.py``, ``bench_lora_retention.py``)."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

import _harness as h

LORA_RANK = 8
LORA_ALPHA = 16


# ------------------------------------------------------------------ the trainers


def _lora_hook(module: Any, args: tuple[Any, ...], out: Any) -> Any:
    """``c_attn(x) + x A^T B^T * alpha/r``: the adapter's low-rank update beside the frozen projection."""
    return out + (args[0] @ module.lora_A.t() @ module.lora_B.t()) * module.lora_scale


class Trainer:
    """GPT-2 124M from its config and AdamW: every parameter trained, or rank-8 LoRA over a frozen base."""

    def __init__(self, lora: bool, batch: int, seq: int) -> None:
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        self.model = GPT2LMHeadModel(GPT2Config())
        self.batch, self.seq = batch, seq
        self.step = 0
        if lora:
            for p in self.model.parameters():
                p.requires_grad_(False)
            trained = []
            blocks: Any = self.model.transformer.h
            for block in blocks:
                proj = block.attn.c_attn  # transformers' Conv1D: y = x @ weight + bias, weight is (in, out)
                n_in, n_out = proj.weight.shape
                proj.lora_A = torch.nn.Parameter(torch.randn(LORA_RANK, n_in) / math.sqrt(n_in))
                proj.lora_B = torch.nn.Parameter(torch.zeros(n_out, LORA_RANK))  # the update starts at zero
                proj.lora_scale = LORA_ALPHA / LORA_RANK
                proj.register_forward_hook(_lora_hook)
                trained += [proj.lora_A, proj.lora_B]
            self.opt = torch.optim.AdamW(trained, lr=1e-3)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=6e-4, weight_decay=0.1)
        self.trained = [p for g in self.opt.param_groups for p in g["params"]]
        self.note = (f"GPT-2 124M fp32, {sum(p.numel() for p in self.model.parameters()) / 1e6:.1f} M parameters, "
                     f"{sum(p.numel() for p in self.trained) / 1e6:.2f} M trained"
                     + (f" (LoRA rank {LORA_RANK} on attn.c_attn, base frozen)" if lora else ""))

    def train(self, steps: int) -> float:
        """``steps`` optimizer steps on random tokens; their wall time."""
        import torch

        self.model.train()
        with h.Timer() as t:
            for _ in range(steps):
                ids = torch.randint(0, self.model.config.vocab_size, (self.batch, self.seq))
                self.model(input_ids=ids, labels=ids).loss.backward()
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                self.step += 1
        return t.s

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step}


# ------------------------------------------------------------------ the peers


class Ckpt:
    """A daemon with a local and a shared tier under ``work/name`` keeping the last ``keep_last`` steps on each
    (the memory tier off: every load reads the disk), and one client per job."""

    def __init__(self, name: str, work: Path, daemon_root: Path, keep_last: int, **settings: Any) -> None:
        self.name = name
        self.local = work / name / "local"
        self.shared = work / name / "shared"
        self.daemon = h.Daemon(daemon_root / name, self.local, self.shared, metrics=True,
                               **{"memory.enabled": False, "local.keep_last": keep_last,
                                  "shared.keep_last": keep_last, **settings}).start()
        self.clients: dict[str, Any] = {}

    def client(self, job: str) -> Any:
        from ckptstage.client import Client

        if job not in self.clients:
            self.clients[job] = Client(job, socket=self.daemon.socket)
        return self.clients[job]

    def close_client(self, job: str) -> None:
        c = self.clients.pop(job, None)
        if c is not None:
            c.close()

    def stop(self) -> None:
        for job in list(self.clients):
            self.close_client(job)
        self.daemon.stop()

    def metric(self, scraped: dict[str, float], name: str, tier: str | None = None) -> float:
        return scraped.get(f'{name}{{tier="{tier}"}}' if tier else name, 0.0)


def files_under(path: Path, skip: str = "") -> dict[Path, int]:
    """Regular files under ``path`` and their sizes, leaving out what retention removes during the walk
    (the daemons delete old steps and sweep chunks in the background) and directories named ``skip``."""
    out: dict[Path, int] = {}
    for parent, dirs, names in os.walk(path):  # a directory gone meanwhile is skipped, not an error
        dirs[:] = [d for d in dirs if d != skip]
        for n in names:
            try:
                st = os.lstat(os.path.join(parent, n))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                out[Path(parent, n)] = st.st_size
    return out


def chunk_files(tier: Path, job: str) -> dict[str, int]:
    """The chunks in a job's store on a tier, in its packs or files of their own (name -> bytes); the sweep's
    condemned ones excluded."""
    from ckptstage.daemon.catalog.chunkstore import CONDEMNED_DIR
    from ckptstage.protos import chunks, packs

    index = packs.StoreIndex(chunks.store_dir(tier, job))  # a fresh one: the store changes between calls
    index.refresh()
    found = {name: place.length for name, place in index.packed().items()}
    found.update({p.name: n for p, n in files_under(chunks.store_dir(tier, job), skip=CONDEMNED_DIR).items()
                  if chunks.is_chunk_name(p.name)})
    return found
