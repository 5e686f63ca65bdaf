"""The operator's files for an object-store shared tier (deploy/s3) and the docs that show them, kept true.

* The IAM policy grants exactly the S3 actions the daemon's requests need: the requests are read from the
  code (every ``client.<operation>(...)``, paginator and managed copy in daemon/tiers/s3/), so a request added
  there fails this test until the policy (and the table below) names it.
* The policy, the lifecycle rules and the systemd drop-in are the ones docs/OPERATIONS.md shows; the
  lifecycle rules are a valid ``PutBucketLifecycleConfiguration`` request; the example config loads; the
  drop-in is one systemd accepts, with the exposure the docs give.
* The boto3 block of docs/FORMAT.md ("Reading a step without ckptstage") reads steps a real daemon
  drained to a real SeaweedFS, whole and incremental, and gets the tensors that were saved.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptstage.daemon.config import load_config
from s3server import s3_server
from support import unit_directives

_ = s3_server  # the session's SeaweedFS, a fixture

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy" / "s3"
POLICY = DEPLOY / "iam-policy.json"
LIFECYCLE = DEPLOY / "lifecycle.json"
EXAMPLE = DEPLOY / "ckptstaged-s3.toml"
DROP_IN = DEPLOY / "ckptstaged-s3.conf"
OPERATIONS = REPO / "docs" / "OPERATIONS.md"
FORMAT = REPO / "docs" / "FORMAT.md"

# What each S3 operation the daemon calls needs, in IAM actions (the AWS S3 documentation's "Permissions"
# of each operation). A new operation in the code must be added here, and its actions to the policy.
ACTIONS: dict[str, set[str]] = {
    "head_bucket": {"s3:ListBucket"},
    "list_objects_v2": {"s3:ListBucket"},
    "list_multipart_uploads": {"s3:ListBucketMultipartUploads"},
    "head_object": {"s3:GetObject"},
    "get_object": {"s3:GetObject"},
    "put_object": {"s3:PutObject"},
    "copy_object": {"s3:GetObject", "s3:PutObject"},
    "upload_part_copy": {"s3:GetObject", "s3:PutObject"},
    "create_multipart_upload": {"s3:PutObject"},
    "upload_part": {"s3:PutObject"},
    "complete_multipart_upload": {"s3:PutObject"},
    "abort_multipart_upload": {"s3:AbortMultipartUpload"},
    "delete_object": {"s3:DeleteObject"},
    "delete_objects": {"s3:DeleteObject"},
    "put_object_tagging": {"s3:PutObjectTagging"},
    "get_object_tagging": {"s3:GetObjectTagging"},
}
BUCKET_ACTIONS = {"s3:ListBucket", "s3:ListBucketMultipartUploads"}  # on the bucket, not on its objects
# boto3's managed copy (``client.copy``, s3transfer): a HeadObject of the source, then one CopyObject, or a
# multipart copy (aborted when it fails).
MANAGED_COPY = {"head_object", "copy_object", "create_multipart_upload", "upload_part_copy",
                "complete_multipart_upload", "abort_multipart_upload"}


def _is_client(node: ast.expr) -> bool:
    """``client``, ``conn.client``, ``self._conn.client``, ...: an S3 client of the tier."""
    return (isinstance(node, ast.Name) and node.id == "client") or \
        (isinstance(node, ast.Attribute) and node.attr == "client")


def operations_called() -> dict[str, list[str]]:
    """Every S3 operation daemon/tiers/s3/ calls -> where (``file:line``)."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "daemon" / "tiers" / "s3").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and _is_client(node.func.value)):
                continue
            method = node.func.attr
            if method == "get_paginator":
                arg = node.args[0] if node.args else None
                assert isinstance(arg, ast.Constant) and isinstance(arg.value, str), \
                    f"{path.name}:{node.lineno}: a paginator of an operation this test cannot read"
                names = {arg.value}
            elif method == "copy":
                names = MANAGED_COPY
            else:
                names = {method}
            for name in names:
                found.setdefault(name, []).append(f"{path.name}:{node.lineno}")
    return found


def _statements() -> list[dict[str, Any]]:
    policy = json.loads(POLICY.read_text())
    assert policy["Version"] == "2012-10-17"
    statements: list[dict[str, Any]] = policy["Statement"]
    assert all(s["Effect"] == "Allow" and "Condition" not in s and "NotAction" not in s for s in statements)
    return statements


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def _example_location() -> tuple[str, str]:
    """(bucket, prefix) of the example config's shared tier."""
    cfg = load_config(EXAMPLE, env={"HOME": "/home/alice"})
    assert cfg.shared.url is not None
    bucket, _, prefix = cfg.shared.url[len("s3://"):].partition("/")
    return bucket, prefix


def test_the_policy_grants_what_the_daemons_requests_need_and_nothing_more() -> None:
    called = operations_called()
    assert "put_object" in called and "head_bucket" in called, f"the code's requests were not found: {called}"
    unknown = {op: where for op, where in called.items() if op not in ACTIONS}
    assert not unknown, (f"daemon/tiers/s3/ calls S3 operations this test does not map to IAM actions: {unknown}; "
                         "add them to ACTIONS and their actions to deploy/s3/iam-policy.json")
    needed = set().union(*(ACTIONS[op] for op in called))
    granted = {a for s in _statements() for a in _as_list(s["Action"])}
    assert granted >= needed, f"the policy lacks {sorted(needed - granted)}, which the code needs"
    assert granted <= needed, f"the policy grants {sorted(granted - needed)}, which no request of the code needs"


def test_the_policy_grants_bucket_actions_on_the_bucket_and_object_actions_under_the_prefix() -> None:
    bucket, prefix = _example_location()
    objects = f"arn:aws:s3:::{bucket}/{prefix}/*" if prefix else f"arn:aws:s3:::{bucket}/*"
    for statement in _statements():
        actions = set(_as_list(statement["Action"]))
        resources = _as_list(statement["Resource"])
        if actions & BUCKET_ACTIONS:
            assert actions <= BUCKET_ACTIONS and resources == [f"arn:aws:s3:::{bucket}"], statement
        else:
            assert resources == [objects], statement


def _fenced(doc: Path, lang: str, after: str) -> str:
    """The first ``lang`` code block of ``doc`` after the text ``after``."""
    text = doc.read_text()
    start = text.index(after)
    match = re.compile(rf"^```{lang}\n(.*?)^```$", re.S | re.M).search(text, start)
    assert match, f"no {lang} block after {after!r} in {doc.name}"
    return match.group(1)


def test_operations_shows_the_policy_and_the_lifecycle_rules_of_deploy() -> None:
    assert json.loads(_fenced(OPERATIONS, "json", "### Least privilege")) == json.loads(POLICY.read_text())
    assert json.loads(_fenced(OPERATIONS, "json", "### Bucket lifecycle")) == json.loads(LIFECYCLE.read_text())


def test_the_lifecycle_rules_are_a_valid_request_that_aborts_uploads_and_expires_old_versions() -> None:
    botocore_session = pytest.importorskip("botocore.session", reason="the s3 extra (botocore) is not installed")
    from botocore.validate import validate_parameters

    rules = json.loads(LIFECYCLE.read_text())
    model = botocore_session.get_session().get_service_model("s3")
    shape = model.operation_model("PutBucketLifecycleConfiguration").input_shape
    validate_parameters({"Bucket": _example_location()[0], "LifecycleConfiguration": rules}, shape)
    enabled = [r for r in rules["Rules"] if r["Status"] == "Enabled"]
    assert any(1 <= r.get("AbortIncompleteMultipartUpload", {}).get("DaysAfterInitiation", 0) for r in enabled)
    assert any(r.get("NoncurrentVersionExpiration", {}).get("NoncurrentDays", 0) >= 1 for r in enabled)


def test_the_example_config_loads_as_an_object_store_tier() -> None:
    cfg = load_config(EXAMPLE, env={"HOME": "/home/alice"})
    assert cfg.shared.url == "s3://my-checkpoints/alice" and cfg.shared.dir is None
    assert cfg.shared.access_key_id is None and not cfg.shared.allow_inline_credentials


def _analyze(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze`` with ``directory`` first in the unit path (its units and their drop-ins)."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{directory}:"}  # the trailing colon: then systemd's own
    return subprocess.run(["systemd-analyze", *args], capture_output=True, text=True, cwd=directory, env=env,
                          timeout=60)


def test_the_drop_in_opens_the_units_network_and_systemd_accepts_it(tmp_path: Path) -> None:
    from test_systemd import _unit_copy

    unit = _unit_copy(tmp_path)
    # The unit keeps the daemon to localhost; the drop-in exists to reset that.
    assert unit_directives(unit.read_text(), "[Service]")["IPAddressDeny"] == ["any"]
    assert unit_directives(DROP_IN.read_text(), "[Service]")["IPAddressDeny"] == [""]
    instance = unit.rename(unit.with_name("ckptstaged@alice.service"))
    (tmp_path / "ckptstaged@.service.d").mkdir()
    (tmp_path / "ckptstaged@.service.d" / "s3.conf").write_text(DROP_IN.read_text())
    verify = _analyze(tmp_path, "verify", "--man=no", instance.name)
    assert (verify.returncode, verify.stdout + verify.stderr) == (0, "")
    security = _analyze(tmp_path, "security", "--offline=yes", instance.name)
    assert "does not define an IP address allow list" in security.stdout, "the drop-in was not applied"
    exposure = re.search(r"Overall exposure level for \S+: (\d+\.\d)", security.stdout)
    documented = re.search(r"goes\s+from 1\.3 to (\d+\.\d)", OPERATIONS.read_text())
    assert exposure and documented, security.stdout + security.stderr
    assert exposure.group(1) == documented.group(1), "docs/OPERATIONS.md gives another exposure"


# --- docs/FORMAT.md's boto3 reader against steps a real daemon drained --------------------------------------

def _drained_steps(server: Any, root: Path, prefix: str, incremental: bool) -> dict[int, Any]:
    """Two ranks of step 7 of the job ``docs``, saved and drained to ``s3://BUCKET/prefix``; -> rank: tensor."""
    torch = pytest.importorskip("torch")
    from conftest import DEFAULTS
    from s3server import BUCKET

    from ckptstage.client import Client
    from ckptstage.daemon.launcher import DaemonProcess

    saved = {rank: torch.arange(3000, dtype=torch.float32) * (rank + 1) for rank in (0, 1)}
    daemon = DaemonProcess(root, {"shared.dir": "", "shared.url": f"s3://{BUCKET}/{prefix}",
                                  "shared.endpoint": server.endpoint, "persist.incremental": incremental,
                                  # its chunks kept compressed: the block decodes them
                                  "shared.compression": "zstd" if incremental else "none"},
                           defaults=DEFAULTS, env=server.env()).start()
    try:
        clients = [Client("docs", socket=daemon.socket, rank=rank, world_size=2) for rank in saved]
        try:
            handles = [c.save(7, {"w": saved[rank], "lr": 0.5}) for rank, c in enumerate(clients)]
            for h in handles:
                h.wait("shared", timeout=60)
        finally:
            for c in clients:
                c.close()
    finally:
        daemon.stop()
    return saved


@pytest.mark.parametrize("incremental", [False, True], ids=["whole", "incremental"])
def test_the_format_docs_boto3_block_reads_a_drained_step(s3_server: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, incremental: bool) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from s3server import BUCKET

    prefix = f"docs-{'inc' if incremental else 'whole'}-{tmp_path.name[-12:]}"
    saved = _drained_steps(s3_server, tmp_path / "node", prefix, incremental)
    listing = s3_server.client().list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/docs/chunks/")
    assert bool(listing.get("KeyCount")) == incremental  # the block's chunk branch is the one exercised
    client = s3_server.client()
    indexes = [client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listing.get("Contents", [])
               if o["Key"].endswith(".idx")]
    compressed = [e for raw in indexes for e in json.loads(raw.split(b"\n")[0])["chunks"] if len(e) == 4]
    assert bool(compressed) == incremental  # and its decoding
    block = _fenced(FORMAT, "python", "With boto3,")
    line = 'bucket, prefix, job, step = "my-checkpoints", "alice", "llama-7b", 120\n'
    assert block.count(line) == 1, "the block no longer names its step on one line this test replaces"
    code = block.replace(line, f"bucket, prefix, job, step = {BUCKET!r}, {prefix!r}, 'docs', 7\n")
    for name, value in {**s3_server.env(), "AWS_ENDPOINT_URL_S3": s3_server.endpoint}.items():
        monkeypatch.setenv(name, value)  # how the SDK finds the store: the block itself names none
    scope: dict[str, Any] = {}
    exec(compile(code, f"{FORMAT}:boto3-block", "exec"), scope)
    got = scope["ranks"]
    assert sorted(got) == sorted(saved)
    for rank, tensor in saved.items():
        assert torch.equal(got[rank]["['w']"], tensor), rank
