"""``Reader``: DCP's ``StorageReader`` over a ckptstage step, saved through DCP or with the plain API.

``read_metadata`` finds the step (the newest complete one, agreed by every
rank, when none is named), opens every rank's part and rebuilds DCP's
``Metadata`` from their manifests (:mod:`ckptstage.dcp.metadata`).
``read_data`` fills each tensor ``ReadItem`` from the byte ranges of the
fragments that overlap its box (verified chunk by chunk, as ``Client.load``
reads), and hands non-tensor values to the planner: as values to one that
takes them (:class:`ckptstage.dcp.LoadPlanner`'s ``load_value``: nothing
is unpickled), as ``torch.save`` bytes to DCP's default planner.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptstage.client import errors, reshard, steps
from ckptstage.client.loadlease import LoadLease
from ckptstage.dcp import clients
from ckptstage.dcp import metadata as step_metadata
from ckptstage.dcp import values
from ckptstage.dcp.metadata import StepIndex, TensorRef
from ckptstage.dcp.writer import parse_step
from ckptstage.protos import layout


class Reader(StorageReader):
    """Loads ``step`` of ``job`` (None: the newest complete step) through this node's ckptstage daemon.

    ``dcp.load(sd, storage_reader=Reader(job))``. Any world size and mesh
    can read any other's step; a step saved with ``Client.save`` loads too,
    its keys flattened as DCP flattens a state dict. The process's ``Client``
    for the job (:mod:`ckptstage.dcp.clients`) is made in ``read_metadata``
    (collective with a process group) on first use.
    """

    def __init__(self, job: str, step: int | None = None, *, socket: str | os.PathLike[str] | None = None) -> None:
        self.job = job
        self.step = None if step is None else parse_step(step)
        self.socket = socket
        self.loaded_step: int | None = None  # the step read_metadata found
        self._view: reshard.StepView | None = None
        self._opened: steps.OpenStep | None = None
        self._index: StepIndex | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = parse_step(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_metadata(self, *args: Any, **_: Any) -> Metadata:
        """Opens the step and returns its ``Metadata``; collective with a process group (every rank reads).

        (No parameter named ``kwargs``: DCP would then call it again per rank after a failure, a second
        round of collectives that only some ranks might enter.)
        """
        self._close_view()
        client = clients.session(self.job, self.socket).client
        step = self.step if self.step is not None else client.latest()
        if step is None:
            raise errors.CheckpointNotFound(f"job {self.job!r} has no complete step to load")
        self._opened = client.open_step(step)
        located = self._opened.located
        self.loaded_step = located.step
        self._view = self._opened.view
        tree_rank = located.tree_rank(client.rank, client.world_size)
        md, self._index = step_metadata.build(self._view, tree_rank)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._view is None or self._index is None or self._opened is None:
            raise RuntimeError("Reader.read_data before read_metadata")
        try:
            with LoadLease(self._opened.conn):  # the node's drains wait while this rank reads
                for item in plan.items:
                    if item.type == LoadItemType.BYTE_IO:
                        self._load_value(item, planner)
                    else:
                        self._read_tensor(item, planner)
        except layout.ChecksumMismatch as e:
            raise errors.CorruptCheckpoint(f"no copy of {self.job} step {self.loaded_step} verifies: {e}") from e
        finally:
            self.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def close(self) -> None:
        self._close_view()

    # --- internals --------------------------------------------------------------------

    def _read_tensor(self, item: ReadItem, planner: LoadPlanner) -> None:
        assert self._view is not None and self._index is not None
        ref = self._index.tensors[item.storage_index.fqn]
        chunk_origin = item.storage_index.offset or torch.Size([0] * len(ref.shape))
        box = (tuple(int(o) + int(s) for o, s in zip(chunk_origin, item.storage_offsets)),
               tuple(int(n) for n in item.lengths))
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != box[1]:
            raise ValueError(f"DCP key {item.dest_index.fqn!r}: the planner's tensor has shape {list(target.shape)}, "
                             f"the read is of {list(box[1])}")
        if target.device.type == "cpu" and target.dtype == ref.dtype:
            self._view.read_box(ref.fqn, box, target, self._index.tree_rank)
        else:  # another device or dtype: read, then copy (DCP converts dtypes the same way)
            tmp = torch.empty(box[1], dtype=ref.dtype)
            self._view.read_box(ref.fqn, box, tmp, self._index.tree_rank)
            target.copy_(tmp)
        planner.commit_tensor(item, target)

    def _load_value(self, item: ReadItem, planner: LoadPlanner) -> None:
        """A value to a planner that takes values (:class:`ckptstage.dcp.LoadPlanner`), else as the bytes
        DCP's default planner reads: ``torch.save`` of it, or the ``torch.save`` bytes stored as they were."""
        assert self._index is not None
        value = self._index.values[item.storage_index.fqn]
        if isinstance(value, values.Opaque):
            planner.load_bytes(item, io.BytesIO(value.raw))
            return
        value = self._materialize(value)
        load_value = getattr(planner, "load_value", None)
        if load_value is not None:
            load_value(item, value)
            return
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        planner.load_bytes(item, buf)

    def _materialize(self, value: Any) -> Any:
        """A value with its tensors read (a tuple of tensors is one value to DCP)."""
        assert self._view is not None and self._index is not None
        if isinstance(value, TensorRef):
            return self._view.read_full(value.fqn, self._index.tree_rank)
        if isinstance(value, (list, tuple)):
            out = [self._materialize(v) for v in value]
            return out if isinstance(value, list) else tuple(out)
        if isinstance(value, dict):
            return type(value)((k, self._materialize(v)) for k, v in value.items())
        return value

    def _close_view(self) -> None:
        if self._opened is not None:
            self._opened.close()
            self._opened = None
        self._view = None
