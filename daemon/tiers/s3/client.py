"""Reaching an S3-compatible object store: where a tier is, the client, and what its errors mean.

The shared tier on an object store is configured by ``[shared] url =
"s3://bucket/prefix"`` with an optional ``endpoint`` (any S3-compatible
server) and ``region``. Credentials come from the standard sources of the
AWS SDK, in its order: the environment (``AWS_ACCESS_KEY_ID``...), a web
identity token, the shared credentials and config files (``profile``), a
container or instance role. Keys written in the daemon's config file are
used only where the operator said so (``allow_inline_credentials``), and a
warning says so.

Every failure of the store leaves this module as an ``OSError`` (the
daemon's one notion of "the tier failed"): ``FileNotFoundError`` for a key
or bucket that is not there, ``PermissionError`` for refused credentials,
``FileExistsError`` for a conditional write that lost, ``OSError`` (EIO,
EHOSTUNREACH) for the rest, each message naming the bucket, the key and the
endpoint so that a person can act on it.

This module imports boto3 (the ``s3`` extra); nothing outside the object-store
tier imports it (:func:`ckptstage.daemon.tiers.kinds.open_tiers` does, lazily).
"""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import boto3
import botocore
import botocore.config
import botocore.exceptions
import botocore.session

from ckptstage.daemon.config import ConfigError
from ckptstage.daemon.logs import fields

if TYPE_CHECKING:
    from ckptstage.daemon.config import SharedConfig

log = logging.getLogger(__name__)

# Bucket names as S3 allows them (3-63 characters; lower-case letters, digits, dots and hyphens).
BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# Connections per client: every upload piece and ranged read in flight holds one.
MAX_CONNECTIONS = 64
# Attempts of one request (the SDK's "standard" mode: exponential backoff with jitter on 5xx, throttling
# and connection errors), unless the operator set the SDK's own max_attempts (AWS_MAX_ATTEMPTS, or
# max_attempts in the profile of ~/.aws/config); the drainer retries a whole part on top of that.
REQUEST_ATTEMPTS = 5
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0

_NOT_FOUND = {"404", "NoSuchKey", "NotFound", "NoSuchUpload"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
           "InvalidToken", "AllAccessDisabled", "AccountProblem"}
_LOST_RACE = {"412", "PreconditionFailed"}
_CONFLICT = {"409", "ConditionalRequestConflict"}  # a concurrent conditional write: try again
# The bucket is in another region than the client signs for (a HEAD's answer has no body: its status only).
_WRONG_REGION = {"301", "PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"}


@dataclass(frozen=True)
class Location:
    """An ``s3://bucket/prefix`` URL taken apart; ``prefix`` has no leading or trailing slash."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Location:
        """Raises ValueError naming what is wrong with ``url``."""
        if not url.startswith("s3://"):
            raise ValueError(f'expected an S3 URL such as "s3://bucket/prefix", got {url!r}')
        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not BUCKET_RE.fullmatch(bucket) or ".." in bucket:
            raise ValueError(f"{bucket!r} in {url!r} is not a valid bucket name (3 to 63 lower-case letters, "
                             "digits, dots and hyphens, starting and ending with a letter or digit)")
        prefix = prefix.rstrip("/")
        segments = prefix.split("/") if prefix else []
        for seg in segments:
            if seg in ("", ".", "..") or seg.startswith(".") or any(ord(c) < 0x20 or c == "\x7f" for c in seg):
                raise ValueError(f"the prefix of {url!r} has an empty, dot-led or control-character segment "
                                 f"{seg!r}")
        return cls(bucket, prefix)

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


@dataclass(frozen=True)
class Connection:
    """One client to one bucket, and what error messages name about it."""

    client: Any  # botocore's S3 client (thread-safe; its types are generated at run time)
    location: Location
    endpoint: str  # the URL requests go to, for messages
    credentials: str  # which source the SDK took credentials from ("env", "shared-credentials-file", ...)

    @property
    def bucket(self) -> str:
        return self.location.bucket

    def where(self, key: str | None = None) -> str:
        """``s3://bucket/key at <endpoint>``: how messages name an object (or the bucket)."""
        return f"s3://{self.bucket}/{key or ''} at {self.endpoint}"


def connect(config: SharedConfig) -> Connection:
    """A client for the tier ``config.url`` names, with credentials from the standard sources.

    Nothing is sent yet (see :func:`check`). Keys written in the config file are used
    only with ``allow_inline_credentials`` (the config refuses them otherwise); a
    warning says so.
    """
    assert config.url is not None
    location = Location.parse(config.url)
    if config.access_key_id is not None:
        log.warning("the shared tier %s uses credentials written in the config file "
                    "([shared] allow_inline_credentials = true); prefer the environment, a profile or a role",
                    location.url, extra=fields(tier="shared"))
    try:
        conn = open_connection(location, config.endpoint, config.region, config.profile, config.access_key_id,
                               config.secret_access_key)
    except botocore.exceptions.ProfileNotFound:
        raise ConfigError("shared.profile", f"no profile {config.profile!r} in the AWS config or credentials file "
                                            "(~/.aws/config, $AWS_CONFIG_FILE, $AWS_SHARED_CREDENTIALS_FILE)") from None
    check_sdk(conn.client)
    return conn


# Request parameters the tier sends, by operation: claims are renewed and removed with If-Match, records
# and claims created with If-None-Match. An SDK too old to know one refuses the request before sending it.
_CONDITIONS = {"PutObject": ("IfNoneMatch", "IfMatch"), "DeleteObject": ("IfMatch",), "GetObject": ("IfMatch",)}


def check_sdk(client: Any) -> None:
    """Raises :class:`ConfigError` when the installed botocore cannot send the conditional requests the tier
    relies on (botocore before 1.35.69), naming what to install."""
    model = client.meta.service_model
    missing = [f"{op} {name}" for op, names in _CONDITIONS.items()
               for name in names if name not in model.operation_model(op).input_shape.members]
    if missing:
        raise ConfigError("shared.url", f"the installed botocore {botocore.__version__} cannot send "
                                        f"{', '.join(missing)}, which the object-store tier needs: install "
                                        "boto3>=1.35.69 (pip install -U 'ckptstage[s3]')")


def open_connection(location: Location, endpoint: str | None = None, region: str | None = None,
                    profile: str | None = None, access_key_id: str | None = None,
                    secret_access_key: str | None = None) -> Connection:
    """A client for ``location``: at ``endpoint`` (None: AWS), with the SDK's credential chain unless keys
    are given."""
    for sdk in ("botocore", "boto3", "s3transfer", "urllib3"):  # their DEBUG is every request, signed headers
        if logging.getLogger(sdk).level == logging.NOTSET:
            logging.getLogger(sdk).setLevel(logging.WARNING)
    keys = {"aws_access_key_id": access_key_id, "aws_secret_access_key": secret_access_key} \
        if access_key_id is not None else {}
    core = botocore.session.Session(profile=profile)
    session = boto3.session.Session(botocore_session=core, region_name=region, **keys)
    attempts = core.get_config_variable("max_attempts") or REQUEST_ATTEMPTS
    client = session.client("s3", endpoint_url=endpoint, config=botocore.config.Config(
        retries={"mode": "standard", "total_max_attempts": int(attempts)},
        max_pool_connections=MAX_CONNECTIONS,
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        # An endpoint other than AWS's rarely resolves bucket.host names: address buckets in the path.
        s3={"addressing_style": "path" if endpoint else "auto"},
    ))
    creds = session.get_credentials()
    return Connection(client, location, client.meta.endpoint_url,
                      getattr(creds, "method", "none") if creds is not None else "none")


def check(conn: Connection) -> None:
    """Whether the bucket is there and the credentials may list and read it: one request each.

    Raises ``FileNotFoundError`` (no such bucket), ``PermissionError`` (credentials refused
    or missing) or ``OSError`` (the endpoint does not answer), naming the bucket, the
    endpoint and where the credentials came from.
    """
    prefix = conn.location.prefix
    with errors(f"the shared tier {conn.location.url}", conn, None, bucket=True):
        conn.client.head_bucket(Bucket=conn.bucket)
    with errors(f"listing the shared tier {conn.location.url}", conn, None, bucket=True):
        conn.client.list_objects_v2(Bucket=conn.bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)


def error_code(e: botocore.exceptions.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", "")) or \
        str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


@contextmanager
def errors(what: str, conn: Connection, key: str | None, bucket: bool = False) -> Iterator[None]:
    """Turns what the SDK raises inside the block into an ``OSError`` naming ``what``, the object and
    the endpoint (see the module docstring). ``bucket``: a missing object means a missing bucket."""
    try:
        yield
    except botocore.exceptions.ClientError as e:
        region = e.response.get("Error", {}).get("Region") or \
            e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("x-amz-bucket-region")
        raise _os_error(what, conn, key, error_code(e), str(e), bucket, region) from e
    except botocore.exceptions.NoCredentialsError as e:
        raise PermissionError(errno.EACCES, f"{what}: no credentials for {conn.where(key)}: set "
                              "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, [shared] profile, or give the node a "
                              "role") from e
    except botocore.exceptions.BotoCoreError as e:  # connection refused, timeouts, a stream cut short
        raise OSError(errno.EHOSTUNREACH if isinstance(e, botocore.exceptions.EndpointConnectionError)
                      else errno.EIO, f"{what}: {conn.where(key)}: {e}") from e


def _os_error(what: str, conn: Connection, key: str | None, code: str, detail: str, bucket: bool,
              region: str | None = None) -> OSError:
    if code in _WRONG_REGION and (region or code != "AuthorizationHeaderMalformed"):
        where = f"region {region!r}" if region else "another region"
        fix = f'set [shared] region = "{region}"' if region else "set [shared] region to the bucket's"
        return OSError(errno.EIO, f"{what}: the bucket {conn.bucket!r} at {conn.endpoint} is in {where}, not "
                                  f"{conn.client.meta.region_name!r} that requests are signed for ({code}): {fix} "
                                  "(or [shared] endpoint to one of that region)")
    if code == "NoSuchBucket" or (bucket and code in _NOT_FOUND):
        return FileNotFoundError(errno.ENOENT, f"{what}: the bucket {conn.bucket!r} does not exist at "
                                 f"{conn.endpoint}")
    if code in _NOT_FOUND:
        return FileNotFoundError(errno.ENOENT, f"{what}: no object {conn.where(key)}")
    if code in _DENIED:
        return PermissionError(errno.EACCES, f"{what}: access to the bucket {conn.bucket!r} at {conn.endpoint} "
                               f"refused ({code}) for the credentials from {conn.credentials}")
    if code in _LOST_RACE:
        return FileExistsError(errno.EEXIST, f"{what}: {conn.where(key)} was changed meanwhile ({code})")
    return OSError(errno.EIO, f"{what}: {conn.where(key)}: {detail}")


def is_refused(e: OSError) -> bool:
    """Whether ``e`` is the store declining the request as such (not implemented there, or not allowed to
    these credentials), so that asking again is no use: a 501, or a 4xx that is not about the object (not
    missing, not changed meanwhile, not throttled)."""
    cause = e.__cause__
    if not isinstance(cause, botocore.exceptions.ClientError):
        return False
    status = int(cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return status == 501 or (400 <= status < 500 and status not in (404, 408, 409, 412, 429))


def is_conflict(e: OSError) -> bool:
    """Whether ``e`` is S3's answer to a conditional write racing another one (worth trying again)."""
    cause = e.__cause__
    return isinstance(cause, botocore.exceptions.ClientError) and error_code(cause) in _CONFLICT
