"""How the command line prints: times, ages, sizes, tables, the lines of a tier or a job, and the stable JSON
of docs/CLI.md."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from ckptstage.client.progress import size_text  # one byte formatter for tables and progress
from ckptstage.protos.v1 import ckptstage_pb2 as pb


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def age(ts: float, now: float | None = None) -> str:
    """``ts`` as ``"42s ago"``, ``"3m ago"``, ``"5h ago"``, ``"2d ago"``; ``"-"`` for none."""
    if not ts:
        return "-"
    left = max(0.0, (time.time() if now is None else now) - ts)
    for unit, seconds in (("d", 86400), ("h", 3600), ("m", 60)):
        if left >= seconds:
            return f"{left // seconds:.0f}{unit} ago"
    return f"{left:.0f}s ago"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def tier_name(value: int) -> str:
    return pb.Tier.Name(value).lower()


def to_json(message: Message) -> dict[str, Any]:
    """A message as the stable JSON object of docs/CLI.md: every field present (zero, false, empty and
    unset sub-messages included), 64-bit integers as numbers, tiers as ``"local"``/``"shared"``/``"memory"``."""
    plain = MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True,
                          unquote_int64_if_possible=True)
    return _normalized(message, plain)


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _normalized(message: Message, plain: dict[str, Any]) -> dict[str, Any]:
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # map<string, double>: as json_format writes it
        if field.message_type is not None:
            plain[field.name] = ([to_json(v) for v in value] if field.is_repeated else to_json(value))
        elif field.enum_type is not None:
            plain[field.name] = ([field.enum_type.values_by_number[v].name.lower() for v in value]
                                 if field.is_repeated else field.enum_type.values_by_number[value].name.lower())
        elif field.type in _INT64:  # beyond 2**53 json_format quotes them; a script wants one type
            plain[field.name] = list(value) if field.is_repeated else int(value)
    return plain


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True))


def emit(args: argparse.Namespace, message: Message, text: Callable[[], str],
          extra: dict[str, Any] | None = None) -> None:
    if args.json:
        print_json({**(extra or {}), **to_json(message)})
    else:
        print(text())


def tier_line(t: pb.TierStatus) -> str:
    name = tier_name(t.tier)
    if not t.enabled:
        return f"{name}: disabled"
    room = "no size limit" if t.unbounded else f"{size_text(t.free_bytes)} free"
    line = f"{name}: {t.dir} — {t.checkpoints} part(s), {size_text(t.used_bytes)} used, {room}"
    state = t.state or ("ok" if t.reachable else "unreachable")
    if state != "ok":
        line += f" ({state.upper()})"
    if t.last_error:
        line += f"; last error {when(t.last_error_time)} ({age(t.last_error_time)}): {t.last_error}"
    return "\n".join([line, *(f"  WARNING: {w}" for w in t.warnings)])


def drain_text(d: pb.DrainState) -> str:
    text = d.state or "-"
    if d.queued_parts:
        text += f", {d.queued_parts} part(s) / {size_text(d.queued_bytes)} queued"
    if d.consecutive_failures:
        text += f", {d.consecutive_failures} failure(s) in a row"
    return text


def job_line(j: pb.JobStatus) -> str:
    latest = f"latest step {j.latest_step}" if j.has_latest else "no complete step"
    line = (f"{j.job}: {j.checkpoints} checkpoint(s), {latest}, last commit {age(j.last_commit_time)}, "
            f"{j.sessions} session(s), drain {drain_text(j.drain)}")
    if j.drain.last_error:
        line += (f"; last drain error {when(j.drain.last_error_time)} ({age(j.drain.last_error_time)}): "
                 f"{j.drain.last_error}")
    if j.peers.peers:
        line += "; " + peers_text(j.peers)
    return line


def peers_text(p: pb.PeerState) -> str:
    """``replicas to 10.0.0.2:7461 ok, 10.0.0.3:7461 failing (UNAVAILABLE: ...); step 40 replicated, 1
    part queued 12s``: where a job's parts go, whether they get there, how far behind."""
    each = [f"{h.address} {h.state}" + (f" ({h.last_error})" if h.last_error else "") for h in p.peers]
    text = "replicas to " + ", ".join(each)
    text += f"; step {p.replicated_step} replicated" if p.has_replicated else "; no step replicated yet"
    if p.queued_parts:
        text += f", {p.queued_parts} part(s) queued {p.lag_s:.0f}s"
    return text


def stored_text(stored: int, logical: int, ranks: Iterable[int]) -> str:
    """What a step added on a tier and its share of the step's size: ``4.1 MiB (0.8%)``; ``-`` where the tier
    holds none of it."""
    if not list(ranks):
        return "-"
    return f"{size_text(stored)} ({100 * stored / logical:.3g}%)" if logical else size_text(stored)


def ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0-2,5,7-8``: a 1,000-rank job's missing ranks on one line."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def one_line(text: str) -> str:
    return " ".join(text.split())
