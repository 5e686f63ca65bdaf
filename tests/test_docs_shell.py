"""The shell blocks of README.md and deploy/*/README.md run as written on a fresh Debian 12 node.

What a reader copies and pastes must not stop half-way: each block parses (``bash -n``), every file it
installs or copies lands in a directory that a fresh Debian 12 system has or that the block (or an earlier
block of the same page) created first, and every file of ``deploy/`` it names exists. The real run of the
systemd install, in a booted Debian 12 container, is ``deploy/systemd/check-in-container.sh`` (.ci/run).
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "deploy").glob("*/README.md"))]
SHELL_LANGS = {"sh", "bash", "shell"}
# Directories a fresh Debian 12 (debootstrap, systemd installed) has; anything else must be made first.
FRESH_DIRS = {"/", "/etc", "/etc/systemd", "/etc/systemd/system", "/usr", "/usr/local", "/usr/local/bin",
              "/opt", "/srv", "/tmp", "/var", "/var/tmp", "/run"}


def shell_blocks(text: str) -> list[str]:
    """The bodies of the fenced blocks whose language is a shell (not ``console``: prompts and output)."""
    return [m.group(2) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M)
            if m.group(1) in SHELL_LANGS]


def commands(block: str) -> list[list[str]]:
    """Each command of a block as words: comments dropped, continuation lines joined, ``&&``/``;`` split."""
    joined = re.sub(r"\\\n", " ", block)
    found = []
    for line in joined.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # a quoted string spanning lines: not an install step
        cmd: list[str] = []
        for word in words + [";"]:
            if word in {"&&", ";", "||", "|"}:
                if cmd:
                    found.append(cmd)
                cmd = []
            else:
                cmd.append(word)
    return found


def _strip_sudo(cmd: list[str]) -> list[str]:
    return cmd[1:] if cmd[:1] == ["sudo"] else cmd


def _made_dirs(cmd: list[str]) -> list[str]:
    """The directories ``mkdir -p`` / ``install -d`` creates (with their parents)."""
    args = [a for a in cmd[1:] if not a.startswith("-")]
    if cmd[0] == "install" and "-d" in cmd:
        # install -d -o USER -g GROUP -m MODE DIR...: options that take a value.
        args, skip = [], False
        for a in cmd[1:]:
            if skip:
                skip = False
            elif a in {"-o", "-g", "-m"}:
                skip = True
            elif not a.startswith("-"):
                args.append(a)
    elif cmd[0] != "mkdir" or "-p" not in cmd:
        return []
    made = []
    for a in args:
        p = Path(a)
        made += [str(p), *(str(q) for q in p.parents)]
    return made


def _targets(cmd: list[str]) -> list[str]:
    """The absolute directories ``cp``/``install`` (not ``-d``) write a file into."""
    if cmd[0] not in {"cp", "install"} or "-d" in cmd:
        return []
    args, skip = [], False
    for a in cmd[1:]:
        if skip:
            skip = False
        elif a in {"-o", "-g", "-m", "-t"}:
            skip = True
        elif not a.startswith("-"):
            args.append(a)
    if len(args) < 2 or not args[-1].startswith("/"):
        return []
    dest = args[-1]
    return [dest.rstrip("/") or "/"] if dest.endswith("/") else [str(Path(dest).parent)]


def missing_dirs(blocks: list[str]) -> list[str]:
    """Each install/copy into a directory neither fresh on Debian 12 nor created before it."""
    made = set(FRESH_DIRS)
    wrong = []
    for block in blocks:
        for cmd in map(_strip_sudo, commands(block)):
            if not cmd:
                continue
            made.update(_made_dirs(cmd))
            wrong += [f"{shlex.join(cmd)}: {d} is not created first" for d in _targets(cmd) if d not in made]
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shell_block_parses(page: Path) -> None:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    blocks = shell_blocks(page.read_text())
    for block in blocks:
        out = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{page.name}: bash -n: {out.stderr}\n{block}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_is_installed_into_a_directory_made_first(page: Path) -> None:
    assert missing_dirs(shell_blocks(page.read_text())) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_deploy_file_named_exists(page: Path) -> None:
    named = set(re.findall(r"\bdeploy/[\w.@/-]*[\w@]", page.read_text()))
    assert named, page
    assert sorted(n for n in named if not (ROOT / n).exists()) == []


def test_the_checks_catch_an_install_into_a_directory_never_made() -> None:
    """What the README did: install a config into /etc/ckptstage, which a fresh node lacks."""
    block = "sudo cp deploy/systemd/ckptstaged@.service /etc/systemd/system/\n" \
            "sudo install -m 0644 my-alice.toml /etc/ckptstage/alice.toml\n"
    assert missing_dirs([block]) == [
        "install -m 0644 my-alice.toml /etc/ckptstage/alice.toml: /etc/ckptstage is not created first"]
    assert missing_dirs(["install -d -m 0755 /etc/ckptstage\n" + block]) == []
    assert missing_dirs(["mkdir -p /etc/ckptstage/x && install -m 0600 a /etc/ckptstage/b"]) == []
    # A drop-in directory is not on a fresh system either.
    assert missing_dirs(["install -m 0644 deploy/systemd/metrics.conf /etc/systemd/system/ckptstaged@.service.d/"])


def test_the_example_config_is_safe_on_a_small_ssd() -> None:
    """example.toml is copied as is: a free-space floor above what a node's SSD has evicts every step.

    With ``min_free_bytes = "100GiB"`` on a node with less free, every commit evicted every drained step.
    """
    from ckptstage.daemon.config import load_config

    local = load_config(ROOT / "deploy" / "systemd" / "example.toml").local
    assert local.min_free_bytes is None or local.min_free_bytes <= 16 * 2**30, local
