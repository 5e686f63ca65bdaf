"""A committed whole part rewritten as an incremental one, for benchmarks that read one state both ways."""

from __future__ import annotations

import mmap
from pathlib import Path

from _harness import MiB


def to_chunks(part: Path, every: int = 64 * MiB, body: int | None = None) -> Path:
    """Rewrites a committed whole part in place as an incremental one; returns its job's chunk store.

    The data file is cut as ``protos/chunks.py`` says (:func:`chunks.cut`;
    ``every`` is the daemon's streaming chunk), the pieces written into one
    pack of the job's chunk store on the part's tier, as the daemon writes a
    part's new chunks (:class:`FsPackBatch`, O_DIRECT), the data file removed, the manifest rewritten to list the chunks, and the step's
    commit record to name the new manifest. For benchmarks of the read
    path that want the same state whole and chunked from one daemon (the
    daemon's own ``[persist] incremental`` writes every part of a job so);
    call it on every tier's copy, after the drain, then restart the daemon
    (it knows the step by its old manifest).
    """
    from dataclasses import replace

    from ckptstage.daemon.tiers.fs import FsTier
    from ckptstage.protos import chunks, layout

    manifest = layout.read_manifest(part)
    job, rank = str(manifest["job"]), int(manifest["rank"])
    store = chunks.store_of(part, manifest)
    listed = []
    with open(part / layout.DATA_FILE, "rb", buffering=0) as f:
        data = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    tensors = [(int(t["offset"]), int(t["nbytes"])) for t in manifest["tensors"]]
    batch = FsTier(part.parent.parent.parent, "bench").new_chunks(job)
    written = set()
    for lo, hi in chunks.cut(len(data), tensors, every, body or chunks.BODY_BYTES):
        name = chunks.digest(data[lo:hi])
        if name not in written:
            batch.write(name, data[lo:hi], direct_io=True)
            written.add(name)
        listed.append(chunks.Chunk(lo, hi, name))
    batch.publish()
    data.release()
    manifest["chunks"] = {layout.DATA_FILE: chunks.chunk_list(listed)}
    raw = layout.manifest_file_bytes(manifest)
    (part / layout.MANIFEST_FILE).write_bytes(raw)
    (part / layout.DATA_FILE).unlink()
    record = layout.read_commit_record(part.parent)
    if record is None:
        raise RuntimeError(f"{part.parent} has no commit record: convert committed parts only")
    parts = dict(record.parts)
    parts[rank] = replace(parts[rank], manifest_digest=layout.chunk_digest(raw))
    (part.parent / layout.COMMIT_FILE).write_bytes(layout.commit_record_bytes(replace(record, parts=parts)))
    (part.parent / layout.STEP_INDEX_FILE).unlink(missing_ok=True)  # the step's manifests, as they were
    return store
