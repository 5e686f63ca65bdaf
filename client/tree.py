"""Training state <-> (JSON tree, list of tensors), with no pickle anywhere.

The tree keeps containers, key types and plain values exactly; tensors are
replaced by their index in the tensor list. Encoding, one JSON object per node:

    {"T": i}                       tensor number i
    {"N": 0} {"b": true} {"i": 7}  None, bool, int (any size)
    {"f": "0x1.8p+1"}              float, as float.hex() (exact, NaN and inf included)
    {"s": "..."} {"y": "base64"}   str, bytes
    {"d": [[key, value], ...]}     dict (insertion order kept)
    {"o": [[key, value], ...]}     collections.OrderedDict (what state_dict() returns)
    {"l": [...]} {"t": [...]}      list, tuple
    {"S": [...]}                   torch.Size
    {"D": {"fqn": "model.w", "dtype": "float32", "shape": [...]}}
                                   a DTensor: its global dtype and shape; its
                                   bytes are fragments, found by fqn in every
                                   part of the step (see ckptstage.client.shards)

A tensor that appears more than once — the same view of the same storage,
e.g. tied embedding and output weights, each ``state_dict()`` key a separate
``detach()`` of one parameter — is stored once and referenced by every key,
and comes back as one storage (views of one tensor), as ``torch.load``
returns it. Other views
that share storage (a slice, a transpose) are stored separately.

Every tensor also has an *fqn*, its key path joined by dots as
``torch.distributed.checkpoint`` names it (``optim.state.0.exp_avg``): it is
how a sharded checkpoint finds a tensor's fragments across parts and how a
load matches saved tensors to the caller's.

Keys are encoded like values but only None, bool, int, float and str are
allowed. Anything else raises ``TypeError`` naming its key path, e.g.
``state['optim']['state'][0]['exp_avg']``.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstage.client import shards
from ckptstage.protos import layout

_KEY_TYPES = (str, int, float, bool, type(None))


@dataclass
class Flat:
    """A state taken apart: its tree, and per stored tensor its key path, fqn and fragment (if a DTensor's)."""

    tree: Any
    tensors: list[torch.Tensor] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    fqns: list[str] = field(default_factory=list)
    fragments: list[shards.Fragment | None] = field(default_factory=list)
    dtensors: dict[str, Any] = field(default_factory=dict)  # fqn -> the DTensor itself

    @property
    def sharded(self) -> bool:
        return bool(self.dtensors)

    def entry_extras(self) -> list[dict[str, Any]]:
        """What the manifest's tensor entries carry beyond the file layout: fqn, and a fragment's place."""
        return [{"fqn": fqn, **(frag.to_json() if frag is not None else {})}
                for fqn, frag in zip(self.fqns, self.fragments)]


def flatten(state: Any) -> tuple[Any, list[torch.Tensor], list[str]]:
    """Returns (tree, tensors, tensor key paths)."""
    flat = flatten_state(state)
    return flat.tree, flat.tensors, flat.paths


def flatten_state(state: Any) -> Flat:
    """Takes ``state`` apart (see the module docstring); DTensors contribute their stored local fragment."""
    flat = Flat(None)
    tensors, paths = flat.tensors, flat.paths
    index: dict[tuple[Any, ...], int] = {}  # one entry per distinct view (see the module docstring)

    def add(t: torch.Tensor, path: str, fqn: str, frag: shards.Fragment | None) -> int:
        tensors.append(t)
        paths.append(path)
        flat.fqns.append(fqn)
        flat.fragments.append(frag)
        return len(tensors) - 1

    def enc(obj: Any, path: str, seen: tuple[int, ...], keys: tuple[Any, ...] = ()) -> Any:
        if isinstance(obj, torch.Tensor):
            fqn = ".".join(map(str, keys))
            if shards.is_dtensor(obj):
                if fqn in flat.dtensors:
                    raise ValueError(f"{path}: two DTensors have the key path {fqn!r} once joined by dots; "
                                     "rename one (sharded tensors are matched by that name on load)")
                flat.dtensors[fqn] = obj
                local = shards.local_fragment(obj, path, fqn)
                if local is not None:
                    _check_tensor(local[0], path)
                    add(local[0], path, fqn, local[1])
                return {"D": shards.node(obj, fqn)}
            _check_tensor(obj, path)
            view = _view_key(obj)
            if view is not None and view in index:
                return {"T": index[view]}
            i = add(obj, path, fqn, None)
            if view is not None:
                index[view] = i
            return {"T": i}
        if obj is None:
            return {"N": 0}
        kind = type(obj)
        if kind is bool:
            return {"b": obj}
        if kind is int:
            return {"i": obj}
        if kind is float:
            return {"f": obj.hex()}
        if kind is str:
            _check_plain_size(len(obj.encode()), path)
            return {"s": obj}
        if kind is bytes:
            _check_plain_size(len(obj), path)
            return {"y": base64.b64encode(obj).decode()}
        if kind is torch.Size:
            return {"S": list(obj)}
        if kind in (dict, OrderedDict, list, tuple):
            if id(obj) in seen:
                raise TypeError(f"{path} contains itself (a reference cycle); cannot checkpoint it")
            if len(seen) >= layout.MAX_TREE_DEPTH:
                raise ValueError(f"{path[:200]}... is nested more than {layout.MAX_TREE_DEPTH} containers deep, "
                                 "the limit for a saved state; flatten it (e.g. join the keys)")
            inner = seen + (id(obj),)
            if kind in (list, tuple):
                return {"l" if kind is list else "t": [enc(v, f"{path}[{i}]", inner, keys + (i,))
                                                       for i, v in enumerate(obj)]}
            items = []
            for k, v in obj.items():
                if type(k) not in _KEY_TYPES:
                    raise TypeError(f"{path} has a key of unsupported type {type(k).__name__}: {k!r} "
                                    "(keys may be str, int, float, bool or None)")
                items.append([enc(k, path, ()), enc(v, f"{path}[{k!r}]", inner, keys + (k,))])
            return {"d" if kind is dict else "o": items}
        raise TypeError(f"{path} is a {kind.__module__}.{kind.__qualname__}; ckptstage saves tensors, "
                        "dict/OrderedDict/list/tuple, and int, float, bool, str, bytes, None — convert it "
                        "(e.g. to a tensor or a str) or leave it out of the state")

    flat.tree = enc(state, "state", ())
    return flat


def unflatten(tree: Any, tensor: Callable[[int], Any], dtensor: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """Rebuilds the state; ``tensor(i)`` supplies tensor number i, ``dtensor(node)`` a sharded one.

    A tensor referenced more than once comes back as one storage under
    several tensor objects (views of the first), as ``torch.load`` returns it.
    """
    seen: set[int] = set()

    def dec(node: dict[str, Any]) -> Any:
        (tag, v), = node.items()
        if tag == "T":
            t = tensor(v)
            if v in seen and isinstance(t, torch.Tensor):
                return t.view(t.shape)  # the same bytes, its own tensor object
            seen.add(v)
            return t
        if tag == "N":
            return None
        if tag in ("b", "i", "s"):
            return v
        if tag == "f":
            return float.fromhex(v)
        if tag == "y":
            return base64.b64decode(v)
        if tag == "S":
            return torch.Size(v)
        if tag == "D":
            if dtensor is None:
                raise ValueError(f"the checkpoint holds a sharded tensor {v.get('fqn')!r}; read it through "
                                 "Client.load, which gathers its fragments from every rank's part")
            return dtensor(v)
        if tag == "l":
            return [dec(x) for x in v]
        if tag == "t":
            return tuple(dec(x) for x in v)
        if tag == "d":
            return {dec(k): dec(x) for k, x in v}
        if tag == "o":
            return OrderedDict((dec(k), dec(x)) for k, x in v)
        raise ValueError(f"unknown tree node {tag!r} in manifest")

    return dec(tree)


def _view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same bytes: storage, offset, shape, strides, dtype (None if empty)."""
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _check_plain_size(nbytes: int, path: str) -> None:
    if nbytes > layout.MAX_PLAIN_VALUE_BYTES:
        raise ValueError(f"{path} is a str/bytes value of {nbytes} bytes; plain values travel in the manifest, "
                         f"at most {layout.MAX_PLAIN_VALUE_BYTES} bytes each: store it as a tensor instead "
                         "(torch.frombuffer(bytearray(value), dtype=torch.uint8))")


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"{path} is a {t.layout} tensor; only dense (strided) tensors can be checkpointed "
                        "(call .to_dense() first)")
    if t.is_quantized or t.is_nested:
        raise TypeError(f"{path} is a quantized or nested tensor, which ckptstage does not store")
    if t.device.type == "meta":
        raise TypeError(f"{path} is on the meta device and has no data to save")
