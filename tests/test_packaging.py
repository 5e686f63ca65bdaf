"""Packaging contracts: import boundaries, generated code, and who may reach the socket.

Import checks run in fresh subprocesses (cwd outside the repository) because
this test process has long since imported torch and the repository root may
be on its ``sys.path``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ckptstage.client import Client

REPO = Path(__file__).resolve().parents[1]
GENERATED = ("ckptstage_pb2.py", "ckptstage_pb2.pyi", "ckptstage_pb2_grpc.py")


def run_python(code: str, cwd: Path, timeout: float = 120) -> str:
    """Runs ``code`` in a fresh interpreter of this venv; returns its stdout, failing with its stderr."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_daemon_never_imports_torch_even_while_serving(tmp_path):
    out = run_python(f"""
        import importlib, json, pkgutil, sys
        import grpc
        import ckptstage.daemon, ckptstage.protos

        names = []
        for pkg in (ckptstage.daemon, ckptstage.protos):
            for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                importlib.import_module(info.name)
                names.append(info.name)

        from ckptstage.daemon.config import load_config
        from ckptstage.daemon.main import Daemon
        from ckptstage.protos.v1 import ckptstage_pb2 as pb, ckptstage_pb2_grpc as pb_grpc

        root = {str(tmp_path)!r}
        cfg = load_config(None, {{"socket": root + "/run/d.sock", "local.dir": root + "/local",
                                  "shared.dir": root + "/shared", "arena.max_bytes": "8MiB",
                                  "arena.min_session_bytes": "1MiB", "persist.chunk_bytes": "1MiB"}},
                          env={{"HOME": root}})
        daemon = Daemon(cfg)
        daemon.start()
        stub = pb_grpc.CheckpointerStub(grpc.insecure_channel("unix:" + root + "/run/d.sock"))
        sid = stub.OpenSession(pb.OpenSessionRequest(job="j", world_size=1)).session_id
        arena = stub.EnsureArena(pb.EnsureArenaRequest(session_id=sid, want_bytes=1 << 20))
        status = stub.Status(pb.StatusRequest())
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        daemon.stop()
        torch_modules = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print(json.dumps({{"modules": names, "torch": torch_modules, "arena": arena.size_bytes,
                          "sessions": len(status.sessions)}}))
    """, cwd=tmp_path)
    result = json.loads(out.splitlines()[-1])
    assert result["torch"] == []
    for expected in ("ckptstage.daemon.main", "ckptstage.daemon.node.node", "ckptstage.daemon.serve.servicer",
                     "ckptstage.daemon.save.persister", "ckptstage.daemon.save.arena", "ckptstage.protos.layout",
                     "ckptstage.protos.v1.ckptstage_pb2_grpc"):
        assert expected in result["modules"]
    assert result["arena"] == 1 << 20 and result["sessions"] == 1  # it really served


def test_running_daemon_process_has_no_torch_loaded(daemon):
    with Client("maps", socket=daemon.socket) as c:
        c.save(1, {"w": torch.ones(10)}).wait("local", timeout=30)
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps
    assert "grpc" in maps  # the check reads the right process


def test_client_imports_torch_only_when_client_is_used(tmp_path):
    out = run_python("""
        import sys
        import ckptstage.client
        from ckptstage.client import CkptStageError, DaemonUnavailable  # errors need no torch
        before = "torch" in sys.modules
        ckptstage.client.Client
        after = "torch" in sys.modules
        print(before, after)
    """, cwd=tmp_path)
    assert out.split() == ["False", "True"]


def test_client_never_imports_the_daemon(tmp_path):
    """client -> protos <- daemon: every client module, the CLI and the demo included."""
    out = run_python("""
        import importlib, pkgutil, sys
        import ckptstage.client
        for m in pkgutil.walk_packages(ckptstage.client.__path__, "ckptstage.client."):
            importlib.import_module(m.name)
        print(sorted(n for n in sys.modules if n.startswith("ckptstage.daemon")))
    """, cwd=tmp_path)
    assert out.strip() == "[]"


def test_the_core_never_imports_an_integration_or_its_framework(tmp_path):
    """Every module of the client, the CLI, the DCP backend and the daemon: no Lightning, transformers or
    accelerate, and neither integration (they are extras: `pip install ckptstage[lightning]`, `[hf]`)."""
    out = run_python("""
        import importlib, pkgutil, sys
        import ckptstage.client, ckptstage.daemon, ckptstage.dcp
        for pkg in (ckptstage.client, ckptstage.daemon, ckptstage.dcp):
            for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                importlib.import_module(m.name)
        ckptstage.client.Client
        banned = ("lightning", "pytorch_lightning", "transformers", "accelerate")
        print(sorted(n for n in sys.modules if n.split(".")[0] in banned or n in ("ckptstage.lightning", "ckptstage.hf")))
    """, cwd=tmp_path)
    assert out.strip() == "[]"


@pytest.mark.parametrize("name", ["daemon", "client", "protos"])
def test_repo_folders_are_not_top_level_packages(tmp_path, name):
    out = run_python(f"""
        import importlib, importlib.util
        import ckptstage.{name}
        print(importlib.util.find_spec({name!r}) is None)
        try:
            importlib.import_module({name!r})
        except ModuleNotFoundError:
            print("refused")
        print(ckptstage.{name}.__name__)
    """, cwd=tmp_path)
    assert out.split() == ["True", "refused", f"ckptstage.{name}"]


def test_generated_protobuf_modules_are_not_stale(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gen_protos.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    stale = [n for n in GENERATED if (tmp_path / n).read_bytes() != (REPO / "protos" / "v1" / n).read_bytes()]
    assert stale == [], f"regenerate with `make protos`: {stale} differ from protos/v1/ckptstage.proto"


def test_generated_modules_import_through_the_package():
    text = (REPO / "protos" / "v1" / "ckptstage_pb2_grpc.py").read_text()
    assert "from ckptstage.protos.v1 import ckptstage_pb2" in text


def test_socket_is_private_to_the_user(daemon):
    run_dir = daemon.socket.parent
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    st = daemon.socket.stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()


def test_socket_directory_created_with_missing_parents(daemon_factory):
    d = daemon_factory()
    d.socket = d.root / "deep" / "er" / "ckptstage.sock"
    d.write_config(socket=str(d.socket))
    d.start()
    assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(d.socket.stat().st_mode) == 0o600


def test_console_scripts_are_installed():
    bindir = Path(sys.executable).parent
    proc = subprocess.run([str(bindir / "ckptstaged"), "--version"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.startswith("ckptstaged "), proc.stderr
    assert (bindir / "ckptstage").exists()


def test_the_wheel_holds_every_module_of_the_source_tree(tmp_path):
    """pyproject lists every package: a wheel built from the tree, installed on its own, imports each module
    the repository has (a subpackage left out of ``packages`` would be missing from every install)."""
    from test_layers import modules

    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(REPO)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("ckptstage-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    expected = sorted(name for name, _ in modules())
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import importlib, json, sys
        sys.path.insert(0, {str(tmp_path / "site")!r})
        for name in {expected!r}:
            module = importlib.import_module(name)
            assert module.__file__.startswith({str(tmp_path / "site")!r}), (name, module.__file__)
        print(json.dumps(len({expected!r})))
    """)], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == len(expected) > 90
