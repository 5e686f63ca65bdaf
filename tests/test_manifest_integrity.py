"""The manifest is verified before any field of it is trusted.

A manifest names the step, every tensor's name, dtype, shape and offset, and
holds every plain value of the state: one changed byte used to make load()
return another step number or another tensor, silently. Its digest trailer
now makes every change either detected or harmless, shown here by changing
every single byte of a real manifest, one at a time.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from ckptstage.client import Client
from ckptstage.client import restore
from ckptstage.client.errors import CkptStageError
from ckptstage.protos import layout
from support import wait_until

JOB = "mf"


def state_of(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step,
                      "b": torch.tensor([1, 2, 3], dtype=torch.int16)},
            "step": step, "lr": 0.5, "name": "run"}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


def test_every_single_byte_change_of_a_real_manifest_is_detected_or_harmless(daemon: Any,
                                                                             tmp_path: Path) -> None:
    with Client(JOB, socket=daemon.socket) as c:
        c.save(7, state_of(7)).wait("local", timeout=30)
    shutil.copytree(daemon.local / JOB, tmp_path / JOB)  # the part, and the job's chunk store an incremental one needs
    part = layout.part_dir(tmp_path, JOB, 7, 0)
    good = (part / layout.MANIFEST_FILE).read_bytes()
    assert same(restore.read_part(part)[1], state_of(7))
    detected = harmless = 0
    for i in range(len(good)):
        for flip in (0x01, 0x20, 0x80):
            bad = bytearray(good)
            bad[i] ^= flip
            (part / layout.MANIFEST_FILE).write_bytes(bytes(bad))
            try:
                _, state = restore.read_part(part)
            except layout.ManifestError:
                detected += 1
                continue
            assert same(state, state_of(7)), f"byte {i} ^ {flip:#x} changed what load() returns"
            harmless += 1
    assert detected == 3 * len(good) and harmless == 0  # with a 64-bit digest, nothing slips through here


def test_a_changed_local_manifest_loads_the_shared_copy_and_is_quarantined(daemon: Any) -> None:
    with Client(JOB, socket=daemon.socket) as c:
        c.save(7, state_of(7)).wait("shared", timeout=30)
        path = layout.part_dir(daemon.local, JOB, 7, 0) / layout.MANIFEST_FILE
        raw = path.read_bytes()
        path.write_bytes(raw.replace(b'"step":7', b'"step":8', 1))  # a different step, still valid JSON
        assert same(c.load(7), state_of(7))  # the shared copy, verified
        wait_until(lambda: not path.parent.exists(), 20, "the daemon to quarantine the changed local copy")
        assert list(path.parent.parent.glob(".corrupt-rank-00000-*"))


def copy_part(src: Path, dst: Path) -> None:
    """Copies every file of part ``src`` over ``dst``'s: its manifest and data file (an incremental part's
    chunks are its job's store's, on the same tier, where the manifest names them)."""
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)


def test_a_manifest_rewritten_whole_is_not_the_committed_one(daemon: Any) -> None:
    """Step 6's local part replaced by another part that verifies by itself (step 8's manifest and data,
    trailer and checksums all good): the commit record names step 6's manifest, so the reader takes the
    shared copy, and the daemon's own check agrees and quarantines the local one; where no copy is the
    committed one, the load fails naming it, never returning step 8's values."""
    with Client(JOB, socket=daemon.socket) as c:
        for step in (6, 8):
            c.save(step, state_of(step)).wait("shared", timeout=30)
        six, eight = (layout.part_dir(daemon.local, JOB, s, 0) for s in (6, 8))
        copy_part(eight, six)
        restore.read_part(six)  # the rewritten part verifies by itself
        assert same(c.load(6), state_of(6))
        wait_until(lambda: not six.exists(), 20, "the daemon to quarantine the rewritten local copy")
        assert c.last_load_tier == "shared"
        shared_six = layout.part_dir(daemon.shared, JOB, 6, 0)
        copy_part(layout.part_dir(daemon.shared, JOB, 8, 0), shared_six)
        with pytest.raises(CkptStageError, match=r"manifest digest .* is not the .* the step's commit record names"):
            c.load(6)


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b"{" * 5000])
def test_a_deeply_nested_or_broken_manifest_is_a_manifest_error(tmp_path: Path, body: bytes) -> None:
    part = tmp_path / "part"
    part.mkdir()
    (part / layout.MANIFEST_FILE).write_bytes(body + b"\n" + layout.manifest._manifest_trailer(body) + b"\n")
    with pytest.raises(layout.ManifestError):
        layout.read_manifest(part)
