"""Which steps ``save_total_limit`` removes: the Trainer's rotation of its checkpoint directories, as steps."""

from __future__ import annotations

from collections.abc import Collection


def steps_to_rotate(steps: Collection[int], limit: int | None, protected: Collection[int]) -> list[int]:
    """The steps ``save_total_limit`` removes, oldest first: as the Trainer rotates its directories.

    At most ``limit`` steps are kept (no rotation when ``limit`` is None or
    below 1), never removing a ``protected`` one (the newest, the best), so
    more are kept when the protected ones alone exceed the limit.
    """
    if not limit or limit < 1:
        return []
    ordered = sorted(set(steps))
    keep = max(limit, len(set(protected) & set(ordered)))
    remove: list[int] = []
    left = len(ordered)
    for step in ordered:
        if left <= keep:
            break
        if step not in protected:
            remove.append(step)
            left -= 1
    return remove
