"""The tree encoding of values beyond tensors, containers and plain scalars (see docs/FORMAT.md).

:mod:`ckptstage.client.tree` walks a state and handles tensors, dict,
OrderedDict, list, tuple and the plain scalars itself; every other value is
encoded here as one tagged JSON node, and decoded from it:

numpy arrays, scalars and random states, ``random.Random``, paths, Enum
members, dataclasses, namedtuples, dict subclasses, ``argparse.Namespace``,
``torch.dtype``, ``torch.device``, ``datetime`` values, sets and frozensets
(numpy's nodes are :mod:`ckptstage.client.npencodings`').

Loading never unpickles and never imports: a class named in a manifest
(a dataclass, namedtuple, Enum or dict subclass, as ``"module:Qual.name"``)
is used only if its module is already in ``sys.modules`` and the name leads
there through plain ``__dict__`` look-ups (no module ``__getattr__``, no
descriptor) to a class of that very module and qualified name and of the
expected kind. The object is then built without calling the class's
``__new__``, ``__init__``, ``__post_init__`` or ``__setstate__``: the state
comes back as the fields or items it was saved with. Otherwise it loads as an
:class:`Unresolved` (a dict that names the class) or an
:class:`UnresolvedEnum`, which a later save writes back as the same node.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import logging
import pathlib
import random
import sys
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import torch

from ckptstage.client import npencodings
from ckptstage.client.walker import Walker
from ckptstage.protos import layout

log = logging.getLogger(__name__)

_PATHS = {c.__name__: c for c in (pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath,
                                   pathlib.WindowsPath)}
_FACTORIES: dict[str, Callable[[], Any]] = {f.__name__: f for f in (list, dict, set, frozenset, tuple, int, float,
                                                                    str, bytes, bool, OrderedDict)}
_warned: set[str] = set()
_DEFAULT_FACTORY: Any = vars(defaultdict)["default_factory"]


class Unresolved(dict):  # type: ignore[type-arg]
    """A dataclass, namedtuple or dict subclass whose class this process cannot resolve, as a dict.

    ``cls`` is the class as ``"module:Qualified.name"``, ``kind`` one of
    ``"dataclass"``, ``"namedtuple"``, ``"dict"``; the items are the saved
    fields (dataclass, namedtuple) or items (dict subclass). Saving it again
    writes the original node, class name included.
    """

    __slots__ = ("cls", "kind", "factory")

    def __init__(self, cls: str, kind: str, items: Any = (), factory: str | None = None) -> None:
        super().__init__(items)
        self.cls, self.kind, self.factory = cls, kind, factory

    def __repr__(self) -> str:
        return f"Unresolved({self.kind} {self.cls!r}, {dict.__repr__(self)})"


@dataclasses.dataclass(frozen=True)
class UnresolvedEnum:
    """An Enum member whose class this process cannot resolve (hashable, so it can be a dict key)."""

    cls: str
    name: str | None
    value: Any


# --- encoding ---------------------------------------------------------------------------------


def is_key(k: Any) -> bool:
    """Whether ``k`` is a dict key this module encodes (Enum members and torch dtypes)."""
    return isinstance(k, (enum.Enum, UnresolvedEnum, torch.dtype))


def key_segment(k: Any) -> str:
    """How an Enum or dtype key joins a tensor's fqn: the member's name, the dtype's name."""
    if isinstance(k, (enum.Enum, UnresolvedEnum)):
        return str(k.name)
    return str(k).removeprefix("torch.")


def encode(obj: Any, path: str, w: Walker) -> Any:
    """The node of ``obj``; ``TypeError`` naming ``path`` if it is of no type the encoding knows."""
    kind = type(obj)
    exact = _EXACT.get(kind)
    if exact is not None:
        return exact(obj, path, w)
    argparse = sys.modules.get("argparse")  # nor a Namespace before argparse is: neither is imported here
    if argparse is not None and kind is argparse.Namespace:
        return _namespace(obj, path, w)
    np = sys.modules.get("numpy")  # no numpy object can exist before numpy is imported
    if np is not None:
        node = npencodings.encode_numpy(np, obj, path, w)
        if node is not None:
            return node
    if isinstance(obj, enum.Enum):
        return {"E": {"cls": _name(kind), "name": obj.name, "v": w.plain(obj.value, f"{path}.value", False)}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = []
        for f in dataclasses.fields(obj):
            try:
                value = getattr(obj, f.name)
            except AttributeError:  # a field never set (init=False, no default): it stays unset
                continue
            items.append([f.name, w.child(value, f"{path}.{f.name}", f.name)])
        return {"C": [{"cls": _name(kind)}, *items]}
    if isinstance(obj, tuple) and isinstance(getattr(kind, "_fields", None), tuple):
        fields = kind._fields  # type: ignore[attr-defined]
        if len(fields) == len(obj) and all(type(f) is str for f in fields):
            return {"n": [{"cls": _name(kind)}, *([f, w.child(v, f"{path}.{f}", f)] for f, v in zip(fields, obj))]}
    if isinstance(obj, dict):
        return {"M": _mapping(obj, _name(kind), path, w)}
    raise TypeError(_unsupported(obj, path))


def _mapping(obj: Any, cls: str, path: str, w: Walker) -> list[Any]:
    out: dict[str, Any] = {"cls": cls}
    if isinstance(obj, defaultdict) and obj.default_factory is not None:
        factory = obj.default_factory
        name = getattr(factory, "__name__", None)
        if name not in _FACTORIES or _FACTORIES[name] is not factory:
            raise TypeError(f"{path} is a defaultdict whose default_factory is {factory!r}; ckptstage restores "
                            f"only {', '.join(_FACTORIES)} or None: convert it (dict(value)) or leave it out")
        out["factory"] = name
    elif type(obj) is Unresolved and obj.factory is not None:
        out["factory"] = obj.factory
    return [out, *([w.key(k, path), w.child(v, f"{path}[{k!r}]", k)] for k, v in obj.items())]


def _enum_again(obj: UnresolvedEnum, path: str, w: Walker) -> Any:
    return {"E": {"cls": obj.cls, "name": obj.name, "v": w.plain(obj.value, f"{path}.value", False)}}


def _unresolved_again(obj: Unresolved, path: str, w: Walker) -> Any:
    if obj.kind == "dict":
        return {"M": _mapping(obj, obj.cls, path, w)}
    tag = {"dataclass": "C", "namedtuple": "n"}[obj.kind]
    return {tag: [{"cls": obj.cls}, *([str(f), w.child(v, f"{path}.{f}", f)] for f, v in obj.items())]}


def _path(obj: pathlib.PurePath, path: str, w: Walker) -> Any:
    s = str(obj)
    layout.check_plain_value(s, path)
    return {"p": [type(obj).__name__, s]}


def _namespace(obj: Any, path: str, w: Walker) -> Any:
    attrs = vars(obj)
    if not all(type(k) is str for k in attrs):
        raise TypeError(f"{path} is an argparse.Namespace with a non-str attribute name")
    return {"ns": [[k, w.child(v, f"{path}.{k}", k)] for k, v in attrs.items()]}


def _set(obj: set[Any] | frozenset[Any], path: str, w: Walker) -> Any:
    return {"st" if type(obj) is set else "fs": [w.plain(v, f"{path}<item {i}>") for i, v in enumerate(obj)]}


def _timedelta(obj: datetime.timedelta) -> list[int]:
    return [obj.days, obj.seconds, obj.microseconds]


def _tz(tz: Any, path: str) -> Any:
    if type(tz) is datetime.timezone:
        offset = tz.utcoffset(None)
        name = tz.tzname(None)
        node: dict[str, Any] = {"offset": _timedelta(offset)}
        if name != datetime.timezone(offset).tzname(None):
            node["name"] = name
        return node
    zoneinfo = sys.modules.get("zoneinfo")
    if zoneinfo is not None and type(tz) is zoneinfo.ZoneInfo and tz.key:
        return {"zone": tz.key}
    raise TypeError(f"{path} has a tzinfo of type {type(tz).__module__}.{type(tz).__qualname__}; ckptstage keeps "
                    "datetime.timezone and zoneinfo.ZoneInfo (convert it, e.g. .astimezone(datetime.timezone.utc))")


def _clock(obj: datetime.datetime | datetime.time, path: str) -> dict[str, Any]:
    node: dict[str, Any] = {"iso": obj.replace(tzinfo=None, fold=0).isoformat()}
    if obj.tzinfo is not None:
        node["tz"] = _tz(obj.tzinfo, path)
    if obj.fold:
        node["fold"] = 1
    return node


def _random(obj: random.Random, path: str, w: Walker) -> Any:
    return {"R": w.plain(obj.getstate(), f"{path}.getstate()", False)}


_EXACT: dict[type, Callable[[Any, str, Walker], Any]] = {
    **{c: _path for c in _PATHS.values()},
    set: _set, frozenset: _set,
    datetime.datetime: lambda o, p, w: {"ts": _clock(o, p)},
    datetime.time: lambda o, p, w: {"tt": _clock(o, p)},
    datetime.date: lambda o, p, w: {"da": o.isoformat()},
    datetime.timedelta: lambda o, p, w: {"td": _timedelta(o)},
    torch.dtype: lambda o, p, w: {"dt": str(o).removeprefix("torch.")},
    torch.device: lambda o, p, w: {"dv": str(o)},
    random.Random: _random,
    Unresolved: _unresolved_again,
    UnresolvedEnum: _enum_again,
}


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _unsupported(obj: Any, path: str) -> str:
    kind = type(obj)
    return (f"{path} is a {kind.__module__}.{kind.__qualname__}; ckptstage saves tensors, dict/OrderedDict/list/"
            "tuple, int, float, bool, str, bytes, None, and the types of docs/FORMAT.md (numpy arrays, scalars "
            "and random states, dataclasses, namedtuples, Enum members, dict subclasses, sets, paths, datetimes, "
            "argparse.Namespace, torch.dtype/device) — convert it (e.g. to a tensor, a dict or a str) or leave "
            "it out of the state")


# --- decoding ---------------------------------------------------------------------------------


def decode(tag: str, v: Any, dec: Callable[[Any], Any]) -> Any:
    """The value of node ``{tag: v}``; ``dec`` decodes a child node. ``ValueError`` for an unknown tag."""
    fn = _DECODERS.get(tag)
    if fn is None:
        raise ValueError(f"unknown tree node {tag!r} in manifest")
    return fn(v, dec)


def resolve(name: str, want: type) -> type | None:
    """The class ``"module:Qual.name"`` if its module is imported and it is a subclass of ``want``; else None.

    Nothing is imported and no code of the module runs: only ``__dict__``
    look-ups, and the class found must carry that very module and name.
    """
    module, sep, qual = name.partition(":")
    mod = sys.modules.get(module)
    if not sep or mod is None or "<" in qual:
        return None
    obj: Any = mod
    for part in qual.split("."):
        try:
            obj = vars(obj).get(part)
        except TypeError:
            return None
        if obj is None:
            return None
    if not (isinstance(obj, type) and issubclass(obj, want) and obj.__module__ == module and obj.__qualname__ == qual):
        return None
    return obj


def _unresolved(name: str, kind: str) -> None:
    if name not in _warned and len(_warned) < 1000:
        _warned.add(name)
        log.warning("the checkpoint holds a %s of class %s, which is not imported in this process: loaded as a "
                    "ckptstage.client.tree.Unresolved dict (import its module before loading to get the class)",
                    kind, name)


def _dec_dataclass(v: Any, dec: Callable[[Any], Any]) -> Any:
    name = str(v[0]["cls"])
    items = [(str(f), dec(x)) for f, x in v[1:]]
    cls = resolve(name, object)
    obj = _build_dataclass(cls, items) if cls is not None and dataclasses.is_dataclass(cls) else None
    if obj is None:
        _unresolved(name, "dataclass")
        return Unresolved(name, "dataclass", items)
    return obj


def _build_dataclass(cls: type, items: list[tuple[str, Any]]) -> Any:
    declared = {f.name: f for f in dataclasses.fields(cls)}
    if any(name not in declared for name, _ in items):
        return None  # the class no longer has a field the checkpoint has
    try:
        obj: Any = object.__new__(cls)  # no __new__, __init__ or __post_init__ of the class
    except TypeError:
        return None
    for name, value in items:
        object.__setattr__(obj, name, value)  # frozen dataclasses too
    given = {name for name, _ in items}
    for f in declared.values():  # a field added since the save: its default, as __init__ would give it
        if f.name not in given and f.default is not dataclasses.MISSING:
            object.__setattr__(obj, f.name, f.default)
        elif f.name not in given and f.default_factory is not dataclasses.MISSING:
            object.__setattr__(obj, f.name, f.default_factory())
    return obj


def _dec_namedtuple(v: Any, dec: Callable[[Any], Any]) -> Any:
    name = str(v[0]["cls"])
    items = [(str(f), dec(x)) for f, x in v[1:]]
    cls = resolve(name, tuple)
    fields = getattr(cls, "_fields", None)
    if cls is not None and isinstance(fields, tuple):
        saved = dict(items)
        defaults = getattr(cls, "_field_defaults", {})
        if [f for f, _ in items] == list(fields[:len(items)]) and all(f in saved or f in defaults for f in fields):
            return tuple.__new__(cls, [saved[f] if f in saved else defaults[f] for f in fields])
    _unresolved(name, "namedtuple")
    return Unresolved(name, "namedtuple", items)


def _dec_mapping(v: Any, dec: Callable[[Any], Any]) -> Any:
    name, factory = str(v[0]["cls"]), v[0].get("factory")
    items = [(dec(k), dec(x)) for k, x in v[1:]]
    if factory is not None and factory not in _FACTORIES:
        raise ValueError(f"unknown default_factory {factory!r} in manifest")
    cls = resolve(name, defaultdict if factory is not None else dict)
    base: Any = dict
    if cls is not None:
        base = next(b for b in (defaultdict, OrderedDict, dict) if issubclass(cls, b))
        try:
            obj = base.__new__(cls)  # no __new__ or __init__ of the class
        except TypeError:
            cls = None
    if cls is None:
        _unresolved(name, "dict subclass")
        return Unresolved(name, "dict", items, factory)
    setitem = OrderedDict.__setitem__ if base is OrderedDict else dict.__setitem__
    for k, x in items:
        setitem(obj, k, x)
    if factory is not None:
        _DEFAULT_FACTORY.__set__(obj, _FACTORIES[factory])  # the slot itself: no __setattr__ of the class
    return obj


def _dec_enum(v: Any, dec: Callable[[Any], Any]) -> Any:
    name, member, value = v["cls"], v["name"], dec(v["v"])
    cls: Any = resolve(name, enum.Enum)
    if cls is not None:
        found = cls.__members__.get(member) if isinstance(member, str) else None
        if found is not None:
            return found
        # A combination of flags has no member of its own; the stock Flag lookup builds it from the bits.
        if issubclass(cls, enum.Flag) and type(value) is int and \
                getattr(cls._missing_, "__func__", None) is enum.Flag._missing_.__func__:  # type: ignore[attr-defined]
            return cls(value)
    _unresolved(name, "Enum member")
    return UnresolvedEnum(name, member, value)


def _dec_path(v: Any, dec: Callable[[Any], Any]) -> Any:
    cls_name, s = v
    cls = _PATHS[cls_name]
    try:
        return cls(s)
    except NotImplementedError:  # a WindowsPath on POSIX (or the reverse): the pure flavour
        return (pathlib.PureWindowsPath if cls is pathlib.WindowsPath else pathlib.PurePosixPath)(s)


def _dec_tz(v: Any) -> Any:
    if "zone" in v:
        import zoneinfo  # the standard library's; a key is a relative name, never a path out of the tz database
        return zoneinfo.ZoneInfo(str(v["zone"]))
    offset = datetime.timedelta(*v["offset"])
    return datetime.timezone(offset, v["name"]) if "name" in v else datetime.timezone(offset)


def _dec_clock(cls: Any) -> Callable[[Any, Callable[[Any], Any]], Any]:
    def dec_clock(v: Any, dec: Callable[[Any], Any]) -> Any:
        tz = _dec_tz(v["tz"]) if "tz" in v else None
        return cls.fromisoformat(v["iso"]).replace(tzinfo=tz, fold=int(v.get("fold", 0)))
    return dec_clock


def _dec_set(cls: Any) -> Callable[[Any, Callable[[Any], Any]], Any]:
    def dec_set(v: Any, dec: Callable[[Any], Any]) -> Any:
        items = [dec(x) for x in v]
        try:
            return cls(items)
        except TypeError:
            raise ValueError(f"a saved {cls.__name__} holds an element that loads unhashable (a dataclass whose "
                             "class is not imported here): import its module before loading") from None
    return dec_set


def _python_random(state: Any) -> random.Random:
    r = random.Random()
    r.setstate(state)
    return r


def _namespace_of(v: Any, dec: Callable[[Any], Any]) -> Any:
    import argparse
    ns = argparse.Namespace()
    vars(ns).update((str(k), dec(x)) for k, x in v)  # the instance dict: no attribute hook of any class runs
    return ns


def _dtype(name: Any) -> torch.dtype:
    dtype = vars(torch).get(str(name))
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} in manifest")
    return dtype


_DECODERS: dict[str, Callable[[Any, Callable[[Any], Any]], Any]] = {
    **npencodings.DECODERS,
    "R": lambda v, dec: _python_random(dec(v)),
    "p": _dec_path, "E": _dec_enum, "C": _dec_dataclass, "n": _dec_namedtuple, "M": _dec_mapping,
    "ns": _namespace_of,
    "dt": lambda v, dec: _dtype(v),
    "dv": lambda v, dec: torch.device(str(v)),
    "ts": _dec_clock(datetime.datetime), "tt": _dec_clock(datetime.time),
    "da": lambda v, dec: datetime.date.fromisoformat(v),
    "td": lambda v, dec: datetime.timedelta(*v),
    "st": _dec_set(set), "fs": _dec_set(frozenset),
}


def children(tag: str, v: Any) -> list[tuple[Any, Any]]:
    """The child nodes of a node of this module, each with its key-path segment (None: the node's own path).

    Dict-subclass keys are returned as key nodes (see ``tree.key_str``);
    nodes that can hold no tensor (sets, Enum values, random states) have none.
    """
    if tag in ("C", "n", "M"):
        return [(k, x) for k, x in v[1:]]
    if tag == "ns":
        return [(k, x) for k, x in v]
    if tag == "A":
        return [(None, v["v"])]
    return []


def with_children(tag: str, v: Any, new: list[Any]) -> Any:
    """Node ``{tag: v}`` with its :func:`children` replaced by ``new``, in order."""
    if tag in ("C", "n", "M"):
        return {tag: [v[0], *([k, x] for (k, _), x in zip(v[1:], new))]}
    if tag == "ns":
        return {tag: [[k, x] for (k, _), x in zip(v, new)]}
    if tag == "A":
        return {tag: {**v, "v": new[0]}}
    return {tag: v}
