"""A real daemon whose shared tier is an object store that fails: throttled, erring, slow, cut off, killed.

The store is a real SeaweedFS (one per module: a test here kills and restarts it). Faults are injected by
:class:`FaultProxy`, a small HTTP proxy on loopback in front of it (a seam of our own: the daemon is given
the proxy's address as its endpoint), which answers chosen requests itself with 503 SlowDown or 500,
delays responses, or drops connections, and forwards everything else byte for byte (headers as the client
signed them, bodies with their framing).
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
torch = pytest.importorskip("torch")

from ckptstage.client import Client  # noqa: E402
from ckptstage.client.rpc import Connection  # noqa: E402
from ckptstage.daemon.launcher import DaemonProcess  # noqa: E402
from ckptstage.daemon.tiers.s3.client import Location, open_connection  # noqa: E402
from ckptstage.daemon.tiers.s3.tier import S3Tier  # noqa: E402
from ckptstage.protos import chunks, layout  # noqa: E402
from ckptstage.protos.v1 import ckptstage_pb2 as pb  # noqa: E402
from conftest import DEFAULTS  # noqa: E402
from s3server import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, S3Server, open_tier, serving  # noqa: E402
from support import free_port, metric, scrape, wait_until  # noqa: E402

MiB = 1 << 20
WRITES = r"^(PUT|POST) "  # uploads, pieces, completions, manifests, claims, records


# --- the proxy --------------------------------------------------------------------------------------


@dataclass
class Fault:
    """What the proxy does to requests whose ``"METHOD target"`` matches ``match``: answer ``status`` with
    ``code`` (and ``headers``) itself, or drop the connection (``status`` -1), or forward it and flip a bit
    of the response's body (``corrupt``), after ``delay_s``; ``times`` requests (None: all)."""

    match: str
    status: int = 0
    code: str = ""
    delay_s: float = 0.0
    times: int | None = None
    hits: int = 0
    corrupt: bool = False
    headers: dict[str, str] = field(default_factory=dict)


class FaultProxy:
    """An HTTP/1.1 proxy on a free loopback port (:attr:`endpoint`) in front of ``upstream``."""

    def __init__(self, upstream: str) -> None:
        url = urlparse(upstream)
        self._upstream = (url.hostname or "127.0.0.1", url.port or 80)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._faults: list[Fault] = []
        self._lock = threading.Lock()
        self.seen: list[str] = []  # "METHOD target -> what happened", in order
        self.seen_at: list[float] = []  # when each of those requests came (monotonic)
        self._open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def fail(self, status: int, code: str, match: str = ".", times: int | None = None,
             headers: dict[str, str] | None = None) -> Fault:
        return self._add(Fault(match, status, code, times=times, headers=headers or {}))

    def corrupt(self, match: str = ".", times: int | None = None) -> Fault:
        """Flips one bit in the middle of the body of the responses to matching requests."""
        return self._add(Fault(match, corrupt=True, times=times))

    def delay(self, seconds: float, match: str = ".", times: int | None = None) -> Fault:
        return self._add(Fault(match, delay_s=seconds, times=times))

    def answer(self, status: int, match: str = ".", headers: dict[str, str] | None = None,
               times: int | None = None) -> Fault:
        """Answers matching requests itself, ``status`` and ``headers`` with no body, without asking the
        store: a store that says yes to what it did not do."""
        return self._add(Fault(match, status, "", headers=headers or {}, times=times))

    def drop(self, match: str = ".", times: int | None = None) -> Fault:
        return self._add(Fault(match, status=-1, times=times))

    def heal(self) -> None:
        with self._lock:
            self._faults.clear()

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for conn in self._open:
                conn.close()

    def _saw(self, came: float, what: str) -> None:
        with self._lock:
            self.seen.append(what)
            self.seen_at.append(came)

    def _add(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def _take(self, request: str) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if re.search(fault.match, request) and (fault.times is None or fault.hits < fault.times):
                    fault.hits += 1
                    return fault
        return None

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._open.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        up: socket.socket | None = None
        try:
            client = conn.makefile("rb")
            while True:
                head = _read_head(client)
                if head is None:
                    return
                line, headers = head
                method, target = line.split(" ")[:2]
                request = f"{method} {target}"
                came = time.monotonic()
                fault = self._take(request)
                expect = headers.get("expect", "").lower() == "100-continue"
                if fault is not None and fault.delay_s:
                    time.sleep(fault.delay_s)
                if fault is not None and fault.status:
                    self._saw(came, f"{request} -> {'dropped' if fault.status < 0 else fault.status}")
                    if not expect:
                        _read_body(client, headers)
                    if fault.status > 0:
                        conn.sendall(_error(fault.status, fault.code, method, fault.headers))
                    return  # closes the connection (a body not read must not be taken for a request)
                if expect:
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _read_body(client, headers)
                if up is None:
                    up = socket.create_connection(self._upstream)
                    upstream = up.makefile("rb")
                kept = [h for h in _raw_lines(line, headers) if not h.lower().startswith(b"expect:")]
                up.sendall(b"\r\n".join(kept) + b"\r\n\r\n" + body)
                corrupt = fault is not None and fault.corrupt
                status, close = _relay_response(upstream, conn, method, corrupt)
                self._saw(came, f"{request} -> {status}{' corrupted' if corrupt else ''}")
                if close:
                    return
        except OSError:
            return
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()
            if up is not None:
                up.close()


def _read_head(f: Any) -> tuple[str, dict[str, str]] | None:
    """A request or status line and its headers (names lower-cased, kept in order); None at the end."""
    line = f.readline()
    if not line:
        return None
    headers: dict[str, str] = {}
    while True:
        h = f.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        name, _, value = h.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    headers["\0order"] = "\n".join(headers)  # the header names as sent, for _raw_lines
    return line.decode("latin-1").rstrip("\r\n"), headers


def _raw_lines(line: str, headers: dict[str, str]) -> list[bytes]:
    # Names are forwarded lower-cased: HTTP header names are case-insensitive, and so is SigV4's canonical form.
    return [line.encode("latin-1")] + [f"{n}: {headers[n]}".encode("latin-1")
                                       for n in headers["\0order"].split("\n") if n != "\0order"]


def _read_body(f: Any, headers: dict[str, str]) -> bytes:
    """The message body as sent: Content-Length bytes, or the chunks with their framing."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        out = bytearray()
        while True:
            size_line = f.readline()
            out += size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, up to the blank line
                    t = f.readline()
                    out += t
                    if t in (b"\r\n", b"\n", b""):
                        return bytes(out)
            out += f.read(size + 2)
    return f.read(int(headers.get("content-length", "0") or 0))


def _relay_response(upstream: Any, conn: socket.socket, method: str, corrupt: bool = False) -> tuple[int, bool]:
    """Copies one response from upstream to the client; returns its status and whether to close. ``corrupt``:
    one bit in the middle of a body of known length is flipped on the way (the headers stay as sent)."""
    head = _read_head(upstream)
    if head is None:
        raise OSError("the upstream closed the connection")
    line, headers = head
    status = int(line.split(" ")[1])
    conn.sendall(b"\r\n".join(_raw_lines(line, headers)) + b"\r\n\r\n")
    close = headers.get("connection", "").lower() == "close"
    if method == "HEAD" or status in (204, 304) or status < 200:
        return status, close
    if "chunked" in headers.get("transfer-encoding", "").lower() or "content-length" in headers:
        body = _read_body(upstream, headers)
        if corrupt and body and "content-length" in headers:
            flipped = bytearray(body)
            flipped[len(flipped) // 2] ^= 0x10
            body = bytes(flipped)
        conn.sendall(body)
        return status, close
    while data := upstream.read(1 << 20):  # to the end of the connection
        conn.sendall(data)
    return status, True


def _error(status: int, code: str, method: str, headers: dict[str, str] | None = None) -> bytes:
    body = b"" if method == "HEAD" or status < 300 else (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>injected by the test '
        f"proxy</Message><RequestId>fault</RequestId></Error>").encode()
    reason = {200: "OK", 301: "Moved Permanently", 500: "Internal Server Error", 503: "Slow Down"}.get(status, "Error")
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"{extra}Connection: close\r\n\r\n").encode() + body


# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """This module's own SeaweedFS (a test kills and restarts it)."""
    yield from serving(tmp_path_factory.mktemp("seaweedfs-faults"))


@pytest.fixture
def proxy(server: S3Server) -> Iterator[FaultProxy]:
    p = FaultProxy(server.endpoint)
    try:
        yield p
    finally:
        p.close()


def _daemon(server: S3Server, root: Path, prefix: str, endpoint: str | None = None, bucket: str = BUCKET,
            secret: str | None = None, **settings: Any) -> DaemonProcess:
    """A daemon whose shared tier is ``s3://bucket/prefix`` at ``endpoint`` (the server's by default), its
    credentials from the environment, two attempts per request (AWS_MAX_ATTEMPTS), metrics served."""
    env = {**server.env(), "AWS_MAX_ATTEMPTS": "2"}
    if secret is not None:
        env["AWS_SECRET_ACCESS_KEY"] = secret
    d = DaemonProcess(root, {"shared.dir": "", "shared.url": f"s3://{bucket}/{prefix}",
                             "shared.endpoint": endpoint or server.endpoint, "shared.multipart_bytes": "5MiB",
                             "metrics.listen": f"127.0.0.1:{free_port()}", **settings},
                      defaults=DEFAULTS, env=env, log_level="DEBUG")
    return d.start()


def _shared(d: DaemonProcess) -> pb.TierStatus:
    """The shared tier's line of the daemon's Status."""
    with Connection(d.socket) as conn:
        return next(t for t in conn.status().tiers if t.tier == pb.SHARED)


def _port(d: DaemonProcess) -> int:
    assert d.metrics_url is not None
    return int(urlparse(d.metrics_url).port or 0)


def _state(n: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.rand(n, generator=g), "seed": seed}


def _assert_whole_on_the_store(server: S3Server, prefix: str, job: str, steps: list[int]) -> None:
    """Every listed step of ``job`` is committed and verifies; no claim, note or upload is left behind."""
    tier = open_tier(server, "reader", prefix=prefix)
    listed = [s for s in tier.list_steps(job)]
    assert [s.step for s in listed if s.record_ino] == steps
    for s in listed:
        for p in s.parts:
            tier.verify_part(p.path)
    conn = tier.connection
    keys = [o["Key"] for page in conn.client.get_paginator("list_objects_v2").paginate(
        Bucket=conn.bucket, Prefix=prefix + "/") for o in page.get("Contents", [])]
    assert [k for k in keys if k.endswith("/.claim") or "/.tmp/" in k] == []
    assert conn.client.list_multipart_uploads(Bucket=conn.bucket, Prefix=prefix + "/").get("Uploads", []) == []


def _retry_delays(log: Path) -> dict[str, list[float]]:
    """Each part's drain retries, as the daemon logged them: how long each waited (parts retry side by side,
    their lines interleaved)."""
    delays: dict[str, list[float]] = {}
    for part, delay in re.findall(r"drain of (\S+ step \d+ rank \d+) failed .*?; retrying in ([0-9.]+)s",
                                  log.read_text()):
        delays.setdefault(part, []).append(float(delay))
    return delays


# --- tests ---------------------------------------------------------------------------------------


def test_a_throttling_store_degrades_the_tier_and_the_drain_backs_off_then_catches_up(
        server: S3Server, proxy: FaultProxy, tmp_path: Path) -> None:
    d = _daemon(server, tmp_path / "n", "throttled", endpoint=proxy.endpoint)
    try:
        with Client("thr", socket=d.socket) as client:
            client.save(1, _state(1000, 1)).wait("shared", timeout=30)
            assert _shared(d).state == "ok"
            proxy.fail(503, "SlowDown", match=WRITES)
            began = time.monotonic()
            h2 = client.save(2, _state(1000, 2))
            h2.wait("local", timeout=10)  # local saves go on
            tier = wait_until(lambda: (t := _shared(d)).state == "degraded" and t, 30, "the shared tier degraded")
            assert "SlowDown" in tier.last_error and BUCKET in tier.last_error and proxy.endpoint in tier.last_error
            text = scrape(_port(d))
            assert metric(text, "ckptstage_job_drain_failing", job="thr") == 1
            assert metric(text, "ckptstage_drain_retries_total") >= 1
            h3 = client.save(3, _state(1000, 3))
            h3.wait("local", timeout=10)
            assert time.monotonic() - began < 20
            proxy.heal()
            proxy.fail(500, "InternalError", match=WRITES)  # now erring instead
            wait_until(lambda: "InternalError" in _shared(d).last_error, 30, "the 500s named in Status")
            wait_until(lambda: len(_retry_delays(d.root / "daemon.log").get("thr step 2 rank 0", [])) >= 3, 30,
                       "step 2's drain retried three times")
            with pytest.raises(TimeoutError):
                h2.wait("shared", timeout=0.5)  # nothing reaches the store meanwhile
            proxy.heal()
            h2.wait("shared", timeout=30)  # caught up
            h3.wait("shared", timeout=30)
            assert (_shared(d).state, _shared(d).last_error) == ("ok", "")
            assert metric(scrape(_port(d)), "ckptstage_job_drain_failing", job="thr") == 0
    finally:
        d.stop()
    # The drain backed off: each retry of a part waited longer, up to retry_max_s (1 s in the tests).
    delays = _retry_delays(tmp_path / "n" / "daemon.log")["thr step 2 rank 0"]
    assert len(delays) >= 3 and delays[:3] == sorted(delays[:3]) and delays[0] < delays[2] and max(delays) <= 1.0
    assert any(s.endswith("-> 503") for s in proxy.seen) and any(s.endswith("-> 500") for s in proxy.seen)
    _assert_whole_on_the_store(server, "throttled", "thr", [1, 2, 3])


def test_a_slow_store_slows_only_the_drain_and_dropped_connections_are_retried(
        server: S3Server, proxy: FaultProxy, tmp_path: Path) -> None:
    # Whole parts, whatever the suite's default: their data files go up as multipart uploads.
    d = _daemon(server, tmp_path / "n", "slow", endpoint=proxy.endpoint, **{"persist.incremental": False})
    try:
        with Client("slow", socket=d.socket) as client:
            client.save(1, _state(1000, 1)).wait("shared", timeout=30)
            proxy.delay(0.4)  # every request answered 0.4 s late
            began = time.monotonic()
            h2 = client.save(2, _state(1000, 2))
            h2.wait("local", timeout=10)
            local_s = time.monotonic() - began
            h2.wait("shared", timeout=60)
            shared_s = time.monotonic() - began
            assert local_s < 2.0 < shared_s  # a drain is a dozen requests, each 0.4 s late; local is not
            proxy.heal()
            # Connections cut in the middle of a 12 MiB file's pieces: the SDK's retries carry it through.
            dropped = proxy.drop(match=r"^PUT .*partNumber=", times=2)
            state = _state(3 * MiB, 3)
            client.save(3, state).wait("shared", timeout=60)
            assert dropped.hits == 2 and sum(s.endswith("-> dropped") for s in proxy.seen) == 2
            assert _shared(d).state == "ok"
    finally:
        d.stop()
    _assert_whole_on_the_store(server, "slow", "slow", [1, 2, 3])
    reader = open_tier(server, "reader", prefix="slow")
    part = reader.part_location("slow", 3, 0)
    manifest = reader.read_manifest(part)[0]
    assert layout.manifest_files(manifest)[layout.DATA_FILE].size > 12 * MiB  # three pieces and more


def test_the_store_killed_mid_upload_and_restarted_the_drain_resumes_and_nothing_torn_is_visible(
        server: S3Server, tmp_path: Path) -> None:
    d = _daemon(server, tmp_path / "n", "killed", **{"shared.max_bandwidth": "8MiB/s", "persist.incremental": False})
    reader = open_tier(server, "reader", prefix="killed")
    conn = reader.connection
    try:
        with Client("killed", socket=d.socket) as client:
            client.save(1, _state(1000, 1)).wait("shared", timeout=30)
            handle = client.save(2, _state(6 * MiB, 2))  # 24 MiB: five pieces, three seconds at the cap
            handle.wait("local", timeout=30)
            wait_until(lambda: conn.client.list_multipart_uploads(Bucket=conn.bucket, Prefix="killed/")
                       .get("Uploads"), 20, "a multipart upload under way", poll=0.05)
            server.kill()
            time.sleep(1.5)  # the drain fails meanwhile (and retries)
            server.restart()
            # While it resumes, a step is listed only committed whole.
            deadline = time.monotonic() + 60
            while True:
                steps = [s for s in reader.list_steps("killed") if s.record_ino]
                for s in steps:
                    for p in s.parts:
                        reader.verify_part(p.path)
                if [s.step for s in steps] == [1, 2] or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            handle.wait("shared", timeout=5)
            assert _shared(d).state == "ok"
    finally:
        d.stop()
    log = (tmp_path / "n" / "daemon.log").read_text()
    assert "drain of killed step 2 rank 0 failed" in log  # it was cut off, then resumed
    _assert_whole_on_the_store(server, "killed", "killed", [1, 2])


def test_the_daemon_killed_while_a_pack_uploads_shows_nothing_of_it_and_drains_the_step_whole_once_restarted(
        server: S3Server, tmp_path: Path) -> None:
    d = _daemon(server, tmp_path / "n", "packkill", **{"shared.max_bandwidth": "8MiB/s", "persist.incremental": True})
    reader = open_tier(server, "reader", prefix="packkill")
    conn = reader.connection

    def uploads() -> list[dict[str, Any]]:
        return conn.client.list_multipart_uploads(Bucket=conn.bucket, Prefix="packkill/").get("Uploads", [])

    try:
        with Client("pk", socket=d.socket) as client:
            client.save(1, _state(1000, 1)).wait("shared", timeout=30)
            client.save(2, _state(6 * MiB, 2)).wait("local", timeout=30)  # 24 MiB of new chunks: a pack of 5 pieces
            wait_until(uploads, 20, "a pack upload under way", poll=0.05)
            d.kill()
        [cut] = uploads()
        assert "/chunks/packs/" in cut["Key"]
        # Nothing of the step is visible: no record, and every pack listed is one its index publishes.
        assert [s.step for s in reader.list_steps("pk") if s.record_ino] == [1]
        assert all(p.chunks for p in reader.list_packs("pk"))
        d.restart()
        with Client("pk", socket=d.socket) as client:
            client.wait_step(2, "shared", timeout=60)
        assert cut["UploadId"] not in [u["UploadId"] for u in uploads()]  # the restarted daemon aborted its own
    finally:
        d.stop()
    _assert_whole_on_the_store(server, "packkill", "pk", [1, 2])


def test_refused_credentials_a_missing_bucket_or_another_region_at_start_leave_the_local_tier_working_and_say_why(
        server: S3Server, proxy: FaultProxy, tmp_path: Path) -> None:
    # A bucket in another region: S3 answers 301 PermanentRedirect naming it (the SDK follows once, signing
    # for that region; at an endpoint that is not AWS's the answer stays).
    proxy.fail(301, "PermanentRedirect", headers={"x-amz-bucket-region": "eu-west-2"})
    missing = _daemon(server, tmp_path / "m", "p", bucket="no-such-bucket")
    refused = _daemon(server, tmp_path / "r", "p", secret="not-the-secret")
    elsewhere = _daemon(server, tmp_path / "e", "p", endpoint=proxy.endpoint)
    try:
        for d, endpoint, words in (
                (missing, server.endpoint, "the bucket 'no-such-bucket' does not exist"),
                (refused, server.endpoint, f"access to the bucket '{BUCKET}' at {server.endpoint} refused"),
                (elsewhere, proxy.endpoint, f"the bucket '{BUCKET}' at {proxy.endpoint} is in region 'eu-west-2', "
                                            f"not '{REGION}' that requests are signed for (301): set [shared] "
                                            'region = "eu-west-2"')):
            with Client("startup", socket=d.socket) as client:
                client.save(1, _state(1000, 1)).wait("local", timeout=30)
                assert [i.step for i in client.list()] == [1]
            tier = wait_until(lambda d=d: (t := _shared(d)).last_error and t, 30, "the shared tier's error")
            assert tier.state in ("degraded", "unreachable")
            assert words in tier.last_error and endpoint in tier.last_error
            assert words in (d.root / "daemon.log").read_text()
        assert "not-the-secret" not in (refused.root / "daemon.log").read_text()
    finally:
        missing.stop()
        refused.stop()
        elsewhere.stop()


def test_a_store_that_ignores_conditional_writes_is_not_used_and_says_why(
        server: S3Server, proxy: FaultProxy, tmp_path: Path) -> None:
    """A store that takes a conditional PUT whose condition fails would let two daemons both publish a step:
    the tier is refused at start (the probe's writes are answered 200 without asking the store), saves stay
    local, and status and the log name the store and what it ignored."""
    proxy.answer(200, match=r"^PUT [^ ]*/\.tmp/[^ ]*/conditions-", headers={"ETag": '"0123456789abcdef"'})
    d = _daemon(server, tmp_path / "c", "p", endpoint=proxy.endpoint)
    try:
        with Client("lenient", socket=d.socket) as client:
            client.save(1, _state(1000, 1)).wait("local", timeout=30)
            tier = wait_until(lambda: (t := _shared(d)).last_error and t, 30, "the shared tier's error")
            assert tier.state in ("degraded", "unreachable")
            words = (f"the store at {proxy.endpoint} took a conditional write whose condition fails "
                     "(If-None-Match: * on an object that exists")
            assert words in tier.last_error
            assert words in (d.root / "daemon.log").read_text()
            assert not any(s.startswith("PUT") and "/lenient/" in s for s in proxy.seen)  # nothing drained
            assert client.list()[0].tiers == ("local",)
    finally:
        d.stop()


# --- one tier through the proxy: what one request meets ---------------------------------------------------


def _tier(endpoint: str, prefix: str, owner: str = "node-a") -> S3Tier:
    """The tier ``s3://BUCKET/prefix`` at ``endpoint`` (the server's, or the proxy's), as the daemon ``owner``."""
    conn = open_connection(Location(BUCKET, prefix), endpoint, REGION, access_key_id=ACCESS_KEY,
                           secret_access_key=SECRET_KEY)
    return S3Tier(conn, owner, piece_bytes=5 * MiB)


def _publish(tier: S3Tier, job: str, step: int, data: bytes) -> Path:
    writer = tier.begin_part(job, step, 0)
    sink = writer.create_file(layout.DATA_FILE, len(data), direct_io=False)
    sink.write(memoryview(data), 0)
    sink.sync()
    sink.close()
    return writer.commit({"format": layout.FORMAT, "job": job, "step": step, "rank": 0, "world_size": 1,
                          "tensors": [], "tree": {}, "created": 1.0, "metrics": {}, "attempt": "run-1",
                          "files": {layout.DATA_FILE: layout.FileEntry(
                              len(data), MiB, tuple(layout.block_digests(data, MiB))).to_json()}})


def test_a_byte_flipped_on_its_way_from_the_store_is_caught_as_a_corrupt_copy_never_accepted(
        server: S3Server, proxy: FaultProxy) -> None:
    prefix = f"flip-{uuid.uuid4().hex[:8]}"
    data = os.urandom(3 * MiB + 5)
    where = _publish(_tier(server.endpoint, prefix), "flip", 1, data)
    reader = _tier(proxy.endpoint, prefix, "reader")
    flipped = proxy.corrupt(match=r"^GET .*/data\.safetensors", times=1)  # one ranged GET's answer
    with pytest.raises(layout.ChecksumMismatch) as bad:
        reader.verify_part(where)
    assert flipped.hits == 1
    wait_until(lambda: any(s.endswith("-> 206 corrupted") for s in proxy.seen), 5, "the flipped answer noted")
    assert bad.value.path == where / layout.DATA_FILE and layout.is_verification_failure(bad.value)
    reader.verify_part(where)  # the store's copy is whole: read again, it verifies
    with reader.open_file(where, layout.DATA_FILE) as f:
        assert f.read(len(data)) == data


def test_a_load_that_met_a_byte_flipped_on_the_way_fails_and_the_stores_good_copy_is_kept(
        server: S3Server, proxy: FaultProxy, tmp_path: Path) -> None:
    from ckptstage.client.errors import CkptStageError

    prefix = f"flipped-{uuid.uuid4().hex[:8]}"
    state = _state(400_000, 7)
    a = _daemon(server, tmp_path / "a", prefix, **{"persist.incremental": False})
    b = _daemon(server, tmp_path / "b", prefix, endpoint=proxy.endpoint, **{"persist.incremental": False})
    try:
        with Client("flipped", socket=a.socket) as client:
            client.save(1, state).wait("shared", timeout=30)
        flipped = proxy.corrupt(match=r"^GET .*/data\.safetensors", times=1)
        with Client("flipped", socket=b.socket) as client:
            wait_until(lambda: client.list(), 30, "the step listed on the second node")
            with pytest.raises(CkptStageError, match="flipped step 1 rank 0"):
                client.load()  # fetched through the proxy: the copy fails its checksums
            assert flipped.hits == 1 and [tuple(i.tiers) for i in client.list()] == [("shared",)]  # none landed
            got = client.load()  # the quarantine's second read found the store's copy whole: it stays
            assert torch.equal(got["w"], state["w"])
    finally:
        a.stop()
        b.stop()
    assert "reported corrupt" in (tmp_path / "b" / "daemon.log").read_text()  # detected, then found whole
    _assert_whole_on_the_store(server, prefix, "flipped", [1])


def test_slow_down_answers_are_retried_after_the_wait_the_store_asks_for(server: S3Server,
                                                                         proxy: FaultProxy) -> None:
    tier = _tier(proxy.endpoint, f"slow-{uuid.uuid4().hex[:8]}")
    proxy.fail(503, "SlowDown", match=r"^PUT .*/retention\.json", times=2, headers={"x-amz-retry-after": "600"})
    tier.write_job_json("slow", "retention.json", {"shared_keep_last": 2})
    assert tier.read_job_json("slow", "retention.json", {}) == {"shared_keep_last": 2}

    def tries() -> list[tuple[float, str]]:  # noted once answered: the last may come a moment after the call
        return [(at, what) for at, what in zip(proxy.seen_at, proxy.seen) if what.startswith("PUT")]

    wait_until(lambda: len(tries()) == 3, 5, "three attempts noted")
    assert [what.rsplit(" ", 1)[1] for _, what in tries()] == ["503", "503", "200"]
    gaps = [b[0] - a[0] for a, b in zip(tries(), tries()[1:])]
    assert all(gap >= 0.6 for gap in gaps), gaps  # the SDK's backoff, at least what the store asked


def test_a_store_without_object_tags_has_reused_chunks_touched_by_copying_them_onto_themselves(
        server: S3Server, proxy: FaultProxy, caplog: pytest.LogCaptureFixture) -> None:
    tier = _tier(proxy.endpoint, f"untagged-{uuid.uuid4().hex[:8]}")
    refused = proxy.fail(501, "NotImplemented", match=r"\?tagging")
    names = [chunks.digest(memoryview(d)) for d in (b"kept", b"swept")]
    for name, d in zip(names, (b"kept", b"swept")):  # a pack each
        batch = tier.new_chunks("tags")
        batch.write(name, memoryview(d), direct_io=False)
        batch.publish()
    pack = {p.chunks[0][0]: p.pack_id for p in tier.list_packs("tags")}
    time.sleep(2.1)  # the store's times are whole seconds
    cutoff = time.time()
    assert tier.touch_chunk("tags", names[0]) and tier.touch_chunk("tags", names[0])
    assert not tier.condemn_pack("tags", pack[names[0]], cutoff)  # its index's modification time is the touch's
    assert tier.condemn_pack("tags", pack[names[1]], cutoff)      # untouched: no tag to read, its time is old
    assert tier.missing_chunks("tags", names) == [names[1]]
    assert refused.hits == 2  # one refused tagging, one refused tag reading: then neither is asked again
    assert caplog.text.count("refuses tagging") == 1 and caplog.text.count("refuses reading tags") == 1
