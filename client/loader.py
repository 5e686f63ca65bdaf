"""Which copy a load reads and what it does when one fails: the load and fallback policy of ``Client.load``.

The daemon names the copies of a rank's part, best first: the memory tier's
(mapped, no disk read), then the local tier's, then the shared tier's. A
copy that fails verification is reported to the daemon and the next one is
read; an error of this process's own proves nothing about a copy and is
never reported. A copy that vanishes while it is read (retention) or a step
that a save with ``overwrite`` replaced meanwhile is not corruption: the
step is located and read again, a few times.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ckptstage.client import errors, reshard, steps, tree
from ckptstage.client.loadlease import LoadLease
from ckptstage.client.memread import read_memory_part
from ckptstage.client.restore import read_part
from ckptstage.client.rpc import Connection
from ckptstage.protos import layout
from ckptstage.protos.handoff import NotInMemory
from ckptstage.protos.v1 import ckptstage_pb2 as pb

log = logging.getLogger(__name__)

# How long a reader whose copy failed verification asks whether the step was replaced meanwhile, before it
# takes the copy for corrupt (the daemon indexes a replacement's commit just after putting its parts in place).
_REPLACED_SETTLE_S = 1.0
# Times a load locates the step again after a copy vanished or the step was replaced while it was read,
# waiting a little longer each time (jittered: a reader must not fall in step with a writer replacing the
# step again and again, every read landing on a swap).
_TRIES = 6
_RETRY_WAIT_S = 0.01


class Loader:
    """Loads one rank's view of a job's steps from the daemon on ``conn`` (see ``Client.load``)."""

    def __init__(self, conn: Connection, job: str, rank: int, world_size: int) -> None:
        self._conn = conn
        self.job, self.rank, self.world_size = job, rank, world_size
        self.last_tier: str | None = None  # the tier the last load read this rank's part from

    def load(self, step: int | None, into: Any) -> Any:
        """The state saved at ``step`` (newest complete when None), verified: ``Client.load``.

        With ``into``, entries the checkpoint holds under another key path than ``into`` (a DCP step's
        flat keys, or its keys made strings) come back where ``into`` has them (:func:`tree.arranged_like`).
        """
        with LoadLease(self._conn):  # the node's drains wait while this rank reads
            state = self._load(step, into)
        return tree.arranged_like(state, into) if into is not None else state

    def _load(self, step: int | None, into: Any) -> Any:
        target = tree.flatten_state(into) if into is not None else None
        tries = _TRIES
        for attempt in range(1, tries + 1):
            if attempt > 1:
                time.sleep(random.uniform(0.5, 1.5) * _RETRY_WAIT_S * 2 ** (attempt - 2))
            # This rank's part, if the step has one: a rank beyond the step's world size reads rank 0's.
            located = steps.locate(self._conn, self.job, step, self.rank, ranks=[self.rank], memory=True)
            step = located.step  # pinned down: a retry reads the same step
            tree_rank = located.tree_rank(self.rank, self.world_size)
            if located.world_size != self.world_size:  # rank 0's values, which every rank here reads: a node copy
                located = steps.locate(self._conn, self.job, step, tree_rank, all_ranks=False, memory=True,
                                       node_copy=True)
            if tree_rank not in located.parts:
                raise errors.CheckpointNotFound(f"{self.job} step {step}: the daemon did not say where rank "
                                                f"{tree_rank}'s part is")
            try:
                if (target is not None and target.sharded) or _is_sharded(located.parts[tree_rank]):
                    located = steps.locate(self._conn, self.job, step, self.rank, step_index=True)  # every part
                    with steps.OpenStep(self._conn, located, node_copy=located.world_size != self.world_size) \
                            as opened:
                        return opened.view.load(tree_rank, target, union=located.world_size != self.world_size)
            except layout.ManifestError as e:
                if not layout.is_verification_failure(e):
                    raise  # this process's own trouble (see above): nothing is known about the copies
                if attempt < tries and self._replaced(step, located.commit, _settle(e)):
                    continue
                raise errors.CorruptCheckpoint(f"no copy of {self.job} step {step} verifies: {e}") from e
            except FileNotFoundError:
                if attempt == tries:
                    raise
                continue  # retention removed a copy while it was read: ask again
            memory = located.memory.get(tree_rank)
            if memory is not None:
                found, state = self._read_memory(memory, step, tree_rank, into)
                if found:
                    return state
            if not located.parts[tree_rank]:  # a step kept in memory only, and gone from there since
                if attempt == tries:
                    raise errors.CheckpointNotFound(f"{self.job} step {step} was kept in memory only, and the "
                                                    "daemon no longer holds it")
                continue
            state, moved = self._load_part(step, tree_rank, located.parts[tree_rank], into, located.commit,
                                           located.digests)
            if not moved:
                return state
        raise errors.CheckpointNotFound(f"{self.job} step {step} was removed or replaced each of the {tries} times "
                                        "it was read; load it again")

    def _replaced(self, step: int, commit: str, settle_s: float = 0.0) -> bool:
        """Whether ``step`` is another commit than ``commit`` when the daemon is asked again, asking for up
        to ``settle_s`` (see :func:`_settle`).

        A step that is gone is not replaced: the daemon may just have
        quarantined the copy this reader (or another) reported corrupt; a
        copy deleted under the reader shows as its files vanishing instead.
        """
        deadline = time.monotonic() + settle_s
        while True:
            try:
                if steps.locate(self._conn, self.job, step, self.rank, all_ranks=False).commit != commit:
                    return True
            except errors.CheckpointNotFound:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _read_memory(self, socket: Path, step: int, rank: int, into: Any) -> tuple[bool, Any]:
        """(True, state) from the memory tier's copy of the part; (False, None) when it cannot be had there
        (gone since Locate answered, or failed verification): the caller reads the disk copies."""
        try:
            _, state = read_memory_part(socket, self.job, step, rank, into)
        except (NotInMemory, OSError) as e:
            log.info("checkpoint %s step %d rank %d: not read from memory (%s); reading it from disk", self.job,
                     step, rank, e)
        except layout.ManifestError as e:
            if not layout.is_verification_failure(e):
                raise
            log.error("checkpoint %s step %d rank %d: the memory copy failed verification (%s); reading it "
                      "from disk", self.job, step, rank, e)
            try:
                self._conn.call("ReportCorrupt", pb.ReportCorruptRequest(
                    job=self.job, step=step, rank=rank, tier=pb.MEMORY, detail=str(e)))
            except errors.CkptStageError as report_error:  # the disk copies are read all the same
                log.warning("could not report the bad memory copy: %s", report_error)
        else:
            self.last_tier = "memory"
            return True, state
        return False, None

    def _load_part(self, step: int, rank: int, locations: Sequence[tuple[pb.Tier, Path]], into: Any,
                   commit: str = "", digests: Mapping[Path, str] | None = None) -> tuple[Any, bool]:
        """One rank's whole part, from its first copy that verifies; (state, whether a copy vanished or the
        step was replaced meanwhile: then the caller asks the daemon again)."""
        failures, moved = [], False
        own_errors: list[BaseException] = []
        for tier_code, part in locations:
            tier = pb.Tier.Name(tier_code).lower()
            ino = _inode(part)
            try:
                _, state = read_part(part, into, committed=(digests or {}).get(part, ""))
                self.last_tier = tier
                return state, False
            except (layout.ManifestError, OSError, MemoryError) as e:
                if not part.exists():
                    # Retention deleted (or the daemon quarantined) this copy after Locate
                    # answered: not corruption. Locate again if no other copy verifies.
                    moved = True
                    log.info("checkpoint %s step %d rank %d: %s copy removed while reading it", self.job,
                             step, rank, tier)
                    failures.append(f"{tier}: {part} was removed while reading it")
                    continue
                # The manifest and the data read from two versions of the part: a replacement swapped
                # the directory between the two reads (the daemon may not have indexed it yet).
                if layout.is_verification_failure(e) and (_inode(part) != ino or
                                                          commit and self._replaced(step, commit, _settle(e))):
                    log.info("checkpoint %s step %d was replaced while it was read; reading it again", self.job,
                             step)
                    return None, True
                failures.append(f"{tier}: {e}")
                if not layout.is_verification_failure(e):
                    own_errors.append(e)
                    log.warning("checkpoint %s step %d rank %d: cannot read the %s copy here: %s", self.job,
                                step, rank, tier, e)
                    continue
                log.error("checkpoint %s step %d rank %d: %s copy failed verification: %s", self.job,
                          step, rank, tier, e)
                self._conn.call("ReportCorrupt", pb.ReportCorruptRequest(
                    job=self.job, step=step, rank=rank, tier=tier_code, detail=str(e)))
                if tier_code == pb.PEER:
                    moved = True  # the daemon dropped its replica: asked again, it fetches another node's copy
        if moved:
            return None, True
        if own_errors and len(own_errors) == len(failures):
            raise own_errors[0]  # nothing is known to be wrong with the checkpoint, only with this process
        raise errors.CorruptCheckpoint(f"no copy of {self.job} step {step} rank {rank} verifies: "
                                       + "; ".join(failures))


def _settle(error: BaseException) -> float:
    """How long to ask whether a step was replaced after a read failed with ``error``: a replacement (save with
    overwrite) puts its parts in place a moment before the daemon's index names its commit, so a reader in
    between finds a part that verifies but is not the commit it was told of; no other failure needs a wait."""
    return _REPLACED_SETTLE_S if isinstance(error, layout.ManifestNotCommitted) else 0.0


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _is_sharded(locations: Sequence[tuple[int, Path]]) -> bool:
    """Whether the part (its first copy whose manifest reads) holds DTensor fragments."""
    for _, part in locations:
        try:
            return reshard.has_sharded(layout.read_manifest(part))
        except layout.ManifestError:
            continue
    return False
