"""The daemon's door for a client's manifest: every field, size and tree node checked before any file exists.

:func:`parse_manifest` turns a client's partial manifest into a
:class:`SaveSpec` or refuses it with an :class:`InvalidRequest` naming the
field or key path and the limit. The state tree's nodes are those of
``client/tree.py`` and ``client/encodings.py`` (docs/FORMAT.md); the key and
depth rules here match the client's.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptstage.daemon.errors import InvalidRequest
from ckptstage.protos import layout

# Bounds checked at the daemon's door (parse_manifest), before any file is created. The manifest's
# byte size (layout.MAX_MANIFEST_BYTES), container depth (layout.MAX_TREE_DEPTH) and plain value size
# (layout.MAX_PLAIN_VALUE_BYTES) are shared with the client in protos/layout.py; these are the daemon's own.
# Largest data file of one part (one rank's share of one step): 1 PiB. Larger is a client bug.
MAX_PART_BYTES = 1 << 50
# Tensors in one part: a 64 MiB manifest holds about this many entries.
MAX_TENSORS = 1 << 20
# Dimensions of one tensor (torch allows at most 64).
MAX_TENSOR_DIMS = 64
# JSON nesting of a whole manifest: a tree node is at most 3 levels per container (object, item list,
# [key, value] pair), plus the manifest and a leaf. Checked before parsing, so the parser never recurses deeper.
MAX_MANIFEST_DEPTH = 3 * layout.MAX_TREE_DEPTH + 8
MAX_METRICS = 256
MAX_NAME_CHARS = 4096

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_PLAIN_TAGS = {"N": int, "b": bool, "i": int, "f": str, "s": str, "y": str}
_CONTAINER_TAGS = {"l", "t", "d", "o"}
# The nodes of client/encodings.py (see docs/FORMAT.md). Containers, one level of nesting each:
_FIELD_TAGS = {"C", "n", "M", "ns"}    # [{"cls": ...}, [key, node], ...] ("ns": no header)
_SET_TAGS = {"st", "fs"}               # [node, ...]
# A node wrapping one node of the same level (a random state, an Enum's value), or a value in a small shape:
_WRAPPER_TAGS = {"G", "B", "Q", "R"}
_NAME_TAGS = {"dt", "dv", "da"}        # a str
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")
# Element sizes of the common dtypes, to check nbytes against the shape; other dtypes (sub-byte ones)
# need at least one bit per element.
_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
             "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
             "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}


@dataclass(frozen=True)
class SaveSpec:
    """What a client asked to save, validated (see :func:`parse_manifest`)."""

    job: str
    step: int
    rank: int
    world_size: int
    data_bytes: int
    manifest: dict[str, Any]
    metrics: dict[str, float] = field(default_factory=dict)


def parse_manifest(raw: bytes, job: str, step: int, rank: int, world_size: int,
                   data_bytes: int, metrics: dict[str, float]) -> SaveSpec:
    """Validates a client's partial manifest against its session and the data size.

    Everything is bounded here, before any file is created: the manifest's
    size and JSON nesting (checked before it is parsed), the number of
    tensors, every size, shape and offset, the state tree's depth and plain
    values. A refusal is an :class:`InvalidRequest` naming the field or key
    path and the limit. What passes is a manifest the client can load back.
    """
    _check_int("data_bytes", data_bytes, MAX_PART_BYTES)
    _check_metrics(metrics)
    manifest = _decode(raw)
    if not isinstance(manifest, dict) or manifest.get("format") != layout.FORMAT:
        raise InvalidRequest(f"manifest_json is not a {layout.FORMAT} manifest")
    expected = {"job": job, "step": step, "rank": rank, "world_size": world_size}
    for key, value in expected.items():
        got = manifest.get(key)
        if type(got) is not type(value) or got != value:
            raise InvalidRequest(f"manifest {key}={_short(got)} does not match the session's {value!r}")
    tensors = _tensor_table(manifest.get("tensors"), data_bytes)
    data_start = _check_int("manifest_json.data_start", manifest.get("data_start"), data_bytes)
    try:
        layout.validate_tensor_table(tensors, data_start, data_bytes)
    except layout.ManifestError as e:
        raise InvalidRequest(f"manifest rejected: {e}") from e
    if "tree" not in manifest:
        raise InvalidRequest("manifest rejected: missing key 'tree'")
    _check_tree(manifest["tree"], len(tensors))
    return SaveSpec(job, step, rank, world_size, data_bytes, manifest, dict(metrics))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_int(what: str, value: Any, hi: int, lo: int = 0) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidRequest(f"{what} = {_short(value)} is out of range: an int in [{lo}, {hi}]")
    return value


def _check_metrics(metrics: dict[str, float]) -> None:
    if len(metrics) > MAX_METRICS:
        raise InvalidRequest(f"metrics has {len(metrics)} entries, more than the limit of {MAX_METRICS}")
    for key in metrics:
        if not 0 < len(key) <= 256:
            raise InvalidRequest(f"metrics key {_short(key)} must have 1 to 256 characters")


def _decode(raw: bytes) -> Any:
    """Parses manifest_json after bounding its size and nesting (json.loads recurses once per level)."""
    if len(raw) > layout.MAX_MANIFEST_BYTES:
        raise InvalidRequest(f"manifest_json of {len(raw)} bytes exceeds the limit of {layout.MAX_MANIFEST_BYTES}")
    depth = json_depth(raw)
    if depth > MAX_MANIFEST_DEPTH:
        raise InvalidRequest(f"manifest_json is nested {depth} levels deep, more than the limit of "
                             f"{MAX_MANIFEST_DEPTH} (a state may nest at most {layout.MAX_TREE_DEPTH} containers)")
    try:
        return layout.decode_manifest(raw, "manifest_json")
    except layout.ManifestError as e:
        raise InvalidRequest(str(e)) from e


def json_depth(raw: bytes, block: int = 1 << 20) -> int:
    """The deepest nesting of ``[`` and ``{`` in JSON text, strings excluded, without parsing it.

    Invalid JSON (an unterminated string) may read deeper than it is, never
    shallower than valid JSON would; the parser refuses it anyway.
    """
    bare = np.frombuffer(_JSON_STRING.sub(b'""', raw), dtype=np.uint8)
    deepest = level = 0
    for i in range(0, len(bare), block):  # in blocks: the running sum of a 64 MiB manifest stays small
        running = np.cumsum(_BRACKET_STEP[bare[i:i + block]], dtype=np.int32) + level
        deepest = max(deepest, int(running.max()))
        level = int(running[-1])
    return deepest


_BRACKET_STEP = np.zeros(256, dtype=np.int32)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


def _tensor_table(table: Any, data_bytes: int) -> list[layout.TensorEntry]:
    if not isinstance(table, list):
        raise InvalidRequest(f"manifest_json.tensors = {_short(table)} is not a list")
    if len(table) > MAX_TENSORS:
        raise InvalidRequest(f"manifest_json.tensors has {len(table)} tensors, more than the limit of {MAX_TENSORS}")
    return [_tensor_entry(i, t, data_bytes) for i, t in enumerate(table)]


def _tensor_entry(i: int, obj: Any, data_bytes: int) -> layout.TensorEntry:
    where = f"manifest_json.tensors[{i}]"
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where} = {_short(obj)} is not an object")
    name, dtype, shape = obj.get("name"), obj.get("dtype"), obj.get("shape")
    if not isinstance(name, str) or len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"{where}.name = {_short(name)} is not a str of at most {MAX_NAME_CHARS} characters")
    where = f"{where} ({_short(name)})"
    if not isinstance(dtype, str) or not _DTYPE_RE.fullmatch(dtype):
        raise InvalidRequest(f"{where}.dtype = {_short(dtype)} is not a dtype name")
    if not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS:
        raise InvalidRequest(f"{where}.shape = {_short(shape)} is not a list of at most {MAX_TENSOR_DIMS} sizes")
    dims = tuple(_check_int(f"{where}.shape[{d}]", n, 8 * MAX_PART_BYTES) for d, n in enumerate(shape))
    offset = _check_int(f"{where}.offset", obj.get("offset"), data_bytes)
    nbytes = _check_int(f"{where}.nbytes", obj.get("nbytes"), data_bytes)
    numel = 1
    for n in dims:
        numel *= n
    itemsize = _ITEMSIZE.get(dtype)
    if (numel * itemsize != nbytes) if itemsize else (numel > 8 * nbytes or (nbytes > 0) != (numel > 0)):
        raise InvalidRequest(f"{where}: shape {list(dims)} of {dtype} does not fit nbytes {nbytes}")
    if "global_shape" in obj or "global_offset" in obj:  # a DTensor's fragment: a box inside its global tensor
        _check_dims(f"{where}.global_shape", obj.get("global_shape"), obj)
        _check_dims(f"{where}.global_offset", obj.get("global_offset"), obj)
        if len(obj["global_shape"]) != len(dims) or len(obj["global_offset"]) != len(dims) or any(
                o + n > g for o, n, g in zip(obj["global_offset"], dims, obj["global_shape"])):
            raise InvalidRequest(f"{where}: fragment {list(dims)} at {obj['global_offset']} does not fit its "
                                 f"global shape {obj['global_shape']}")
    if not isinstance(obj.get("fqn", ""), str) or len(obj.get("fqn", "")) > MAX_NAME_CHARS:
        raise InvalidRequest(f"{where}.fqn = {_short(obj.get('fqn'))} is not a str of at most {MAX_NAME_CHARS} "
                             "characters")
    return layout.TensorEntry(name, dtype, dims, offset, nbytes)


def _check_tree(tree: Any, n_tensors: int) -> None:
    """Checks the state tree (client/tree.py's encoding) without recursion: depth, tensor refs, plain values."""
    stack: list[tuple[Any, str, int]] = [(tree, "state", 0)]
    while stack:
        node, path, depth = stack.pop()
        where = f"manifest_json.tree {path[:200]}"
        if not isinstance(node, dict) or len(node) != 1:
            raise InvalidRequest(f"{where} = {_short(node)} is not a tree node")
        (tag, value), = node.items()
        if tag in _CONTAINER_TAGS:
            if depth >= layout.MAX_TREE_DEPTH:
                raise InvalidRequest(f"{where} is nested more than {layout.MAX_TREE_DEPTH} containers deep, "
                                     "the limit for a saved state")
            if not isinstance(value, list):
                raise InvalidRequest(f"{where} = {_short(node)} is not a tree node")
            if tag in ("l", "t"):
                stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
                continue
            for item in value:
                if not isinstance(item, list) or len(item) != 2:
                    raise InvalidRequest(f"{where} has an item {_short(item)} that is not a [key, value] pair")
                key = _key(item[0], f"{where} (a key)", stack, path, depth)
                stack.append((item[1], f"{path}[{key!r}]", depth + 1))
        elif tag in _FIELD_TAGS or tag in _SET_TAGS:
            if depth >= layout.MAX_TREE_DEPTH:
                raise InvalidRequest(f"{where} is nested more than {layout.MAX_TREE_DEPTH} containers deep, "
                                     "the limit for a saved state")
            if not isinstance(value, list):
                raise InvalidRequest(f"{where} = {_short(node)} is not a tree node")
            if tag in _SET_TAGS:
                stack.extend((v, f"{path}<item {i}>", depth + 1) for i, v in enumerate(value))
                continue
            items = value
            if tag != "ns":
                if not value or not isinstance(value[0], dict) or not _is_name(value[0].get("cls")) or \
                        not set(value[0]) <= {"cls", "factory"} or not _is_name(value[0].get("factory", "")):
                    raise InvalidRequest(f"{where} = {_short(node)} does not start with its class")
                items = value[1:]
            for item in items:
                if not isinstance(item, list) or len(item) != 2:
                    raise InvalidRequest(f"{where} has an item {_short(item)} that is not a [key, value] pair")
                if tag == "M":
                    key = _key(item[0], f"{where} (a key)", stack, path, depth)
                    stack.append((item[1], f"{path}[{key!r}]", depth + 1))
                elif _is_name(item[0]):
                    stack.append((item[1], f"{path}.{item[0]}", depth + 1))
                else:
                    raise InvalidRequest(f"{where} has a field name {_short(item[0])} that is not a str")
        elif tag in _WRAPPER_TAGS:
            stack.append((value, path, depth))
        elif tag == "E":
            _key(node, where, stack, path, depth)
        elif tag == "A":  # a numpy array whose bytes are a tensor of the part
            if not isinstance(value, dict) or set(value) != {"dtype", "v"} or not _is_name(value["dtype"]) or \
                    not isinstance(value["v"], dict) or set(value["v"]) != {"T"}:
                raise InvalidRequest(f"{where} = {_short(node)} is not a numpy array node")
            _check_int(f"{where} (a tensor reference)", value["v"]["T"], n_tensors - 1)
        elif tag in ("a", "g"):  # a numpy array or scalar, inline
            if not isinstance(value, dict) or set(value) != ({"dtype", "data", "shape"} if tag == "a" else
                                                             {"dtype", "data"}) or not _is_name(value["dtype"]):
                raise InvalidRequest(f"{where} = {_short(node)} is not a numpy value node")
            if tag == "a":
                _check_dims(where, value["shape"], node)
            _plain({"y": value["data"]}, where)
        elif tag == "p":
            if not isinstance(value, list) or len(value) != 2 or not _is_name(value[0]):
                raise InvalidRequest(f"{where} = {_short(node)} is not a path node")
            _plain({"s": value[1]}, where)
        elif tag in _NAME_TAGS:
            if not _is_name(value):
                raise InvalidRequest(f"{where} = {_short(node)} is not a valid tree node")
        elif tag == "td":
            if not isinstance(value, list) or len(value) != 3 or any(type(n) is not int for n in value):
                raise InvalidRequest(f"{where} = {_short(node)} is not a timedelta node")
        elif tag in ("ts", "tt"):
            if not isinstance(value, dict) or not _is_name(value.get("iso")) or \
                    not set(value) <= {"iso", "tz", "fold"} or value.get("fold", 0) not in (0, 1) or \
                    not _is_tz(value.get("tz", {"zone": "UTC"})):
                raise InvalidRequest(f"{where} = {_short(node)} is not a datetime node")
        elif tag == "T":
            _check_int(f"{where} (a tensor reference)", value, n_tensors - 1)
        elif tag == "S":
            _check_dims(where, value, node)
        elif tag == "D":  # a DTensor: its fragments are tensor entries found by fqn (client/shards.py)
            if not isinstance(value, dict) or not isinstance(value.get("fqn"), str) or \
                    len(value["fqn"]) > MAX_NAME_CHARS or not isinstance(value.get("dtype"), str) or \
                    not _DTYPE_RE.fullmatch(value["dtype"]):
                raise InvalidRequest(f"{where} = {_short(node)} is not a sharded tensor node")
            _check_dims(where, value.get("shape"), node)
        else:
            _plain(node, where)


def _key(node: Any, where: str, stack: list[tuple[Any, str, int]], path: str, depth: int) -> Any:
    """A dict key's node (a plain value, an Enum member, a torch dtype): its value or name, for paths.

    An Enum member's value is a node of its own, pushed on ``stack``.
    """
    if isinstance(node, dict) and len(node) == 1 and "E" in node:
        value = node["E"]
        if not isinstance(value, dict) or set(value) != {"cls", "name", "v"} or not _is_name(value["cls"]) or \
                not (value["name"] is None or _is_name(value["name"])):
            raise InvalidRequest(f"{where} = {_short(node)} is not an Enum member node")
        stack.append((value["v"], f"{path}.{value['name']}", depth))
        return value["name"]
    if isinstance(node, dict) and len(node) == 1 and "dt" in node:
        if not _is_name(node["dt"]):
            raise InvalidRequest(f"{where} = {_short(node)} is not a valid tree node")
        return node["dt"]
    return _plain(node, where)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= MAX_NAME_CHARS


def _is_tz(tz: Any) -> bool:
    if not isinstance(tz, dict):
        return False
    if set(tz) == {"zone"}:
        return _is_name(tz["zone"])
    offset = tz.get("offset")
    return set(tz) <= {"offset", "name"} and isinstance(offset, list) and len(offset) == 3 and \
        all(type(n) is int for n in offset) and _is_name(tz.get("name", ""))


def _check_dims(where: str, value: Any, node: Any) -> None:
    if not isinstance(value, list) or len(value) > MAX_TENSOR_DIMS or \
            any(type(n) is not int or n < 0 for n in value):
        raise InvalidRequest(f"{where} = {_short(node)} does not hold a shape (at most {MAX_TENSOR_DIMS} sizes)")


def _plain(node: Any, where: str) -> Any:
    """The value of a plain node (None, bool, int, float, str, bytes); refuses anything else or too big."""
    if not isinstance(node, dict) or len(node) != 1:
        raise InvalidRequest(f"{where} = {_short(node)} is not a plain value node")
    tag: str
    value: Any
    (tag, value), = node.items()
    kind = _PLAIN_TAGS.get(tag)
    valid = kind is not None and type(value) is kind  # exact: a bool is no int here
    if not valid:
        raise InvalidRequest(f"{where} = {_short(node)} is not a valid tree node")
    if tag in ("s", "y"):
        try:
            layout.check_plain_value(value, where, base64_text=tag == "y")
        except layout.PlainValueTooLarge as e:
            raise InvalidRequest(str(e)) from None
    try:
        if tag == "f":
            return float.fromhex(value)
        if tag == "y":
            return base64.b64decode(value, validate=True)
    except ValueError as e:  # binascii.Error is a ValueError
        raise InvalidRequest(f"{where} = {_short(node)} does not decode: {e}") from None
    return value
