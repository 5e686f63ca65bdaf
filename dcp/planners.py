"""DCP's default planners with ckptstage's value encoding for non-tensor values (no pickle either way).

Tensors are planned exactly as DCP's default planners plan them (flattening,
resharding, deduplication); only the bytes of non-tensor values differ:
:mod:`ckptstage.dcp.values` instead of ``torch.save`` / ``torch.load``.
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ckptstage.dcp import values


class SavePlanner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose non-tensor values are ckptstage's JSON encoding, not ``torch.save`` pickles.

    Replicated tensors (the same key on several ranks) are written by the
    lowest rank holding them, as ``Client.save`` keeps plain tensors of
    rank 0 for other world sizes. The state it plans is kept
    (``original_state_dict``, as DCP's load planner keeps its own), so that
    :class:`ckptstage.dcp.Writer` stores the step in the tree ``Client.save``
    would store: key types (an optimizer's ``int`` keys), ``OrderedDict``
    and empty containers included (see :func:`ckptstage.dcp.writer.nest`).
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_save_to_lowest_rank: bool = True, enable_plan_caching: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors,
                         dedup_save_to_lowest_rank=dedup_save_to_lowest_rank,
                         enable_plan_caching=enable_plan_caching)

    def set_up_planner(self, state_dict: STATE_DICT_TYPE, storage_meta: StorageMeta | None = None,
                       is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's name
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(values.encode(object, write_item.index.fqn))
        return super().transform_object(write_item, object)


class LoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor values from ckptstage's encoding and never unpickles.

    A value the checkpoint holds as ``torch.save`` bytes (saved through DCP's
    default planner, of a type ckptstage cannot encode) is refused with an
    error naming its key.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.load_value(read_item, values.decode(value.getvalue(), read_item.dest_index.fqn))

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """Puts a non-tensor value in the state; :class:`ckptstage.dcp.Reader` calls it directly, with no bytes
        in between (so a value holding tensors, which DCP stores as one item, loads as well)."""
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value
