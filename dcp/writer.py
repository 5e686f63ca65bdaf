"""``Writer``: DCP's ``StorageWriter`` (and ``AsyncStager``) over a ckptstage ``Client``.

Each rank's write items become one ``tree.Flat`` saved with
``Client.save_flat``: every tensor item is a fragment of its global tensor
(fqn = the DCP key), and the tree is the state's own nesting
(``{"model": {"fc.weight": {"D": ...}}}``, see :func:`nest`),
with the value's node for each non-tensor item. A DCP-saved step is
therefore in the same format as a plain ``Client.save`` of the same state
with DTensors: ``Client.load`` returns the nested state, and
:class:`ckptstage.dcp.Reader` reads either. No metadata file is written:
DCP's global ``Metadata`` (``planner_data`` included) is rebuilt from the
parts' manifests when the step is read.

``dcp.async_save`` uses the writer as its stager: ``stage`` is the copy into
the daemon's shared memory (the trainer blocks for that copy only; no file
is written by the trainer process), and the background ``save`` only waits
for the commits.
"""

from __future__ import annotations

import io
from collections import OrderedDict
import math
import logging
import os
import socket as socketlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner import SavePlanner as DcpSavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptstage.client import Client, SaveHandle, shards, tree
from ckptstage.client.dist import gather
from ckptstage.dcp import clients, values
from ckptstage.dcp.planners import SavePlanner

log = logging.getLogger(__name__)

_Key = tuple[str, tuple[int, ...]]  # a tensor item: (fqn, chunk offsets)
Path = tuple[str | int, ...]  # where a DCP key sits in the state: dict keys as str, list positions as int
_PLAIN_KEYS = (str, int, float, bool, type(None))


@dataclass
class _Staged:
    """What ``stage`` saved: the save in flight and the items it covers (this rank's local plan)."""

    handle: SaveHandle
    keys: set[tuple[str, tuple[int, ...] | None]]


def parse_step(checkpoint_id: Any) -> int:
    """A DCP ``checkpoint_id`` as a ckptstage step: an int, or a str of digits."""
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return checkpoint_id
    if isinstance(checkpoint_id, str) and checkpoint_id.isdigit():
        return int(checkpoint_id)
    raise ValueError(f"checkpoint_id {checkpoint_id!r} is not a ckptstage step number; give the step as an int "
                     "(the job is the Writer's / Reader's)")


class Writer(StorageWriter, AsyncStager):
    """Saves a DCP checkpoint as ``step`` of ``job`` through this node's ckptstage daemon.

    ``dcp.save(sd, storage_writer=Writer(job, step))`` returns on every rank
    once the step is complete: committed on the local tier when all ranks
    run on one node, on the shared tier when they span nodes. With
    ``dcp.async_save`` the writer is its own stager (see the module
    docstring). ``timeout`` bounds each wait for a commit (seconds; None:
    no bound). The process's ``Client`` for the job (see
    :mod:`ckptstage.dcp.clients`) is made at the first collective point
    (``set_up_storage_writer`` or ``stage``) and kept for the next checkpoint.
    """

    _synchronize_after_execute = False  # stage() returns once the copy is done: nothing to synchronize

    def __init__(self, job: str, step: int, *, socket: str | os.PathLike[str] | None = None,
                 timeout: float | None = None) -> None:
        self.job = job
        self.step = parse_step(step)
        self.socket = socket
        self.timeout = timeout
        self.is_coordinator = False
        self._session: clients.Session | None = None
        self._local_items: list[WriteItem] = []
        self._paths: dict[str, Path] = {}  # DCP key -> its path in the state (the plan's planner_data)
        self._staged: _Staged | None = None

    # --- StorageWriter ----------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = parse_step(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen from a bare checkpoint_id: a Writer names its job

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self._ensure_client()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if plan.usable:  # with plan caching an unchanged plan arrives empty: keep the last one
            self._local_items = list(plan.items)
            self._paths = dict(plan.planner_data) if isinstance(plan.planner_data, Mapping) else {}
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: DcpSavePlanner) -> Future[list[WriteResult]]:
        """Saves this rank's items (unless ``stage`` did) and waits until its part is committed locally."""
        client = self._ensure_client()
        staged, self._staged = self._staged, None
        if staged is not None:
            handle = staged.handle
            unstaged = [it for it in plan.items if _item_key(it) not in staged.keys]
            if unstaged:
                raise ValueError(f"async_save: {len(unstaged)} item(s) of the plan, e.g. "
                                 f"{unstaged[0].index.fqn!r}, are not what Writer.stage() saved; a planner "
                                 "that changes the items needs async_stager=DefaultStager(...)")
        else:
            flat = build_flat(self._local_items, plan.items, lambda it: _resolve(planner, it), self._paths,
                              getattr(planner, "original_state_dict", None))  # ckptstage's SavePlanner keeps it
            handle = client.save_flat(self.step, flat)
        handle.wait("local", self.timeout)
        results = [_result(it, client.rank) for it in plan.items]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Returns once the step is complete (loadable): every rank's part is committed by then.

        DCP's pickled ``metadata`` is not stored: readers rebuild it from the
        parts' manifests (see :mod:`ckptstage.dcp.metadata`).
        """
        client = self._ensure_client()
        assert self._session is not None
        if self._session.multi_node:
            client.wait_step(self.step, "shared", self.timeout)
        else:
            # All parts are on this node: its daemon writes the step's local commit record.
            # Only the coordinator runs finish(): not the collective form.
            client.wait_step(self.step, "local", self.timeout, collective=False)

    # --- AsyncStager ------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copies ``state_dict`` into the daemon's arena and returns once the copy is done.

        This is the only copy of an ``async_save``: the background ``save``
        then plans (from the tensors' metadata) and waits for the commits.
        Collective: every rank calls it (``async_save`` does). Replicated
        tensors (the same item on several ranks) are stored by the lowest
        rank that holds them.
        """
        client = self._ensure_client()
        planner = SavePlanner()
        planner.set_up_planner(state_dict, is_coordinator=client.rank == 0)
        plan = planner.create_local_plan()
        items = plan.items
        mine = _lowest_rank_items(items, client.rank)
        flat = build_flat(items, mine, lambda it: _resolve(planner, it), plan.planner_data, state_dict)
        handle = client.save_flat(self.step, flat)
        handle.wait_copied()  # the trainer may go on; write_data() waits for the commit in the background
        self._staged = _Staged(handle, {_item_key(it) for it in items})
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is done."""

    def close(self) -> None:
        """Lets go of the process's client (it stays open for the next checkpoint; see clients.close_all)."""
        self._session = None

    def __getstate__(self) -> Any:
        raise TypeError("a ckptstage Writer cannot be sent to another process (AsyncCheckpointerType.PROCESS): "
                        "use the default thread executor; the daemon already does the writing out of process")

    # --- internals --------------------------------------------------------------------

    def _ensure_client(self) -> Client:
        """The process's Client for the job (made on first use: collective with a process group)."""
        if self._session is None:
            self._session = clients.session(self.job, self.socket)
        return self._session.client


def build_flat(tree_items: Iterable[WriteItem], stored: Iterable[WriteItem],
               resolve: Callable[[WriteItem], Any], paths: Mapping[str, Path] | None = None,
               state: Any = None) -> tree.Flat:
    """The Flat of a rank's part: a tree node for every item of ``tree_items`` (its local plan), nested as
    ``state`` (or ``paths``, DCP key -> path) nests it, and the bytes of the tensor items of ``stored`` (what
    the global plan left it to write) as fragments."""
    nodes: dict[str, Any] = {}
    for item in tree_items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            nodes[fqn] = values.store_node(resolve(item).getvalue())
        elif fqn not in nodes:
            td = item.tensor_data
            assert td is not None
            nodes[fqn] = {"D": {"fqn": fqn, "dtype": str(td.properties.dtype).removeprefix("torch."),
                                "shape": list(td.size)}}
    flat = tree.Flat(nest(nodes, paths or {}, state))
    for item in stored:
        if item.type == WriteItemType.BYTE_IO:
            continue
        td = item.tensor_data
        assert td is not None
        if item.index.fqn not in nodes:
            raise ValueError(f"DCP key {item.index.fqn!r} is in this rank's final plan but not in its local plan")
        sizes = tuple(int(s) for s in td.chunk.sizes)
        if math.prod(sizes) == 0:
            continue  # an empty shard holds no bytes
        t = resolve(item)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"DCP key {item.index.fqn!r}: the planner resolved a tensor item to "
                            f"{type(t).__name__}, not a tensor")
        t = t.detach()
        if tuple(t.shape) != sizes:
            raise ValueError(f"DCP key {item.index.fqn!r}: the planner resolved a chunk of shape "
                             f"{list(t.shape)}, the plan says {list(sizes)}")
        offsets = tuple(int(o) for o in td.chunk.offsets)
        flat.tensors.append(t)
        flat.paths.append(f"[{item.index.fqn!r}]" + (f"@{list(offsets)}" if any(offsets) else ""))
        flat.fqns.append(item.index.fqn)
        flat.fragments.append(shards.Fragment(item.index.fqn, tuple(int(s) for s in td.size), offsets))
    return flat


# --- the tree: the DCP items nested back into the state they came from -------------------
#
# DCP flattens a state before planning: {"model": {"fc.weight": t}} becomes the key model.fc.weight, and the
# planner records each key's path in the plan's planner_data (its mappings: ("model", "fc.weight")). The writer
# stores the tree a plain Client.save of the state stores, so that Client.load gives the nested state back
# and a reader rebuilds DCP's planner_data from it:
# - from the state itself where the planner kept it (ckptstage's SavePlanner, the writer's own staging):
#   containers, key types (an optimizer's int keys) and empty containers as Client.save keeps them;
# - else from the paths (DCP's default planner): dict keys are then the str DCP made of them;
# - a key that neither names (a planner that does not flatten) stays at the top.

def nest(nodes: Mapping[str, Any], paths: Mapping[str, Path], state: Any = None) -> Any:
    """The tree node holding ``nodes`` (DCP key -> tree node) where ``paths`` (or ``state``) put them."""
    if isinstance(state, Mapping):
        return _from_state(nodes, paths, state)
    return _from_paths(nodes, paths)


def key_node(key: Any) -> Any:
    """A dict key's tree node: itself where the tree encodes it plainly, else the ``str`` DCP joins it by
    (so the stored key path joins to the DCP key, and the tensor's fqn is that key)."""
    if type(key) not in _PLAIN_KEYS:
        return {"s": str(key)}
    if key is None:
        return {"N": 0}
    if type(key) is float:
        return {"f": key.hex()}
    return {{str: "s", int: "i", bool: "b"}[type(key)]: key}


def _from_state(nodes: Mapping[str, Any], paths: Mapping[str, Path], state: Mapping[Any, Any]) -> Any:
    """The tree of ``state``'s containers with each DCP leaf replaced by its node (DCP's traversal:
    mappings and the lists it took apart are containers; everything else it reached is a leaf)."""
    leaf_at = {tuple(paths.get(fqn, (fqn,))): fqn for fqn in nodes}
    used: set[str] = set()

    def build(obj: Any, path: Path) -> Any:
        fqn = leaf_at.get(path)
        if fqn is not None:
            used.add(fqn)
            return nodes[fqn]
        if isinstance(obj, Mapping):
            return {"o" if isinstance(obj, OrderedDict) else "d":
                    [[key_node(k), build(v, path + (str(k),))] for k, v in obj.items()]}
        if isinstance(obj, list):
            return {"l": [build(v, path + (i,)) for i, v in enumerate(obj)]}
        raise ValueError(f"DCP key {'.'.join(map(str, path))!r}: the state holds a value there that the "
                         "planner made no write item of")

    root = build(state, ())
    missing = [fqn for fqn in nodes if fqn not in used]
    if missing:
        raise ValueError(f"DCP key {missing[0]!r} of the plan is not where the planner's mappings put it in the "
                         f"state ({len(missing)} such key(s))")
    return root


class _Branch(dict):  # type: ignore[type-arg]
    """A container being assembled by :func:`_from_paths` (a leaf is any other object)."""


def _from_paths(nodes: Mapping[str, Any], paths: Mapping[str, Path]) -> Any:
    root = _Branch()
    for fqn, node in nodes.items():
        path = tuple(paths.get(fqn, (fqn,)))
        if not path:
            raise ValueError(f"DCP key {fqn!r}: the planner's mappings give it an empty path")
        cur = root
        for i, seg in enumerate(path[:-1]):
            nxt = cur.setdefault(seg, _Branch())
            if not isinstance(nxt, _Branch):
                raise ValueError(f"DCP key {fqn!r}: its path runs through the value of another key, "
                                 f"{'.'.join(map(str, path[:i + 1]))!r}")
            cur = nxt
        if path[-1] in cur:
            raise ValueError(f"DCP key {fqn!r}: another key of the plan has the same path {list(path)}")
        cur[path[-1]] = _Leaf(node)
    return _encode(root)


class _Leaf:
    __slots__ = ("node",)

    def __init__(self, node: Any) -> None:
        self.node = node


def _encode(branch: _Branch) -> Any:
    """A branch as a tree node: a list where DCP's path segments are positions (ints), else a dict."""
    def child(v: Any) -> Any:
        return _encode(v) if isinstance(v, _Branch) else v.node

    if branch and all(type(k) is int and k >= 0 for k in branch):
        return {"l": [child(branch[i]) if i in branch else {"N": 0} for i in range(max(branch) + 1)]}
    return {"d": [[key_node(k), child(v)] for k, v in branch.items()]}


def _resolve(planner: DcpSavePlanner, item: WriteItem) -> Any:
    """The item's data; a non-tensor value of DCP's default planner in ckptstage's encoding where it can be.

    ``DefaultSavePlanner`` makes a value's bytes with ``torch.save`` of the
    state's object; ckptstage stores that object as a value instead (never
    a pickle) and keeps the ``torch.save`` bytes only for objects it cannot
    encode.
    """
    if (item.type == WriteItemType.BYTE_IO and isinstance(planner, DefaultSavePlanner)
            and type(planner).transform_object is DefaultSavePlanner.transform_object):
        obj = planner.lookup_object(item.index)
        try:
            return io.BytesIO(values.encode(obj, item.index.fqn))
        except (TypeError, ValueError):
            pass
    return planner.resolve_data(item)


def _lowest_rank_items(items: list[WriteItem], rank: int) -> list[WriteItem]:
    """The tensor items this rank stores: those no lower rank also holds (collective over the default group)."""
    keys = [_item_key(it) for it in items if it.type != WriteItemType.BYTE_IO]
    if not (dist.is_available() and dist.is_initialized()):
        return items
    every = gather(keys)
    lower = {k for r in range(rank) for k in every[r]}
    return [it for it in items if it.type != WriteItemType.BYTE_IO and _item_key(it) not in lower]


def _item_key(item: WriteItem) -> tuple[str, tuple[int, ...] | None]:
    off = item.index.offset
    return item.index.fqn, (None if off is None else tuple(int(o) for o in off))


def _result(item: WriteItem, rank: int) -> WriteResult:
    size = item.tensor_storage_size() if item.type != WriteItemType.BYTE_IO else 0
    return WriteResult(index=item.index, size_in_bytes=size or 0, storage_data={"rank": rank})


__all__ = ["Writer", "build_flat", "nest", "parse_step"]
