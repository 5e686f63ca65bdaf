"""The scale simulator's small version: how the shared tier's work grows with the job, counted.

``bench/bench_scale.py`` runs W ranks (real ``Client`` objects on threads) over
N real daemons on one shared directory and counts, with ``strace`` attached to
every daemon, the file-system calls on that directory per step. Here it runs
at W = 16, N = 2 and W = 64, N = 8 and the assertions are on counted
operations only, never on times: what a parallel file system's metadata
server sees must grow as O(W + N), and a resharding load must open the files
its box needs, not every part's.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import _syscounts as syscounts  # noqa: E402 - what the simulator counts with
import bench_scale as scale  # noqa: E402 - the simulator itself, not a copy

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("strace") is None, reason="counting needs strace")]

SMALL, LARGE = (16, 2), (64, 8)
# O(W + N) with the tolerance on the fitted exponent (<= 1.1), between the two sizes
GROWTH_LIMIT = ((LARGE[0] + LARGE[1]) / (SMALL[0] + SMALL[1])) ** 1.1
# What a rank reading half of each of two fragments needs: their two data files and two manifests, one
# per-step index, and a little slack; never one file per part of the job.
RESHARD_FILES_LIMIT = 8


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], Any]:
    args = scale.parse_args(["--rounds", "1", "--idle-s", "2", "--settle-s", "1.5", "--traced-steps", "3"])
    out = {}
    for world, nodes in (SMALL, LARGE):
        work = tmp_path_factory.mktemp(f"w{world}n{nodes}")
        out[(world, nodes)] = scale.measure(world, nodes, work / "tiers", work / "d", args)
    return out


def test_the_count_is_of_calls_on_the_shared_tier_only(tmp_path: Path) -> None:
    shared, local = tmp_path / "shared", tmp_path / "local"
    log = tmp_path / "t.strace"
    log.write_text("\n".join([
        f'101 10.5 openat(AT_FDCWD</x>, "{shared}/job/step-000000000001/rank-00000/manifest.json", O_RDONLY) = 3',
        f'101 10.6 openat(AT_FDCWD</x>, "{shared}/.tmp/n/p/data.safetensors", O_WRONLY|O_CREAT, 0600) = 4',
        f'102 10.7 getdents64(5<{shared}/job/step-000000000001>, 0x7f /* 4 entries */, 32768) = 112',
        f'102 10.8 newfstatat(6<{shared}/job>, "step-000000000001", {{st_mode=S_IFDIR}}, 0) = 0',
        f'103 10.9 renameat2(AT_FDCWD</x>, "{shared}/.tmp/n/p", AT_FDCWD</x>, "{shared}/job/s/r", RENAME_NOREPLACE <unfinished ...>',
        '103 11.0 <... renameat2 resumed>) = 0',
        f'104 11.1 fsync(7<{shared}/job/s/r/data.safetensors>) = 0',
        f'105 11.2 openat(AT_FDCWD</x>, "{local}/job/step-000000000001/commit.json", O_RDONLY) = 3',
        f'105 11.3 statx(AT_FDCWD</x>, "{shared}x/elsewhere", 0, STATX_ALL, 0x7f) = -1 ENOENT',
        f'106 20.0 openat(AT_FDCWD</x>, "{shared}/job", O_RDONLY|O_DIRECTORY) = 3',
    ]) + "\n")
    counts = syscounts.count_trace(log, shared, {"w": (10.0, 12.0)})["w"]
    assert dict(counts) == {"open": 1, "create": 1, "list": 1, "stat": 1, "rename": 1, "sync": 1}
    assert syscounts.metadata(counts) == 5


def test_every_part_lands_on_the_shared_tier_and_is_counted_there(figures: dict[tuple[int, int], Any]) -> None:
    for (world, nodes), f in figures.items():
        kinds = f.step_kinds
        assert f.meta_step > 0 and f.idle_per_s_node > 0, (world, nodes, kinds)
        # each rank's part is created there (its directory and files) and renamed into place
        assert kinds["create"] >= 2 * world and kinds["rename"] >= world, (world, nodes, kinds)
        assert f.meta_step_max_node <= f.meta_step


def test_shared_tier_operations_per_step_grow_at_most_linearly_in_w_plus_n(
        figures: dict[tuple[int, int], Any]) -> None:
    """A step's own calls (on its directory, its parts and the temporaries they are written in): each part
    written once, one listing per node, one node reading the W manifests to seal the step. The periodic
    re-reads of the job are the idle figure's (below), whatever the step's window."""
    small, large = figures[SMALL], figures[LARGE]
    growth = large.meta_step_own / small.meta_step_own
    assert growth <= GROWTH_LIMIT, (f"{small.meta_step_own:.0f} -> {large.meta_step_own:.0f} shared-tier metadata "
                                    f"operations per step from W+N={sum(SMALL)} to {sum(LARGE)}: x{growth:.2f}, "
                                    f"limit x{GROWTH_LIMIT:.2f}")


def test_an_idle_daemon_costs_the_shared_tier_the_same_whatever_the_world_size(
        figures: dict[tuple[int, int], Any]) -> None:
    """A daemon watching a job re-reads its steps by listing them (parts of committed steps come from their
    records), so its calls a second do not grow with the ranks of the job."""
    small, large = figures[SMALL], figures[LARGE]
    assert large.idle_per_s_node <= 1.5 * small.idle_per_s_node + 2, (small.idle_per_s_node, large.idle_per_s_node)


def test_a_resharding_load_opens_the_files_its_box_needs(figures: dict[tuple[int, int], Any]) -> None:
    """The step index and the data files of the two fragments its box crosses; no part's manifest."""
    for (world, nodes), f in figures.items():
        assert f.reshard_manifests == 0, (world, nodes, f.reshard_files, f.reshard_manifests)
        assert f.reshard_files <= RESHARD_FILES_LIMIT, (world, nodes, f.reshard_files, f.reshard_manifests)
