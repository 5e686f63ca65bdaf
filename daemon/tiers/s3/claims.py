"""Claims: which daemon's writer may write a part's objects on the object store now.

Writing at a part's final keys is safe only if two daemons never write the
same part at once: a writer first creates the part's claim,
``<part>/.claim`` (a conditional PUT naming the daemon and the writing), and
keeps it while it writes. A writer that finds another's claim gives up for
now (EBUSY: the drain retries), unless the claim is abandoned: its daemon's
own from before a restart, or another's left unchanged (not renewed) for
``claim_stale_s``. A writer that finds its own claim lost completes no
upload and commits nothing; what it wrote is the new holder's to replace.

Every writer notes its claim in its daemon's temporaries first
(``.tmp/<owner>/<job>.<step>.<rank>.<id>/.writer``), so that what a crash
left at a part's keys is found again: by the daemon itself when it starts
(:meth:`ckptstage.daemon.tiers.s3.cleanup.Cleanup.clean_temporaries`), and by any other
daemon once the claim has been left alone long enough that its daemon is
certainly gone (:mod:`ckptstage.daemon.tiers.s3.orphans`).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.s3.keys import CLAIM_FILE
from ckptstage.daemon.tiers.s3.objects import Objects
from ckptstage.protos import layout

log = logging.getLogger(__name__)

CLAIM_STALE_S = 120.0        # another daemon's claim left unchanged this long is abandoned (renewed every 1/4)


@dataclass
class Claim:
    """A writer's hold on one part's keys: the object ``<part>/.claim``, as this daemon last wrote it."""

    part: str    # the part's key prefix (ends with a slash)
    writer: str  # which writing holds it (the writer's id)
    etag: str    # of the claim object this daemon wrote last
    lost: str = ""  # why it is not this writer's any more ("" while it is)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # a renewal or a release at a time

    @property
    def key(self) -> str:
        return self.part + CLAIM_FILE


def read_claim(objects: Objects, key: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The claim object at ``key`` (what it says, and the response: ``ETag``, ``LastModified``,
    ``ResponseMetadata``); None when there is none. A claim that is not JSON says nothing."""
    try:
        raw, got = objects.read(key)
    except FileNotFoundError:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        info = {}
    return (info if isinstance(info, dict) else {}), got


class Claims:
    """Which parts the writers of the daemon ``owner`` hold, and the renewals that keep them theirs.

    A claim is created only where none is (``If-None-Match: *``). Its holder
    writes it again every ``stale_s / 4`` (``If-Match`` its last ETag: a claim
    broken meanwhile is found lost instead of taken back), so a claim that
    other daemons see unchanged for ``stale_s`` belongs to a daemon that died
    or lost the store that long: they may break it (a delete ``If-Match`` the
    ETag they watched) and take it. A claim of this daemon held by no writer
    of this process was left by its life before a restart, and is taken at
    once. A holder that finds its claim lost completes no upload and commits
    nothing; what it wrote is the new holder's to replace.
    """

    def __init__(self, objects: Objects, owner: str, stale_s: float) -> None:
        if stale_s <= 0:
            raise ValueError(f"a claim goes stale after a positive time, not {stale_s}")
        self._objects = objects
        self.owner = owner
        self.stale_s = stale_s
        self._lock = threading.Lock()
        self._held: dict[str, Claim] = {}               # part prefix -> the claim a writer here holds
        self._seen: dict[str, tuple[str, float]] = {}   # another's claim -> (its ETag, since when, monotonic)
        self._left: dict[str, str] = {}                  # part prefix -> temporaries of a writer that dropped it
        self._keeper: threading.Thread | None = None

    def _body(self, writer: str) -> bytes:
        return json.dumps({"owner": self.owner, "writer": writer, "pid": os.getpid(),
                           "renewed": time.time()}).encode()

    def take(self, part: str, writer: str) -> Claim:
        """Claims the part whose keys start with ``part`` for ``writer``; OSError (EBUSY) naming the
        holder when another writer holds it."""
        objects = self._objects
        key = part + CLAIM_FILE
        broke = False
        for _ in range(3):
            try:
                etag = objects.put(key, self._body(writer), if_absent=True)
            except FileExistsError:
                there = read_claim(objects, key)
                if there is None:
                    continue  # given back meanwhile
                info, got = there
                if not self._abandoned(key, info, str(got["ETag"])):
                    raise OSError(errno.EBUSY, f"{objects.where(part)} is being written by "
                                               f"{info.get('owner', '?')} (writer {info.get('writer', '?')}); "
                                               "trying again later") from None
                log.warning("taking over the claim on %s of %s (writer %s), abandoned", objects.where(part),
                            info.get("owner", "?"), info.get("writer", "?"), extra=fields(tier="shared"))
                quietly(objects.delete, key, str(got["ETag"]))
                broke = True
                continue
            claim = self._hold(part, writer, etag)
            if broke:  # the uploads under the part are the abandoned writer's: ours to abort now
                try:
                    objects.abort_uploads(part)
                except OSError:
                    self.release(claim)
                    raise
                with self._lock:
                    left = self._left.pop(part, None)
                if left is not None:
                    quietly(objects.remove_tree, left)
            return claim
        raise OSError(errno.EBUSY, f"{objects.where(part)}: its claim keeps changing hands; trying again later")

    def seize(self, part: str, writer: str, etag: str) -> Claim | None:
        """Takes over the claim on ``part`` that the caller judged abandoned as it saw it (``etag``), for
        ``writer``; None when it changed since (renewed, given back, or taken by another)."""
        key = part + CLAIM_FILE
        try:
            self._objects.delete(key, etag)
            etag = self._objects.put(key, self._body(writer), if_absent=True)
        except (FileNotFoundError, FileExistsError):
            return None
        log.warning("took over the claim on %s, abandoned", self._objects.where(part), extra=fields(tier="shared"))
        return self._hold(part, writer, etag)

    def _hold(self, part: str, writer: str, etag: str) -> Claim:
        """Notes a claim just written as held by ``writer``, and renews it from now on."""
        claim = Claim(part, writer, etag)
        with self._lock:
            self._held[part] = claim
            self._seen.pop(claim.key, None)
            if self._keeper is None:
                self._keeper = threading.Thread(target=self._keep, name="s3-claims", daemon=True)
                self._keeper.start()
        return claim

    def _abandoned(self, key: str, info: dict[str, Any], etag: str) -> bool:
        """Whether the claim ``info`` (ETag ``etag``) may be broken: see the class docstring."""
        with self._lock:
            if info.get("owner") == self.owner:
                held = self._held.get(key[:-len(CLAIM_FILE)])
                return held is None or held.writer != info.get("writer")
            now = time.monotonic()
            seen = self._seen.get(key)
            if seen is None or seen[0] != etag:
                self._seen[key] = (etag, now)
                return False
            return now - seen[1] >= self.stale_s

    def check(self, claim: Claim) -> None:
        """Raises OSError when ``claim`` is no longer its writer's (as far as this daemon knows)."""
        if claim.lost:
            raise OSError(errno.EBUSY, f"{self._objects.where(claim.part)}: this writer lost its claim "
                                       f"({claim.lost})")

    def verify(self, claim: Claim) -> None:
        """:meth:`check`, asking the store: the claim object is still the one this daemon wrote last."""
        with claim.lock:
            head = self._objects.head(claim.key)
            if head is None or head["ETag"] != claim.etag:
                self._lose(claim, "its claim was broken by another writer" if head else "its claim is gone")
        self.check(claim)

    def _lose(self, claim: Claim, why: str) -> None:
        claim.lost = why
        with self._lock:
            if self._held.get(claim.part) is claim:
                del self._held[claim.part]

    def drop(self, claim: Claim, why: str, temporaries: str) -> None:
        """Stops holding ``claim`` without giving it back: the object stays, abandoned (see the class), with
        its writer's ``temporaries`` (a key prefix): the next writer of this daemon to take it removes them."""
        with claim.lock:
            self._lose(claim, claim.lost or why)
            with self._lock:
                self._left[claim.part] = temporaries

    def renew(self, claim: Claim) -> None:
        """Writes the claim again (only if it is still the one written last); a claim broken or gone is lost."""
        with claim.lock:
            if claim.lost:
                return
            try:
                claim.etag = self._objects.put(claim.key, self._body(claim.writer), if_match=claim.etag)
            except (FileExistsError, FileNotFoundError) as e:
                self._lose(claim, f"it was broken by another writer or removed: {e}")
            except OSError as e:  # the store does not answer: the uploads fail too; try again next round
                log.warning("cannot renew the claim on %s: %s", self._objects.where(claim.part), e,
                            extra=fields(tier="shared", error=e))

    def release(self, claim: Claim) -> bool:
        """Gives the claim back (deletes it while it is still ours); False when that failed (the daemon's
        next start cleans it through the writer's note)."""
        with claim.lock:
            lost, claim.lost = claim.lost, claim.lost or "given back"
            with self._lock:
                if self._held.get(claim.part) is claim:
                    del self._held[claim.part]
            if lost:
                return True
            try:
                self._objects.delete(claim.key, claim.etag)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.warning("cannot give back the claim on %s: %s", self._objects.where(claim.part), e,
                            extra=fields(tier="shared", error=e))
                return False
        return True

    def recover(self, part: str, writer: str) -> Claim | None:
        """The claim ``writer`` of this daemon left on ``part`` (a crash), renewed so that no other daemon
        breaks it while it is cleaned; None when it is not that writer's (any more)."""
        there = read_claim(self._objects, part + CLAIM_FILE)
        if there is None or there[0].get("owner") != self.owner or there[0].get("writer") != writer:
            return None
        with self._lock:
            held = self._held.pop(part, None)
        if held is not None:
            held.lost = "cleaned as a crashed writer's"
        claim = Claim(part, writer, str(there[1]["ETag"]))
        self.renew(claim)
        return None if claim.lost else claim

    def _keep(self) -> None:
        """Renews every held claim each ``stale_s / 4``; ends when none is held."""
        while True:
            time.sleep(self.stale_s / 4)
            with self._lock:
                held = list(self._held.values())
                if not held:
                    self._keeper = None
                    return
            for claim in held:
                self.renew(claim)


def part_objects(objects: Objects, part: str) -> list[str]:
    """The keys under a part's key prefix ``part``, but its claim (only its writer, or a clean-up of that
    writer's, removes that)."""
    return [k for k in objects.keys(part) if not k.endswith("/" + CLAIM_FILE)]


def discard_unpublished(objects: Objects, part: str) -> None:
    """Deletes what a writing or a removal cut short left at a part's keys (its claim aside), unless the
    part's manifest is there: then the part is published and stays. Run holding the part's claim."""
    if objects.head(part + layout.MANIFEST_FILE) is None:
        objects.delete_many(part_objects(objects, part))


def quietly(call: Callable[..., Any], *args: Any) -> None:
    """A clean-up step whose failure leaves only what the next start removes."""
    try:
        call(*args)
    except OSError as e:
        log.debug("clean-up step failed: %s", e)

