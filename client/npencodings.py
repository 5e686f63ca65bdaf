"""numpy values in the tree encoding: arrays (inline, or stored as tensors), scalars, random states and bit
generators, written as tagged nodes and read back (see docs/FORMAT.md)."""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from typing import Any

import torch

from ckptstage.client.walker import Walker
from ckptstage.protos import layout

INLINE_ARRAY_BYTES = 4096
"""numpy arrays of at most this many bytes travel inline in the tree (so every
numpy random state does); larger ones are tensors of the tensor list."""

_NP_KINDS = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8), "c": (8, 16), "m": (8,), "M": (8,)}
_BIT_GENERATORS = ("MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64")


# --- encoding ---------------------------------------------------------------------------------


def encode_numpy(np: Any, obj: Any, path: str, w: Walker) -> Any:
    kind = type(obj)
    if kind is np.ndarray:
        return _array(np, obj, path, w)
    if isinstance(obj, np.generic):
        _check_dtype(obj.dtype, path, "scalar")
        return {"g": {"dtype": obj.dtype.str, "data": base64.b64encode(obj.tobytes()).decode()}}
    if kind is np.random.Generator:
        return {"G": _bit_generator_state(np, obj.bit_generator, path, w)}
    if kind is np.random.RandomState:
        return {"Q": w.plain(obj.get_state(legacy=False), f"{path}.get_state()", False)}
    if isinstance(obj, np.random.BitGenerator):
        return {"B": _bit_generator_state(np, obj, path, w)}
    if isinstance(obj, np.ndarray):
        raise TypeError(f"{path} is a {kind.__module__}.{kind.__qualname__} (an ndarray subclass); ckptstage saves "
                        "numpy.ndarray itself: convert it with numpy.asarray(value)")
    return None


def _array(np: Any, arr: Any, path: str, w: Walker) -> Any:
    dtype = arr.dtype
    _check_dtype(dtype, path, "array")
    if arr.nbytes <= INLINE_ARRAY_BYTES or w.inline_arrays:
        if arr.nbytes > layout.MAX_PLAIN_VALUE_BYTES:
            raise ValueError(f"{path} is a numpy array of {arr.nbytes} bytes; a value inside a DCP value travels "
                             f"in the manifest, at most {layout.MAX_PLAIN_VALUE_BYTES} bytes: make it a state key")
        return {"a": {"dtype": dtype.str, "shape": list(arr.shape), "data": base64.b64encode(arr.tobytes()).decode()}}
    if not dtype.isnative:
        arr = arr.astype(dtype.newbyteorder("="))
    if dtype.kind in "mM":
        arr = arr.view(np.int64)
    if not arr.flags.writeable or any(s < 0 for s in arr.strides):
        arr = arr.copy()  # torch shares only writable memory with positive strides
    try:
        t = torch.from_numpy(arr)
    except (TypeError, ValueError):  # strides that are not a multiple of the element size
        t = torch.from_numpy(np.ascontiguousarray(arr))
    return {"A": {"dtype": dtype.str, "v": w.tensor(t)}}


def _check_dtype(dtype: Any, path: str, what: str) -> None:
    if dtype.itemsize in _NP_KINDS.get(dtype.kind, ()) and dtype.fields is None and dtype.subdtype is None:
        return
    hint = ("ckptstage never pickles: convert it (to a list, or to an array of a numeric dtype)"
            if dtype.kind == "O" else "convert it to a bool, integer, float or complex dtype of at most 64 bits "
            "per part (e.g. .astype(numpy.float64)), or to a str/bytes value")
    raise TypeError(f"{path} is a numpy {what} of dtype {dtype}; ckptstage saves bool, integer, float (16, 32, 64 "
                    f"bit), complex (64, 128 bit), datetime64 and timedelta64 numpy values — {hint}")


def _bit_generator_state(np: Any, bg: Any, path: str, w: Walker) -> Any:
    name = type(bg).__name__
    if name not in _BIT_GENERATORS or type(bg) is not getattr(np.random, name):
        raise TypeError(f"{path} is a numpy bit generator of class {type(bg).__module__}.{type(bg).__qualname__}; "
                        f"ckptstage restores {', '.join(_BIT_GENERATORS)}: save its .state dict instead")
    seq: Any = getattr(bg, "seed_seq", None)
    seed = None
    if type(seq) is np.random.SeedSequence:
        seed = {"entropy": seq.entropy, "spawn_key": list(seq.spawn_key), "pool_size": seq.pool_size,
                "n_children_spawned": seq.n_children_spawned}
    return w.plain({"state": bg.state, "seed_seq": seed}, f"{path}.bit_generator", False)


# --- decoding ---------------------------------------------------------------------------------


def _dec_array(v: Any, dec: Callable[[Any], Any]) -> Any:
    import numpy as np
    dtype = np.dtype(str(v["dtype"]))
    _check_loaded_dtype(dtype)
    shape = [int(n) for n in v["shape"]]
    raw = base64.b64decode(v["data"])
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise ValueError(f"numpy array node of {len(raw)} bytes for shape {shape} of {dtype} in manifest")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _dec_stored_array(v: Any, dec: Callable[[Any], Any]) -> Any:
    import numpy as np
    dtype = np.dtype(str(v["dtype"]))
    _check_loaded_dtype(dtype)
    t = dec(v["v"])
    if not isinstance(t, torch.Tensor):
        return t  # a reader's stand-in for a tensor (the DCP metadata builder's TensorRef)
    arr = t.numpy()  # shares memory with the tensor: a load into= fills the caller's array in place
    if dtype.kind in "mM":
        return arr.view(dtype)
    return arr if arr.dtype == dtype else arr.astype(dtype)


def _dec_scalar(v: Any, dec: Callable[[Any], Any]) -> Any:
    import numpy as np
    dtype = np.dtype(str(v["dtype"]))
    _check_loaded_dtype(dtype)
    raw = base64.b64decode(v["data"])
    if len(raw) != dtype.itemsize:
        raise ValueError(f"numpy scalar node of {len(raw)} bytes for {dtype} in manifest")
    return np.frombuffer(raw, dtype=dtype)[0]


def _check_loaded_dtype(dtype: Any) -> None:
    if not (dtype.itemsize in _NP_KINDS.get(dtype.kind, ()) and dtype.fields is None and dtype.subdtype is None):
        raise ValueError(f"numpy dtype {dtype} in manifest is not one ckptstage writes")


def _bit_generator(state: Any) -> Any:
    import numpy as np
    name = state["state"]["bit_generator"]
    if name not in _BIT_GENERATORS:
        raise ValueError(f"numpy bit generator {name!r} in manifest is not one ckptstage restores")
    cls = getattr(np.random, name)
    seed = state.get("seed_seq")
    if seed is not None:
        _check_seed_sequence(seed)
    bg = cls(np.random.SeedSequence(**seed)) if seed is not None else cls()
    bg.state = state["state"]
    return bg


_SEED_FIELDS = {"entropy", "spawn_key", "pool_size", "n_children_spawned"}
_MAX_POOL_SIZE = 1024  # numpy's default is 4; a manifest naming more would only cost memory at load
_MAX_SPAWN_DEPTH = 1024


def _check_seed_sequence(seed: Any) -> None:
    """What numpy.random.SeedSequence is rebuilt from: the fields ckptstage writes, within sane bounds."""
    if not isinstance(seed, dict) or not set(seed) <= _SEED_FIELDS:
        raise ValueError(f"numpy seed sequence {str(seed)[:80]} in manifest has fields ckptstage does not write")
    pool = seed.get("pool_size", 4)
    if type(pool) is not int or not 4 <= pool <= _MAX_POOL_SIZE:
        raise ValueError(f"numpy seed sequence pool_size {str(pool)[:40]} in manifest is outside 4..{_MAX_POOL_SIZE}")
    key = seed.get("spawn_key", [])
    if not isinstance(key, list) or len(key) > _MAX_SPAWN_DEPTH or any(type(k) is not int for k in key):
        raise ValueError(f"numpy seed sequence spawn_key in manifest is not a list of at most "
                         f"{_MAX_SPAWN_DEPTH} integers")


def _random_state(state: Any) -> Any:
    import numpy as np
    name = state["bit_generator"]
    if name not in _BIT_GENERATORS:
        raise ValueError(f"numpy bit generator {name!r} in manifest is not one ckptstage restores")
    rs = np.random.RandomState(getattr(np.random, name)())
    rs.set_state(state)
    return rs


DECODERS: dict[str, Callable[[Any, Callable[[Any], Any]], Any]] = {
    "a": _dec_array, "A": _dec_stored_array, "g": _dec_scalar,
    "G": lambda v, dec: __import__("numpy").random.Generator(_bit_generator(dec(v))),
    "B": lambda v, dec: _bit_generator(dec(v)),
    "Q": lambda v, dec: _random_state(dec(v)),
}
"""The numpy nodes' decoders, by tag."""
