"""Non-tensor values of a DCP checkpoint in ckptstage's encoding: JSON tree nodes, never pickle.

DCP hands a storage backend every non-tensor value (a learning rate, a
``param_groups`` list, a step counter) as bytes that its planner produced;
DCP's default planners make them with ``torch.save`` and read them with
``torch.load``, which unpickles. ckptstage's planners make them with this
module instead: a magic line, then the value's node in the JSON tree
encoding of :mod:`ckptstage.client.tree` (the same nodes a manifest's tree
holds, so the writer stores the node itself and a plain ``Client.load``
returns the value).

A value ckptstage cannot encode (an object of some class) reaches storage
only through DCP's default planner, as the bytes ``torch.save`` made; it is
stored as :data:`TORCH_SAVE_KEY` -> those bytes (see :class:`Opaque`), so a
reader can always tell stored pickles from values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ckptstage.client import tree

MAGIC = b"ckptstage-value/1\n"
TORCH_SAVE_KEY = "__torch_save__"


@dataclass(frozen=True)
class Opaque:
    """Bytes a planner made that are not ckptstage's encoding (``torch.save`` output): kept as they are."""

    raw: bytes


def node(value: Any, fqn: str) -> Any:
    """The tree node of a plain value; ``TypeError`` naming ``fqn`` if it holds tensors or other objects."""
    try:
        flat = tree.flatten_state(value, inline_arrays=True)
    except (TypeError, ValueError) as e:
        raise type(e)(f"DCP key {fqn!r}: " + str(e).replace("state", "the value", 1)) from None
    if flat.tensors or flat.dtensors:
        raise TypeError(f"DCP key {fqn!r}: a non-tensor value of the state holds tensors; DCP stores it as one value, "
                        "which ckptstage's planner cannot: make it a dict or list so DCP takes it apart")
    return flat.tree


def encode(value: Any, fqn: str) -> bytes:
    """What :class:`ckptstage.dcp.SavePlanner` hands the writer for a non-tensor value."""
    return MAGIC + json.dumps(node(value, fqn), separators=(",", ":")).encode()


def encode_node(n: Any) -> bytes:
    return MAGIC + json.dumps(n, separators=(",", ":")).encode()


def is_encoded(raw: bytes) -> bool:
    return raw.startswith(MAGIC)


def node_of(raw: bytes) -> Any:
    return json.loads(raw[len(MAGIC):])


def decode(raw: bytes, fqn: str) -> Any:
    """The value of :func:`encode`'s bytes; ``ValueError`` naming ``fqn`` for anything else."""
    if not is_encoded(raw):
        raise ValueError(f"DCP key {fqn!r}: the checkpoint holds this value as torch.save bytes (it was saved with DCP's "
                         "default planner and ckptstage could not encode it); ckptstage's LoadPlanner never "
                         "unpickles: load it with DCP's DefaultLoadPlanner if you trust the checkpoint")
    return decode_node(node_of(raw), fqn)


def decode_node(n: Any, fqn: str) -> Any:
    def no_tensor(i: int) -> Any:
        raise ValueError(f"DCP key {fqn!r}: a stored value refers to a tensor; it is not a plain value")

    return tree.unflatten(n, no_tensor, lambda d: no_tensor(0))


def store_node(raw: bytes) -> Any:
    """The tree node the writer stores for a planner's bytes: the value's own node, or the opaque wrapper."""
    if is_encoded(raw):
        return node_of(raw)
    return {"d": [[{"s": TORCH_SAVE_KEY}, tree.flatten_state(raw).tree]]}


def stored_value(value: Any) -> Any:
    """A value as read back from a tree: :class:`Opaque` for the wrapper :func:`store_node` makes, else itself."""
    if type(value) is dict and len(value) == 1 and type(value.get(TORCH_SAVE_KEY)) is bytes:
        return Opaque(value[TORCH_SAVE_KEY])
    return value
