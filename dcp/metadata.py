"""DCP's global ``Metadata`` of a ckptstage step, built from its parts' manifests (nothing pickled is stored).

The tree of one part (the reading rank's own at the world size it was saved
at, rank 0's at another) is decoded with a placeholder for every tensor and
flattened by DCP's own traversal rules, so that a state saved with the plain
API or through :class:`ckptstage.dcp.Writer` (both store the nested tree:
``{"optim": {"param_groups": [{"lr": ...}]}}``) has the keys DCP gives it
(``optim.param_groups.0.lr``), and ``planner_data`` the paths DCP's
``DefaultSavePlanner`` records (``("optim", "param_groups", 0, "lr")``:
dict keys as ``str``, list positions as ``int``), which DCP's
``_EmptyStateDictLoadPlanner`` (``dcp_to_torch_save``,
``_load_state_dict_from_keys``) nests the state by. A step the writer
stored before it nested (a flat tree keyed by DCP key) keeps those keys,
each its own one-element path.

- a sharded tensor (a ``"D"`` node): one ``ChunkStorageMetadata`` per stored fragment;
- a plain tensor of that part: one chunk covering it all;
- any other value: ``BytesStorageMetadata`` (a value the writer could keep only as
  ``torch.save`` bytes comes back as :class:`ckptstage.dcp.values.Opaque`).

A tree whose top-level values were themselves saved as single DCP values
(a planner with ``flatten_state_dict=False``) is flattened again here, so
its keys are the flattened ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptstage.client import reshard, tree
from ckptstage.client.fileplan import dtype_from_name
from ckptstage.dcp import values

Path = tuple[str | int, ...]


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the step as a DCP key sees it: the fqn its bytes are stored under, and whether sharded."""

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    sharded: bool


@dataclass
class StepIndex:
    """What a reader needs beyond ``Metadata``: per DCP key, its tensor or its value."""

    tree_rank: int
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)   # decoded; tensors inside appear as TensorRef


def build(view: reshard.StepView, tree_rank: int) -> tuple[Metadata, StepIndex]:
    """The ``Metadata`` of the step ``view`` opened, as rank ``tree_rank``'s tree names its keys."""
    index = StepIndex(tree_rank)
    plain_fqns = view.plain_fqns(tree_rank)
    names = view.names(tree_rank)

    def plain(i: int) -> TensorRef:
        fqn = plain_fqns[i]
        dtype, shape = names[fqn]
        return TensorRef(fqn, dtype, shape, sharded=False)

    def sharded(node: dict[str, Any]) -> TensorRef:
        fqn = str(node["fqn"])
        return TensorRef(fqn, dtype_from_name(str(node["dtype"])), tuple(int(n) for n in node["shape"]), True)

    state = tree.unflatten(view.tree_of(tree_rank), plain, sharded)
    mappings: dict[str, Path] = {}

    def visit(path: Path, value: Any) -> None:
        key = ".".join(map(str, path))
        if key in mappings:
            raise ValueError(f"two keys of the checkpoint flatten to the DCP key {key!r}")
        mappings[key] = path
        if isinstance(value, TensorRef):
            index.tensors[key] = value
        else:
            index.values[key] = value

    if not isinstance(state, dict):
        raise ValueError(f"the checkpoint's state is a {type(state).__name__}, not a dict: DCP cannot load it")
    # The writer stores a value it could only keep as torch.save bytes in a one-key dict, where the value was.
    state = _with_opaque_values(state)
    traverse_state_dict(state, visit, keep_traversing=lambda v: isinstance(v, TensorRef))
    for fqn, node in view.sharded.items():  # sharded tensors only other ranks' trees name
        if fqn not in index.tensors and fqn not in mappings:
            index.tensors[fqn] = sharded(node)
            mappings[fqn] = (fqn,)

    md: dict[str, Any] = {}
    for key, ref in index.tensors.items():
        if ref.sharded:
            chunks = [ChunkStorageMetadata(torch.Size(frag.origin), torch.Size(frag.shape))
                      for frag in view.fragments_of(ref.fqn)]
        else:
            chunks = [ChunkStorageMetadata(torch.Size([0] * len(ref.shape)), torch.Size(ref.shape))]
        md[key] = TensorStorageMetadata(TensorProperties(dtype=ref.dtype), torch.Size(ref.shape), chunks)
    for key in index.values:
        md[key] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=md, planner_data=mappings), index


def _with_opaque_values(obj: Any) -> Any:
    """``obj`` with every value :func:`values.store_node` wrapped as :class:`values.Opaque`, at any depth
    DCP's traversal reaches (dicts and lists)."""
    obj = values.stored_value(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _with_opaque_values(v)) for k, v in obj.items())
    if isinstance(obj, list):
        return [_with_opaque_values(v) for v in obj]
    return obj
