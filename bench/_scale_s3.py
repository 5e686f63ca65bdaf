"""The scale simulator's object-store shared tier: one SeaweedFS on loopback, its own request counters.

For ``bench_scale.py --s3``: the SeaweedFS the tests use (``tests/s3server.py``,
loaded by ``bench_s3.s3server``), its filer (which runs the S3 gateway) started
again with a Prometheus port, so the server itself counts what the daemons ask
of it: ``SeaweedFS_s3_request_total`` by ``type`` (GET, PUT, LIST, DELETE, ...;
SeaweedFS files a HEAD under GET, and the pieces of a multipart upload under
PUT) and ``SeaweedFS_s3_bucket_traffic_sent_bytes_total`` (bytes of object
bodies sent). Each configuration gets its own prefix of the bucket. This
process polls for a step's commit record with boto3 (the tests' client), and
counts its own requests (a botocore ``before-send`` hook) so that they are
taken off the server's counts.
"""

from __future__ import annotations

import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness as h
from bench_s3 import s3server

REQUESTS = "SeaweedFS_s3_request_total"
SENT = "SeaweedFS_s3_bucket_traffic_sent_bytes_total"
RECEIVED = "SeaweedFS_s3_bucket_traffic_received_bytes_total"
POLL_S = 0.01  # a HEAD every 10 ms (2 ms, as on a directory, would keep a core busy answering)


@dataclass(frozen=True)
class Snapshot:
    """The server's counters at one moment: requests by type, bytes sent and received (object bodies)."""

    requests: Counter[str]
    sent: float
    received: float

    def __sub__(self, other: Snapshot) -> Snapshot:
        return Snapshot(Counter({k: self.requests[k] - other.requests[k]
                                 for k in self.requests | other.requests if self.requests[k] != other.requests[k]}),
                        self.sent - other.sent, self.received - other.received)


class Server:
    """A SeaweedFS with its S3 gateway's metrics on a loopback port, until :meth:`stop`."""

    def __init__(self, directory: Path) -> None:
        s3 = s3server()
        self.server = s3.start(directory)
        self.metrics_port = h.free_port()
        # the starter knows no metrics flag: the filer (S3 gateway inside) is started again with one
        self.server.commands["filer"] += [f"-metricsPort={self.metrics_port}", "-metricsIp=127.0.0.1"]
        self.server.restart()
        self.bucket: str = s3.BUCKET
        self.region: str = s3.REGION
        self.client = self.server.client()
        self.own: Counter[str] = Counter()  # this process's requests, by method
        self.client.meta.events.register("before-send.s3", self._count)

    def _count(self, request: Any, **_: Any) -> None:
        self.own[request.method] += 1

    @property
    def endpoint(self) -> str:
        return str(self.server.endpoint)

    def env(self) -> dict[str, str]:
        return dict(self.server.env())

    def snapshot(self) -> Snapshot:
        """The counters now (the bucket's; every status code)."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as got:
            text = got.read().decode()
        requests: Counter[str] = Counter()
        sent = received = 0.0
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.labels.get("bucket", self.bucket) != self.bucket:
                    continue
                if s.name == REQUESTS:
                    requests[s.labels.get("type", "?")] += int(s.value)
                elif s.name == SENT:
                    sent += s.value
                elif s.name == RECEIVED:
                    received += s.value
        return Snapshot(requests, sent, received)

    def own_snapshot(self) -> Snapshot:
        """This process's own requests so far, as the server files them (a HEAD is a GET there)."""
        mine: Counter[str] = Counter()
        for method, n in self.own.items():
            mine["GET" if method == "HEAD" else method] += n
        return Snapshot(mine, 0.0, 0.0)

    def window(self) -> Window:
        return Window(self)

    def stop(self) -> None:
        self.server.stop()


class Window:
    """The server's requests between :meth:`start` (or creation) and :meth:`stop`, less this process's own."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.start()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._at, self._own = self.server.snapshot(), self.server.own_snapshot()

    def stop(self) -> tuple[Snapshot, float]:
        """(the requests and bytes of the daemons in the window, its seconds)."""
        took = time.monotonic() - self.t0
        got = (self.server.snapshot() - self._at) - (self.server.own_snapshot() - self._own)
        return got, took


@dataclass
class S3Shared:
    """One configuration's shared tier: ``s3://bucket/prefix`` on :attr:`server`."""

    server: Server
    prefix: str

    def settings(self) -> dict[str, Any]:
        """The daemons' ``[shared]`` keys for it (credentials come from the environment: :meth:`env`)."""
        return {"shared.url": f"s3://{self.server.bucket}/{self.prefix}", "shared.endpoint": self.server.endpoint,
                "shared.region": self.server.region}

    def env(self) -> dict[str, str]:
        return self.server.env()

    def commit_key(self, job: str, step: int) -> str:
        from ckptstage.protos import layout

        return layout.commit_path(Path(self.prefix), job, step).as_posix()

    def wait_commit(self, job: str, step: int, timeout: float = 600.0) -> float:
        """Until ``step``'s commit record object exists (a HEAD every :data:`POLL_S`); returns that moment."""
        import botocore.exceptions

        key = self.commit_key(job, step)
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.server.client.head_object(Bucket=self.server.bucket, Key=key)
                return time.monotonic()
            except botocore.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey", "NotFound"):
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} never completed on the shared tier (s3://{self.server.bucket}/{key})")
            time.sleep(POLL_S)
