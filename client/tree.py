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

Other values have nodes of :mod:`ckptstage.client.encodings` (the table is in
docs/FORMAT.md): numpy arrays (up to 4 KiB inline, larger ones as tensors of
the tensor list), numpy scalars, numpy ``Generator``/``RandomState``/bit
generators, ``random.Random``, pathlib paths, Enum members, dataclasses,
namedtuples, dict subclasses, ``argparse.Namespace``, ``torch.dtype``,
``torch.device``, ``datetime`` values, sets and frozensets. Each loads back as
its own type; a class (dataclass, namedtuple, Enum, dict subclass) only if its
module is already imported in the loading process — nothing is ever imported
and no ``__init__`` runs — else as :class:`Unresolved` (a dict naming the
class) or :class:`UnresolvedEnum`. Python's ``random.getstate()`` and numpy's
``get_state()`` are tuples of these and round-trip as the same tuples.

A tensor that appears more than once — the same view of the same storage,
e.g. tied embedding and output weights, each ``state_dict()`` key a separate
``detach()`` of one parameter — is stored once and referenced by every key,
and comes back as one storage (views of one tensor), as ``torch.load``
returns it. Other views
that share storage (a slice, a transpose) are stored separately.

Every tensor also has an *fqn*, its key path joined by dots as
``torch.distributed.checkpoint`` names it (``optim.state.0.exp_avg``): it is
how a sharded checkpoint finds a tensor's fragments across parts and how a
load matches saved tensors to the caller's. Dataclass, namedtuple and
``Namespace`` fields join it by name (``cfg.weight``); a numpy array stored as
a tensor has its own key path.

Keys are encoded like values but only None, bool, int, float, str, Enum
members and torch dtypes are allowed (an Enum key joins the fqn by its member
name, a dtype by its name). Anything else raises ``TypeError`` naming its key
path, e.g. ``state['optim']['state'][0]['exp_avg']``. The limits apply to every
container: at most ``MAX_TREE_DEPTH`` deep, no reference cycles, plain values
(and inline arrays) of at most ``MAX_PLAIN_VALUE_BYTES``.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptstage.client import encodings, shards
from ckptstage.client.encodings import Unresolved, UnresolvedEnum
from ckptstage.protos import layout

__all__ = ["Flat", "Unresolved", "UnresolvedEnum", "arranged_like", "children", "flatten", "flatten_state",
           "key_str", "map_children", "unflatten"]

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


def flatten_state(state: Any, inline_arrays: bool = False) -> Flat:
    """Takes ``state`` apart (see the module docstring); DTensors contribute their stored local fragment.

    ``inline_arrays``: numpy arrays of any size travel in the tree, never in
    the tensor list (for a value that must hold no tensor, e.g. DCP's).
    """
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
            layout.check_plain_value(obj, path)
            return {"s": obj}
        if kind is bytes:
            layout.check_plain_value(obj, path)
            return {"y": base64.b64encode(obj).decode()}
        if kind is torch.Size:
            return {"S": list(obj)}
        if kind in (dict, OrderedDict, list, tuple):
            inner = _enter(obj, path, seen)
            if kind in (list, tuple):
                return {"l" if kind is list else "t": [enc(v, f"{path}[{i}]", inner, keys + (i,))
                                                       for i, v in enumerate(obj)]}
            items = []
            for k, v in obj.items():
                if type(k) in _KEY_TYPES:
                    items.append([enc(k, path, ()), enc(v, f"{path}[{k!r}]", inner, keys + (k,))])
                else:
                    items.append([key(k, path), enc(v, f"{path}[{k!r}]", inner, keys + (_segment(k),))])
            return {"d" if kind is dict else "o": items}
        return encodings.encode(obj, path, _Walker(walk, obj, path, seen, keys))

    def key(k: Any, path: str) -> Any:
        if type(k) in _KEY_TYPES or encodings.is_key(k):
            return enc(k, path, ())
        raise TypeError(f"{path} has a key of unsupported type {type(k).__name__}: {k!r} "
                        "(keys may be str, int, float, bool, None, an Enum member or a torch.dtype)")

    walk = _Walk(flat, enc, key, inline_arrays)
    flat.tree = enc(state, "state", ())
    return flat


@dataclass(frozen=True)
class _Walk:
    """One :func:`flatten_state` call: what its :class:`_Walker` objects share."""

    flat: Flat
    enc: Callable[..., Any]
    key: Callable[[Any, str], Any]
    inline_arrays: bool


class _Walker:
    """What :func:`encodings.encode` may ask of the walk at one value (see ``walker.Walker``)."""

    def __init__(self, walk: _Walk, obj: Any, path: str, seen: tuple[int, ...], keys: tuple[Any, ...]) -> None:
        self.walk, self.obj, self.path, self.seen, self.keys = walk, obj, path, seen, keys
        self.inline_arrays = walk.inline_arrays
        self.inner: tuple[int, ...] | None = None

    def _inner(self) -> tuple[int, ...]:
        if self.inner is None:
            self.inner = _enter(self.obj, self.path, self.seen)
        return self.inner

    def child(self, value: Any, path: str, segment: Any) -> Any:
        return self.walk.enc(value, path, self._inner(), self.keys + (_segment(segment),))

    def plain(self, value: Any, path: str, nested: bool = True) -> Any:
        flat = self.walk.flat
        before = (len(flat.tensors), len(flat.dtensors))
        node = self.walk.enc(value, path, self._inner() if nested else self.seen, self.keys)
        if (len(flat.tensors), len(flat.dtensors)) != before:
            raise TypeError(f"{path} holds a tensor; a set element, an Enum value or a random state cannot: "
                            "keep tensors in dicts, lists, tuples, dataclasses or namedtuples")
        return node

    def key(self, k: Any, path: str) -> Any:
        return self.walk.key(k, path)

    def tensor(self, t: torch.Tensor) -> Any:
        return self.walk.enc(t, self.path, self.seen, self.keys)


def _segment(k: Any) -> Any:
    """A key as it joins an fqn (joined with ``str``): itself, or an Enum member's or dtype's name."""
    return k if type(k) in _KEY_TYPES else encodings.key_segment(k)


def _enter(obj: Any, path: str, seen: tuple[int, ...]) -> tuple[int, ...]:
    """``seen`` with container ``obj`` added; raises on a reference cycle or nesting past the limit."""
    if id(obj) in seen:
        raise TypeError(f"{path} contains itself (a reference cycle); cannot checkpoint it")
    if len(seen) >= layout.MAX_TREE_DEPTH:
        raise ValueError(f"{path[:200]}... is nested more than {layout.MAX_TREE_DEPTH} containers deep, "
                         "the limit for a saved state; flatten it (e.g. join the keys)")
    return seen + (id(obj),)


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
        return encodings.decode(tag, v, dec)

    return dec(tree)


def children(node: Any) -> list[tuple[str | None, Any]]:
    """The child nodes of a tree node, each with the fqn segment it adds (None: the node's own key path).

    For code that walks a manifest's tree for tensors (``"T"``, ``"D"``
    nodes): it reaches them inside every container, dataclasses and
    namedtuples included.
    """
    (tag, v), = node.items()
    if tag in ("l", "t"):
        return [(str(i), x) for i, x in enumerate(v)]
    if tag in ("d", "o"):
        return [(key_str(k), x) for k, x in v]
    if tag == "M":
        return [(key_str(k), x) for k, x in encodings.children(tag, v)]
    return [(None if k is None else str(k), x) for k, x in encodings.children(tag, v)]


def map_children(node: Any, fn: Callable[[Any], Any]) -> Any:
    """``node`` with each of its :func:`children` replaced by ``fn(child)``."""
    (tag, v), = node.items()
    if tag in ("l", "t"):
        return {tag: [fn(x) for x in v]}
    if tag in ("d", "o"):
        return {tag: [[k, fn(x)] for k, x in v]}
    return encodings.with_children(tag, v, [fn(x) for _, x in encodings.children(tag, v)])


def key_str(node: Any) -> str:
    """A dict key's node as :func:`flatten_state` joins it into an fqn."""
    (tag, v), = node.items()
    if tag == "N":
        return "None"
    if tag == "b":
        return str(bool(v))
    if tag == "f":
        return str(float.fromhex(v))
    if tag == "E":
        return str(v["name"])
    return str(v)


def _view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same bytes: storage, offset, shape, strides, dtype (None if empty)."""
    if t.numel() == 0:
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _check_tensor(t: torch.Tensor, path: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(f"{path} is a {t.layout} tensor; only dense (strided) tensors can be checkpointed "
                        "(call .to_dense() first)")
    if t.is_quantized or t.is_nested:
        raise TypeError(f"{path} is a quantized or nested tensor, which ckptstage does not store")
    if t.device.type == "meta":
        raise TypeError(f"{path} is on the meta device and has no data to save")


def arranged_like(state: Any, into: Any) -> Any:
    """``state`` (a loaded dict) with each entry that ``into`` holds under another key path moved there.

    Entries are matched by DCP key (the key path joined by dots, as
    ``torch.distributed.checkpoint`` flattens a state: dicts and the lists
    that hold tensors or dicts are taken apart, other values are one
    entry). A step written through ``ckptstage.dcp.Writer`` before it nested
    its tree holds ``{"model.fc.weight": ...}``, and one written with DCP's
    default planner has its dict keys as strings (``"0"``); loaded into
    ``{"model": {...}}`` or an optimizer's ``int`` keys, they come back
    arranged as the state they were loaded into. Containers are made like
    ``into``'s; entries ``into`` lacks stay where they were. Changes
    ``state`` in place and returns it.
    """
    if not (isinstance(state, dict) and isinstance(into, Mapping)):
        return state
    want = _dcp_paths(into)
    moves = [(key, path, want[key]) for key, path in _dcp_paths(state).items() if key in want and want[key] != path]
    for key, src, dst in moves:
        _put(state, dst, _pop(state, src), into, key)
    return state


def _dcp_paths(state: Mapping[Any, Any]) -> dict[str, tuple[Any, ...]]:
    """DCP key -> the key path (keys as they are) of every entry DCP's traversal makes of ``state``."""
    out: dict[str, tuple[Any, ...]] = {}
    stack: list[tuple[Any, tuple[Any, ...]]] = [(state, ())]
    while stack:  # children pushed last first: entries come out in the state's order
        value, path = stack.pop()
        if isinstance(value, Mapping):
            stack.extend(reversed([(v, path + (k,)) for k, v in value.items()]))
        elif path and isinstance(value, list) and not _dcp_leaf_list(value):
            stack.extend(reversed([(v, path + (i,)) for i, v in enumerate(value)]))
        else:
            out[".".join(map(str, path))] = path
    return out


def _dcp_leaf_list(value: list[Any]) -> bool:
    """Whether DCP keeps a list as one value: it holds no tensor, dict, or list DCP takes apart."""
    return not any(isinstance(v, (torch.Tensor, Mapping)) or isinstance(v, list) and not _dcp_leaf_list(v)
                   for v in value)


def _pop(state: dict[Any, Any], path: tuple[Any, ...]) -> Any:
    """Takes the entry at ``path`` out; dicts left empty by that go too."""
    chain = [state]
    for k in path[:-1]:
        chain.append(chain[-1][k])
    if not isinstance(chain[-1], dict):  # an entry of a list stays (a list keeps its positions)
        return chain[-1][path[-1]]
    value = chain[-1].pop(path[-1])
    for depth in range(len(chain) - 1, 0, -1):
        if chain[depth] or not isinstance(chain[depth - 1], dict):
            break
        del chain[depth - 1][path[depth - 1]]
    return value


def _put(state: dict[Any, Any], path: tuple[Any, ...], value: Any, into: Mapping[Any, Any], key: str) -> None:
    """Sets the entry at ``path``, making the containers on the way like ``into``'s."""
    cur: Any = state
    ref: Any = into
    for k in path[:-1]:
        ref = ref[k]
        if isinstance(cur, list):
            cur.extend([None] * (k + 1 - len(cur)))
            nxt = cur[k]
        elif isinstance(cur, dict):
            nxt = cur.get(k)
        else:
            raise ValueError(f"key {key!r} of the checkpoint goes where the state to load into has it, "
                             f"{path!r}, but the checkpoint holds a value on the way there")
        if nxt is None:
            nxt = cur[k] = [None] * len(ref) if isinstance(ref, list) else (
                OrderedDict() if isinstance(ref, OrderedDict) else {})
        cur = nxt
    if isinstance(cur, list):
        cur.extend([None] * (path[-1] + 1 - len(cur)))
    elif not isinstance(cur, dict):
        raise ValueError(f"key {key!r} of the checkpoint goes where the state to load into has it, "
                         f"{path!r}, but the checkpoint holds a value on the way there")
    cur[path[-1]] = value
