"""Writing the newest memory-only step to local SSD at stop: which step, and only bytes that check out.

Real arenas (shared memory files in a temp dir), a real file-system tier, the
real catalogue and commit records; the images are what a memory-only save
leaves: the data file's bytes in an arena and the manifest vouching for them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ckptstage.daemon.save.arena import Arena
from ckptstage.daemon.catalog.index import Catalog, Part, TierName
from ckptstage.daemon.catalog.commits import Commits
from ckptstage.daemon.tiers.fs import FsTier
from ckptstage.daemon.save.memflush import newest_steps, persist_newest
from ckptstage.daemon.save.memtier import Resident
from ckptstage.protos import layout

JOB = "flush"
BLOCK = 4096


class Node:
    """What the flush needs of a daemon: its local tier, catalogue and commit records, and arenas."""

    def __init__(self, root: Path) -> None:
        self.shm = root / "shm"
        self.shm.mkdir()
        self.tier = FsTier(root / "local", "test-node")
        self.catalog = Catalog(root / "state" / "pins.json")
        self.commits = Commits(self.catalog, self.tier, None)
        self.arenas: list[Arena] = []

    def image(self, step: int, rank: int, world_size: int = 2, nbytes: int = 3 * BLOCK + 100,
              attempt: str = "run-1") -> Resident:
        """A memory-only save's image: its bytes at an offset in an arena, and its manifest."""
        data = bytes((step * 7 + rank + i) % 251 for i in range(nbytes))
        arena = Arena(f"arena-{len(self.arenas)}", 2 * BLOCK + nbytes, 0, self.shm)
        self.arenas.append(arena)
        offset = BLOCK
        arena.view[offset:offset + nbytes] = data
        manifest = {"format": layout.FORMAT, "job": JOB, "step": step, "rank": rank, "world_size": world_size,
                    "tensors": [], "tree": {}, "created": time.time(), "metrics": {"loss": 0.5},
                    "attempt": attempt, "files": {layout.DATA_FILE: layout.FileEntry(
                        nbytes, BLOCK, tuple(layout.block_digests(data, BLOCK))).to_json()}}
        return Resident(JOB, step, rank, world_size, attempt, arena, offset, nbytes, None,
                        layout.manifest_file_bytes(manifest))

    def on_disk(self, step: int, rank: int, world_size: int = 2) -> None:
        """A part of ``step`` committed on the local tier and indexed, as a save on the cadence leaves it."""
        writer = self.tier.begin_part(JOB, step, rank)
        sink = writer.create_file(layout.DATA_FILE, 1, direct_io=False)
        sink.write(memoryview(b"x"), 0)
        sink.sync()
        sink.close()
        manifest = {"format": layout.FORMAT, "job": JOB, "step": step, "rank": rank, "world_size": world_size,
                    "tensors": [], "tree": {}, "created": 1.0, "attempt": "run-1",
                    "files": {layout.DATA_FILE: layout.FileEntry(1, BLOCK, tuple(layout.block_digests(b"x", BLOCK)))
                              .to_json()}}
        where = writer.commit(manifest)
        self.catalog.add(Part.from_manifest(layout.PartRef(JOB, step, rank, where, writer.ino), TierName.LOCAL,
                                            manifest, writer.manifest_digest))

    def flush(self, images: list[Resident], within_s: float = 60.0) -> Any:
        return persist_newest(images, self.catalog, self.tier, self.commits, time.monotonic() + within_s)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    for arena in n.arenas:
        arena.close()


def test_the_newest_whole_step_is_written_verified_indexed_and_sealed(node: Node) -> None:
    node.on_disk(10, 0)
    node.on_disk(10, 1)
    images = [node.image(11, 0), node.image(11, 1), node.image(12, 0), node.image(12, 1)]
    outcome = node.flush(images)
    assert outcome.missed == []
    assert sorted((p.step, p.rank) for p in outcome.written) == [(12, 0), (12, 1)]
    ckpt = node.catalog.get(JOB, 12)
    assert ckpt is not None and ckpt.complete_on(TierName.LOCAL)  # indexed, and its record written
    assert layout.commit_path(node.tier.root, JOB, 12).exists()
    assert node.catalog.get(JOB, 11) is None  # only the newest
    for part, image in zip(sorted(outcome.written, key=lambda p: p.rank), images[2:], strict=True):
        node.tier.verify_part(part.path)
        assert (part.path / layout.DATA_FILE).read_bytes() == bytes(image.arena.view[image.offset:
                                                                                    image.offset + image.size])
        assert part.metrics == {"loss": 0.5} and part.attempt == "run-1" and part.nbytes == image.size


def test_an_image_overwritten_after_its_commit_is_not_written_and_the_step_is_not_sealed(node: Node) -> None:
    good, torn = node.image(12, 0), node.image(12, 1)
    at = torn.offset + 2 * BLOCK + 5  # a later save began copying over the image's third block
    torn.arena.view[at] = torn.arena.view[at] ^ 0xFF
    outcome = node.flush([good, torn])
    assert [(p.step, p.rank) for p in outcome.written] == [(12, 0)]
    [(job, step, rank, why)] = outcome.missed
    assert (job, step, rank) == (JOB, 12, 1) and "overwritten" in why and "chunk 2" in why, why
    assert not node.tier.has_part(node.tier.part_location(JOB, 12, 1))
    assert not layout.commit_path(node.tier.root, JOB, 12).exists()  # rank 1 is missing: no record


@pytest.mark.parametrize(("held", "why"), [
    ([(11, 0), (11, 1), (12, 0)], "step 12 lacks rank 1, which this node holds an image of (step 11)"),
    ([(9, 0), (9, 1)], "step 9 is older than step 10 on the local tier"),
])
def test_no_step_is_written_that_a_restart_would_not_load(node: Node, held: list[tuple[int, int]], why: str) -> None:
    node.on_disk(10, 0)
    node.on_disk(10, 1)
    images = [node.image(step, rank) for step, rank in held]
    assert newest_steps(images, node.catalog) == ([[images[0], images[1]]] if len(held) == 3 else []), why
    if len(held) == 3:  # step 11 is whole here, 12 is not: 11 is the one written
        assert [(p.step, p.rank) for p in node.flush(images).written] == [(11, 0), (11, 1)]
    else:
        assert node.flush(images).written == []


def test_images_of_parts_on_disk_and_of_other_attempts_do_not_mix(node: Node) -> None:
    on_ssd = node.image(13, 0)
    on_ssd = Resident(**{**on_ssd.__dict__, "part_dir": Path("/somewhere"), "manifest": None})  # on disk already
    mixed = [node.image(14, 0, attempt="run-1"), node.image(14, 1, attempt="run-2")]
    assert newest_steps([on_ssd, *mixed], node.catalog) == []


def test_what_the_deadline_leaves_unwritten_is_named(node: Node) -> None:
    outcome = node.flush([node.image(12, 0), node.image(12, 1)], within_s=0)
    assert outcome.written == [] and [(m[2], m[3]) for m in outcome.missed] == [(0, "no time left"),
                                                                               (1, "no time left")]
