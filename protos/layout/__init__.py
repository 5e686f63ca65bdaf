"""Checkpoints at rest: names, paths on a tier, the manifest and its checksums.

Both the daemon (which writes and drains checkpoints) and the client (which
reads them back) import this module, so it must stay free of torch and of the
daemon. The format is described for people in docs/FORMAT.md.

A tier directory looks like::

    <tier>/<job>/step-000000000010/rank-00000/data.safetensors
                                             /manifest.json
    <tier>/<job>/step-000000000010/commit.json   the step's commit record, written last
    <tier>/.tmp/<node>/<random>/   temporaries, renamed into place on commit

A *part* is one rank's share of one step. A part directory exists only once
it is complete: it is written under ``.tmp``, every file fsynced, the
manifest written last, then renamed into place and its parent fsynced.

A *step* exists on a tier only once its commit record (:class:`CommitRecord`)
is there: written when every rank's part of one *attempt* (one run of the
job, agreed by all its ranks) is committed on that tier, and naming each
part's size and the digest of its manifest file.

This package only re-exports: ``layout.X`` is the one name for each piece of the format, wherever it is
written (:mod:`.names`, :mod:`.checksums`, :mod:`.manifest`, :mod:`.records`, :mod:`.stepindex`).
"""

from ckptstage.protos.layout.names import (  # noqa: F401 - re-exported
    CHECKSUM,
    COMMIT_FILE,
    SEAL_CLAIM_FILE,
    STEP_INDEX_FILE,
    CORRUPT_PREFIX,
    ChecksumMismatch,
    DATA_FILE,
    DEFAULT_CHUNK_BYTES,
    DIGEST_BLOCK_BYTES,
    FORMAT,
    InvalidName,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    MAX_PLAIN_VALUE_BYTES,
    MAX_RANK,
    MAX_REPLACES,
    MAX_STEP,
    MAX_TREE_DEPTH,
    ManifestError,
    PartRef,
    PlainValueTooLarge,
    StepRef,
    TMP_DIR,
    check_attempt,
    check_job,
    check_plain_value,
    check_rank,
    check_step,
    commit_path,
    is_verification_failure,
    parse_corrupt_dirname,
    parse_rank_dirname,
    parse_step_dirname,
    part_dir,
    plain_value_bytes,
    rank_dirname,
    scan_jobs,
    scan_steps,
    scan_tier,
    step_dir,
    step_dirname,
    tmp_root,
)
from ckptstage.protos.layout.checksums import (  # noqa: F401 - re-exported
    FileEntry,
    BlockVerifier,
    Locate,
    block_digests,
    block_mismatch,
    chunk_count,
    chunk_digest,
    digest_block_bytes,
    fsync_dir,
    fsync_path,
    verify_block,
    verify_blocks,
)
from ckptstage.protos.layout.manifest import (  # noqa: F401 - re-exported
    ManifestNotCommitted,
    TensorEntry,
    check_committed_manifest,
    decode_manifest,
    encode_manifest,
    manifest_attempt,
    manifest_file_bytes,
    manifest_files,
    parse_manifest_file,
    part_bytes,
    read_manifest,
    read_manifest_and_digest,
    validate_tensor_table,
    verified_body,
    with_trailer,
)
from ckptstage.protos.layout.stepindex import (  # noqa: F401 - re-exported
    MAX_STEP_INDEX_BYTES,
    Fragments,
    Sharded,
    StepIndex,
    parse_step_index,
    read_step_index_file,
    sharded_nodes,
    step_index_bytes,
    step_index_digest,
    step_table,
)
from ckptstage.protos.layout.records import (  # noqa: F401 - re-exported
    CommitRecord,
    CommittedPart,
    commit_record_bytes,
    parse_commit_record,
    read_commit_record,
)
