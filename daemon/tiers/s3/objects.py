"""The requests the object-store tier makes of one bucket, each as one call that fails as an OSError.

:class:`Objects` reads, writes (whole, or only where nothing is, or only
over the version last seen), copies, lists and deletes objects, and lists
and aborts multipart uploads; every failure is an ``OSError`` naming the
object and the endpoint (:func:`ckptstage.daemon.tiers.s3.client.errors`). Keys are
whole keys of the bucket: what they mean (parts, claims, temporaries) is the
callers' business.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Iterable, Iterator
from typing import Any

import boto3.s3.transfer
import xxhash

from ckptstage.daemon.tiers.s3.client import Connection, errors, is_conflict

MAX_COPY_BYTES = 5 << 30     # the largest object one CopyObject copies; larger ones go piece by piece
DELETE_BATCH = 1000          # the most keys one DeleteObjects request deletes
CONFLICT_ATTEMPTS = 5        # a conditional write racing another one, tried this often


def version(etag: str) -> int:
    """An object's version from its ETag: a non-zero integer that changes with the object's bytes."""
    return xxhash.xxh3_64_intdigest(etag.strip('"').encode()) or 1


def abort(conn: Connection, key: str, upload_id: str) -> None:
    """Aborts a multipart upload (its pieces are deleted); one already gone is no error."""
    try:
        with errors("aborting the upload of", conn, key):
            conn.client.abort_multipart_upload(Bucket=conn.bucket, Key=key, UploadId=upload_id)
    except FileNotFoundError:
        pass


class Objects:
    """The objects of ``conn``'s bucket. A large copy goes as pieces of ``piece_bytes``, ``in_flight`` at once."""

    def __init__(self, conn: Connection, piece_bytes: int, in_flight: int) -> None:
        self.connection = conn
        self._piece_bytes = piece_bytes
        self._in_flight = in_flight

    def where(self, key: str | None = None) -> str:
        """How messages name an object: ``s3://bucket/key at <endpoint>``."""
        return self.connection.where(key)

    def head(self, key: str) -> dict[str, Any] | None:
        """The object's metadata; None when it is not there."""
        conn = self.connection
        try:
            with errors("looking up", conn, key):
                return dict(conn.client.head_object(Bucket=conn.bucket, Key=key))
        except FileNotFoundError:
            return None

    def get(self, key: str) -> bytes:
        """A small object's bytes; FileNotFoundError when it is not there."""
        return self.read(key)[0]

    def read(self, key: str) -> tuple[bytes, dict[str, Any]]:
        """A small object's bytes and the response (its ``ETag``, ``LastModified`` and ``ResponseMetadata``);
        FileNotFoundError when it is not there."""
        conn = self.connection
        with errors("reading", conn, key):
            got = dict(conn.client.get_object(Bucket=conn.bucket, Key=key))
            return bytes(got.pop("Body").read()), got

    def create(self, key: str, data: bytes) -> bool:
        """Writes a small object unless one is there; True if this call created it (exactly once)."""
        try:
            self.put(key, data, if_absent=True)
        except FileExistsError:
            return False
        return True

    def put(self, key: str, data: bytes, if_absent: bool = False, if_match: str | None = None,
            metadata: dict[str, str] | None = None) -> str:
        """Writes a small object whole; returns its ETag. ``if_absent``: FileExistsError when one is there;
        ``if_match``: FileExistsError (or FileNotFoundError) unless the object there has that ETag."""
        conn = self.connection
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_match} if if_match else {}
        if metadata:
            extra["Metadata"] = metadata
        for attempt in range(CONFLICT_ATTEMPTS):
            try:
                with errors("writing", conn, key):
                    got = conn.client.put_object(Bucket=conn.bucket, Key=key, Body=data, **extra)
                return str(got["ETag"])
            except OSError as e:
                if not (if_absent and is_conflict(e)) or attempt == CONFLICT_ATTEMPTS - 1:
                    raise
                time.sleep(0.05 * 2 ** attempt)  # another conditional write of the key is under way
        raise AssertionError("unreachable")

    def tag(self, key: str, tags: dict[str, str]) -> None:
        """Sets the object's tags (all of them): its bytes, modification time and version stay.
        FileNotFoundError when it is not there."""
        conn = self.connection
        with errors("tagging", conn, key):
            conn.client.put_object_tagging(Bucket=conn.bucket, Key=key, Tagging={
                "TagSet": [{"Key": k, "Value": v} for k, v in tags.items()]})

    def tags(self, key: str) -> dict[str, str]:
        """The object's tags; FileNotFoundError when it is not there."""
        conn = self.connection
        with errors("reading the tags of", conn, key):
            got = conn.client.get_object_tagging(Bucket=conn.bucket, Key=key)
        return {str(t["Key"]): str(t["Value"]) for t in got.get("TagSet", [])}

    def rewrite(self, key: str, metadata: dict[str, str]) -> None:
        """Copies the object onto itself with new ``metadata``: its modification time becomes now.
        FileNotFoundError when it is not there."""
        conn = self.connection
        with errors("rewriting", conn, key):
            conn.client.copy_object(Bucket=conn.bucket, Key=key, CopySource={"Bucket": conn.bucket, "Key": key},
                                    MetadataDirective="REPLACE", Metadata=metadata)

    def delete(self, key: str, etag: str | None = None) -> None:
        """Deletes one object (only while it has ``etag``, when given); FileNotFoundError when it is gone
        (or was written again meanwhile)."""
        conn = self.connection
        extra = {"IfMatch": etag} if etag else {}
        try:
            with errors("deleting", conn, key):
                conn.client.delete_object(Bucket=conn.bucket, Key=key, **extra)
        except FileExistsError as e:  # the condition failed: the object is not the one we meant
            raise FileNotFoundError(errno.ENOENT, str(e)) from e

    def delete_many(self, keys: Iterable[str]) -> None:
        """Deletes the objects (those already gone are no error)."""
        conn = self.connection
        keys = list(keys)
        for i in range(0, len(keys), DELETE_BATCH):
            batch = keys[i:i + DELETE_BATCH]
            with errors("deleting objects under", conn, batch[0]):
                got = conn.client.delete_objects(
                    Bucket=conn.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            failed = [e for e in got.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if failed:
                raise OSError(errno.EIO, f"deleting {conn.where(failed[0].get('Key'))}: "
                                         f"{failed[0].get('Code')} {failed[0].get('Message')}")

    def copy(self, source: str, dest: str, size: int | None = None) -> None:
        """A server-side copy of one object; FileNotFoundError when the source is not there."""
        conn = self.connection
        with errors(f"copying s3://{conn.bucket}/{source} to", conn, dest):
            if size is not None and size <= MAX_COPY_BYTES:
                conn.client.copy_object(Bucket=conn.bucket, Key=dest, CopySource={"Bucket": conn.bucket,
                                                                                   "Key": source})
            else:  # piece by piece (needed above 5 GiB), several at once
                conn.client.copy({"Bucket": conn.bucket, "Key": source}, conn.bucket, dest,
                                 Config=boto3.s3.transfer.TransferConfig(
                                     multipart_threshold=MAX_COPY_BYTES, multipart_chunksize=self._piece_bytes,
                                     max_concurrency=self._in_flight))

    def listing(self, prefix: str, delimiter: str = "") -> Iterator[dict[str, Any]]:
        """Every object under ``prefix`` (and, with ``delimiter``, each common prefix as ``{"Prefix": ...}``)."""
        conn = self.connection
        kwargs: dict[str, Any] = {"Bucket": conn.bucket, "Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        with errors("listing", conn, prefix):
            for page in conn.client.get_paginator("list_objects_v2").paginate(**kwargs):
                yield from page.get("CommonPrefixes", [])
                yield from page.get("Contents", [])

    def keys(self, prefix: str) -> list[str]:
        """The keys of every object under ``prefix``."""
        return [o["Key"] for o in self.listing(prefix) if "Key" in o]

    def any_under(self, prefix: str) -> bool:
        """Whether any object is under ``prefix`` (one request)."""
        conn = self.connection
        with errors("listing", conn, prefix):
            got = conn.client.list_objects_v2(Bucket=conn.bucket, Prefix=prefix, MaxKeys=1)
        return bool(got.get("Contents"))

    def remove_tree(self, prefix: str) -> int:
        """Deletes every object under ``prefix``; returns how many there were."""
        keys = self.keys(prefix)
        self.delete_many(keys)
        return len(keys)

    def uploads(self, prefix: str) -> list[dict[str, Any]]:
        """The multipart uploads under way under ``prefix`` (``Key``, ``UploadId``, ``Initiated``)."""
        conn = self.connection
        with errors("listing the multipart uploads under", conn, prefix):
            return [u for page in conn.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=conn.bucket, Prefix=prefix) for u in page.get("Uploads", [])]

    def abort_uploads(self, prefix: str) -> list[str]:
        """Aborts every multipart upload under ``prefix``; returns their keys."""
        uploads = self.uploads(prefix)
        for upload in uploads:
            abort(self.connection, upload["Key"], upload["UploadId"])
        return [u["Key"] for u in uploads]
