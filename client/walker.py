"""What an encoder asks of the tree walk: the seam between :mod:`ckptstage.client.tree` and the encodings."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Walker(Protocol):
    """What an encoder asks of the tree walk, at the value it is encoding."""

    inline_arrays: bool

    def child(self, value: Any, path: str, segment: Any) -> Any:
        """The node of a value held by this one; ``segment`` extends the key path that names tensors (fqn)."""

    def plain(self, value: Any, path: str, nested: bool = True) -> Any:
        """The node of a value held by this one that must hold no tensor (a set element, an Enum's value);
        ``nested=False``: a part of this value (a random state), not one more level of nesting."""

    def key(self, key: Any, path: str) -> Any:
        """The node of a dict key (see the key rules in :mod:`ckptstage.client.tree`)."""

    def tensor(self, t: torch.Tensor) -> Any:
        """A tensor node for ``t``, stored in the tensor list under this value's key path."""
