"""Whether the store honours conditional writes, which the tier checks before it uses the store.

Commit records (created exactly once across daemons), claims and removals
rely on the store refusing a conditional PUT whose condition fails; one
that ignores the conditions (some S3-compatible stores, or old versions of
them) would let two daemons both publish a step.
"""

from __future__ import annotations

import errno
import uuid

from ckptstage.daemon.tiers.s3.claims import quietly
from ckptstage.daemon.tiers.s3.keys import Keys
from ckptstage.daemon.tiers.s3.objects import Objects


def check_conditions(objects: Objects, keys: Keys) -> None:
    """Raises OSError (ENOTSUP) naming the store when it takes a conditional PUT whose condition fails.

    Three small requests on an object of this daemon's temporaries (``keys.owner``'s), then it is deleted."""
    key = f"{keys.dir_key(keys.tmp())}conditions-{uuid.uuid4().hex[:12]}"
    objects.put(key, b"1", if_absent=True)
    try:
        for what, write in (("If-None-Match: * on an object that exists",
                             lambda: objects.put(key, b"2", if_absent=True)),
                            ("If-Match with an ETag the object does not have",
                             lambda: objects.put(key, b"2", if_match='"00000000000000000000000000000000"'))):
            try:
                write()
            except (FileExistsError, FileNotFoundError):
                continue  # refused, as it must be
            raise OSError(errno.ENOTSUP, f"the store at {objects.connection.endpoint} took a conditional write "
                                         f"whose condition fails ({what}, on {keys.url_of(keys.location(key))}): "
                                         "it does not honour If-None-Match/If-Match on PutObject, which the "
                                         "shared tier needs so that two daemons never both publish a step; "
                                         "use a store that does (docs/OPERATIONS.md)")
    finally:
        quietly(objects.delete, key)
