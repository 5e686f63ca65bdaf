"""What other daemons left on the object store when they died for good, found and cleaned by any daemon.

A daemon cleans its own temporaries when it starts again
(:meth:`ckptstage.daemon.tiers.s3.cleanup.Cleanup.clean_temporaries`). A node that
never comes back leaves, under ``.tmp/<its name>/``, the notes of the
writers it had (each naming a part and the claim its writer held there),
their multipart uploads and objects at the part's keys without a manifest,
and the notes of removals it had begun. Nobody else would remove them, and
they cost storage for ever (a multipart upload's pieces too, unlisted).

:func:`clean_abandoned` removes them as their daemon would have, but only
once they are certainly abandoned: a writing whose claim has not been
renewed for ``after_s`` (a live writer renews it every ``claim_stale_s / 4``,
and ``after_s`` is several times ``claim_stale_s``), or a note that old
whose writer holds no claim. Ages are the store's own (its ``Date`` answer
less the object's ``LastModified``), so no node's clock matters. The claim
of a dead writer is taken over first (``If-Match`` what was seen: a writer
that renewed it meanwhile keeps it), so a writer that comes back or another
cleaner never works on the part at the same time; a part whose manifest is
there is published, and only the dead writer's unfinished uploads under it
go (a part of a staged replacement, ``.tmp/<owner>/replace/``, the same
way). The staged replacements themselves are left alone: their commit
record may make them a step yet.
"""

from __future__ import annotations

import email.utils
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ckptstage.daemon.logs import fields
from ckptstage.daemon.tiers.s3.claims import Claims, discard_unpublished, read_claim
from ckptstage.daemon.tiers.s3.keys import CLAIM_FILE, REMOVING, REPLACE_DIR, WRITER_NOTE
from ckptstage.daemon.tiers.s3.objects import Objects

log = logging.getLogger(__name__)

ABANDONED_AFTER = 5          # times claim_stale_s: a writing left this long is any daemon's to clean


def age_s(got: dict[str, Any]) -> float:
    """How long ago the object a GET or HEAD answered about was written, by the store's clock (its
    ``Date`` header; this node's clock where it sends none)."""
    modified = got["LastModified"].timestamp()
    date = got.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    try:
        now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
    except (TypeError, ValueError):
        now = time.time()
    return now - modified


@dataclass(frozen=True)
class Scope:
    """Where to look: ``tmp`` is the key prefix of every daemon's temporaries (``<prefix>/.tmp/``),
    ``root`` that of the tier (a note naming a part elsewhere is not ours to follow), ``owner`` this
    daemon (its own temporaries are :meth:`Cleanup.clean_temporaries`' business)."""

    tmp: str
    root: str
    owner: str


def clean_abandoned(objects: Objects, claims: Claims, scope: Scope, after_s: float) -> int:
    """Cleans the writings and removals of other daemons left unchanged for ``after_s``; returns how many.

    A failure on one is logged and leaves it for the next pass; the others are cleaned all the same.
    """
    done = 0
    for entry in objects.listing(scope.tmp, "/"):
        owner_prefix = entry.get("Prefix", "")
        owner = owner_prefix[len(scope.tmp):].rstrip("/")
        if not owner or owner == scope.owner:
            continue
        for sub in objects.listing(owner_prefix, "/"):
            prefix = sub.get("Prefix", "")
            name = prefix[len(owner_prefix):].rstrip("/")
            if not name or name == REPLACE_DIR:
                continue
            try:
                if name == REMOVING:
                    done += sum(_finish_removal(objects, claims, scope, obj["Key"], owner, after_s)
                                for obj in list(objects.listing(prefix)) if "Key" in obj)
                else:
                    done += _finish_writer(objects, claims, scope, prefix, owner, after_s)
            except OSError as e:
                log.warning("cannot clean %s, abandoned by %s: %s", objects.where(prefix), owner, e,
                            extra=fields(tier="shared", error=e))
    return done


def _finish_writer(objects: Objects, claims: Claims, scope: Scope, temporaries: str, owner: str,
                   after_s: float) -> int:
    """One writer's temporaries (``.tmp/<owner>/<job>.<step>.<rank>.<id>/``): cleaned when abandoned, its
    part's unfinished objects first under a claim taken over from it; 1 when cleaned, else 0."""
    try:
        raw, note = objects.read(temporaries + WRITER_NOTE)
    except FileNotFoundError:
        return 0  # no writer's (a chunk batch's, or one finished meanwhile)
    try:
        info = json.loads(raw)
        part, writer = str(info["part"]), str(info["writer"])
    except (ValueError, KeyError, TypeError):
        return 0  # not a note of this version: it claimed nothing
    if not part.startswith(scope.root):
        part = ""  # a part elsewhere is not ours to follow: only the temporaries go
    there = read_claim(objects, part + CLAIM_FILE) if part else None
    if there is not None and there[0].get("owner") == owner and there[0].get("writer") == writer:
        idle = age_s(there[1])
        if idle < after_s:
            return 0  # renewed lately: its writer lives
        held = claims.seize(part, uuid.uuid4().hex[:12], str(there[1]["ETag"]))
        if held is None:
            return 0  # renewed, given back or taken meanwhile: look again next pass
        try:
            objects.abort_uploads(part)
            discard_unpublished(objects, part)
        finally:
            claims.release(held)
    else:
        idle = age_s(note)
        if idle < after_s:
            return 0  # a writer about to take its claim, or one that just gave it back
    objects.abort_uploads(temporaries)  # pieces of a part being replaced, staged there
    objects.remove_tree(temporaries)    # its note last among them: a pass cut short finds it again
    log.warning("cleaned what %s's writer %s left at %s, untouched for %.0f s (its daemon is gone)", owner,
                writer, objects.where(part or temporaries), idle, extra=fields(tier="shared"))
    return 1


def _finish_removal(objects: Objects, claims: Claims, scope: Scope, note: str, owner: str,
                    after_s: float) -> int:
    """A removal ``owner`` began and never finished: the part's remaining objects go (unless a part was
    published there since), under the part's claim; 1 when done, else 0."""
    try:
        raw, got = objects.read(note)
    except FileNotFoundError:
        return 0
    idle = age_s(got)
    if idle < after_s:
        return 0  # its daemon may be at it now
    try:
        part = str(json.loads(raw)["part"])
    except (ValueError, KeyError, TypeError):
        part = ""
    if part and part.startswith(scope.root):
        try:
            held = claims.take(part, uuid.uuid4().hex[:12])
        except OSError:
            return 0  # a writer is at the part now (it removes what is not its own), or the store failed
        try:
            discard_unpublished(objects, part)
        finally:
            claims.release(held)
    objects.delete(note)
    log.warning("finished the removal of %s that %s began %.0f s ago (its daemon is gone)",
                objects.where(part or note), owner, idle, extra=fields(tier="shared"))
    return 1
