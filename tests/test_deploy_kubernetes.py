"""The Kubernetes manifests in deploy/kubernetes: parsed, cross-checked, and their config run for real.

No cluster here, so what would break a deployment is checked between the
files: the daemon's config paths against its mounts, the trainer's mounts
against the daemon's, the grace period against the shutdown timeout, the uid
everywhere, the metrics port against the PodMonitor and the alerts' scrape
job. Then the ConfigMap's TOML, with the DaemonSet's own arguments, starts a
real ckptstaged (paths moved under a temporary root, metrics on loopback) and
the probes' command answers against it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from ckptstage.daemon.config import Config, load_config
from ckptstage.daemon.configvalues import NODE_NAME_ENV, parse_size, split_host_port
from ckptstage.daemon.node.node import node_name
from ckptstage.protos import layout
from ckptstage.daemon.launcher import DaemonProcess
from support import free_port, scrape, wait_until

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
GiB = 1 << 30


# --- loading ------------------------------------------------------------------------------------------


def manifests() -> dict[str, list[dict[str, Any]]]:
    """Every YAML file under deploy/kubernetes -> its documents."""
    found = {}
    for path in sorted(K8S.rglob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        found[str(path.relative_to(K8S))] = docs
    return found


def resources() -> list[dict[str, Any]]:
    return [d for docs in manifests().values() for d in docs if d.get("kind") != "Kustomization"]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [r for r in resources() if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(matches) == 1, f"{len(matches)} {kind} {name or ''} manifests"
    return matches[0]


def pod_spec(kind: str) -> dict[str, Any]:
    spec: dict[str, Any] = one(kind)["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    cs = [c for c in spec["containers"] if name is None or c["name"] == name]
    assert len(cs) == 1
    return cs[0]


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def flag(c: dict[str, Any], name: str) -> str:
    values = [a.split("=", 1)[1] for a in c.get("args", []) if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name}= in {c['args']}"
    return values[0]


def volume(spec: dict[str, Any], c: dict[str, Any], path: str | os.PathLike[str]) -> tuple[dict[str, Any], str, Any]:
    """The volume holding ``path`` in container ``c``: (its volume entry, its mountPath, the mount)."""
    path = PurePosixPath(os.fspath(path))
    best = max((m for m in c.get("volumeMounts", []) if path.is_relative_to(m["mountPath"])),
               key=lambda m: len(m["mountPath"]), default=None)
    assert best is not None, f"{path} is on no volume of container {c['name']}"
    vols = {v["name"]: v for v in spec["volumes"]}
    return vols[best["name"]], best["mountPath"], best


def source(vol: dict[str, Any]) -> tuple[str, Any]:
    """A volume's kind and identity: ("hostPath", "/dev/shm"), ("persistentVolumeClaim", "claim"), ..."""
    if "hostPath" in vol:
        return "hostPath", vol["hostPath"]["path"]
    if "persistentVolumeClaim" in vol:
        return "persistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]
    if "configMap" in vol:
        return "configMap", vol["configMap"]["name"]
    kind = next(k for k in vol if k != "name")
    return kind, vol[kind]


NODE = "gpu-node-7"


def daemon_config() -> tuple[Config, dict[str, Any], dict[str, Any]]:
    """The daemon's config as the pod runs it: the ConfigMap's TOML, its flags, $(CKPTSTAGE_NODE_NAME) filled in."""
    spec = pod_spec("DaemonSet")
    c = container(spec, "ckptstaged")
    config_path = PurePosixPath(flag(c, "config"))
    vol, mount, _ = volume(spec, c, config_path)
    kind, name = source(vol)
    assert kind == "configMap"
    text = one("ConfigMap", name)["data"][str(config_path.relative_to(mount))]
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"ckptstage-k8s-{os.getpid()}.toml"
    tmp.write_text(text)
    try:
        local = flag(c, "local-dir").replace("$(CKPTSTAGE_NODE_NAME)", NODE)
        cfg = load_config(tmp, {"local.dir": local}, env={"HOME": "/nonexistent"})
    finally:
        tmp.unlink()
    return cfg, spec, c


# --- the files ----------------------------------------------------------------------------------------


def test_every_manifest_parses_and_every_kustomization_lists_its_directory() -> None:
    found = manifests()
    assert {"daemonset.yaml", "configmap.yaml", "trainer-job.yaml", "monitoring/podmonitor.yaml",
            "monitoring/prometheusrule.yaml"} <= set(found)
    for name, docs in found.items():
        assert docs, name
        for d in docs:
            assert d.get("apiVersion") and d.get("kind"), name
            if d["kind"] != "Kustomization":
                assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", d["metadata"]["name"]), name
    for name, docs in found.items():
        if docs[0]["kind"] == "Kustomization":
            here = (K8S / name).parent
            listed = set(docs[0]["resources"])
            on_disk = {p.name for p in here.glob("*.yaml") if p.name != "kustomization.yaml"}
            # Only the example trainer is left out: it is applied on its own.
            assert on_disk - listed <= {"trainer-job.yaml"}, name
            assert listed <= on_disk, name


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("where", ["", "monitoring"])
def test_kubectl_kustomize_renders(where: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / where)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kinds = {d["kind"] for d in yaml.safe_load_all(out.stdout) if d}
    assert kinds == ({"PodMonitor", "PrometheusRule"} if where else {"ConfigMap", "PersistentVolumeClaim",
                                                                    "DaemonSet"})


def test_prometheusrule_is_alerts_yml() -> None:
    sys.path.insert(0, str(K8S / "monitoring"))
    try:
        import gen_prometheusrule
    finally:
        sys.path.pop(0)
    rendered = (K8S / "monitoring" / "prometheusrule.yaml").read_text()
    assert rendered == gen_prometheusrule.render(), "run deploy/kubernetes/monitoring/gen_prometheusrule.py"
    assert one("PrometheusRule")["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]


# --- the daemon's pod ---------------------------------------------------------------------------------


def test_the_configmap_is_a_valid_config_and_its_paths_are_on_the_pods_volumes() -> None:
    cfg, spec, c = daemon_config()
    assert cfg.local.dir == Path(f"/var/lib/ckptstage/{NODE}")
    # The socket's directory is a whole volume, shared with the trainers through the host.
    vol, mount, _ = volume(spec, c, cfg.socket)
    assert source(vol) == ("hostPath", vol["hostPath"]["path"]) and PurePosixPath(mount) == PurePosixPath(
        cfg.socket).parent
    # The local tier on the node (it outlives the pod), the shared tier on a ReadWriteMany claim.
    local, _, _ = volume(spec, c, cfg.local.dir)
    assert source(local)[0] == "hostPath"
    assert cfg.shared.dir is not None
    shared, _, _ = volume(spec, c, cfg.shared.dir)
    kind, claim = source(shared)
    assert kind == "persistentVolumeClaim"
    assert "ReadWriteMany" in one("PersistentVolumeClaim", claim)["spec"]["accessModes"]
    # The arenas: the host's /dev/shm itself.
    shm, mount, _ = volume(spec, c, "/dev/shm/ckptstage-1-abc-0")
    assert source(shm) == ("hostPath", "/dev/shm") and mount == "/dev/shm"
    # The probes and `kubectl exec ... ckptstage` find the socket the config names.
    assert env_of(c)["CKPTSTAGE_SOCKET"] == str(cfg.socket)


def test_the_daemons_name_is_stable_across_pods_and_unique_per_node() -> None:
    # node_name() = <$CKPTSTAGE_NODE_NAME>-<hash of local.dir>: the node's name, whatever the pod's host name.
    spec = pod_spec("DaemonSet")
    c = container(spec, "ckptstaged")
    assert env_of(c)[NODE_NAME_ENV] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert f"$({NODE_NAME_ENV})" in flag(c, "local-dir")


def test_a_replaced_pod_cleans_what_its_predecessor_left_on_the_shared_tier(tmp_path: Path) -> None:
    """Two pods of one node in turn, each with its own host name: the second daemon takes its name from
    $CKPTSTAGE_NODE_NAME, so it finds the temporaries the first left on the shared tier and removes them,
    and leaves another node's alone."""
    d = DaemonProcess(tmp_path / "pod", env={NODE_NAME_ENV: "gpu-07"})
    assert d.shared is not None
    mine = layout.tmp_root(d.shared, node_name(d.local, "gpu-07"))
    other = layout.tmp_root(d.shared, node_name(d.local, "gpu-08"))
    for root in (mine, other):
        (root / "job" / "step-3" / "rank-0.partial").mkdir(parents=True)
        (root / "job" / "step-3" / "rank-0.partial" / "data").write_bytes(b"x" * 1024)
    d.start()
    try:
        wait_until(lambda: not any(mine.rglob("*")), 30, f"{mine} cleaned at start")
        assert (other / "job" / "step-3" / "rank-0.partial" / "data").exists()
    finally:
        d.stop()


def test_no_host_namespaces_and_no_privilege() -> None:
    for kind in ("DaemonSet", "Job"):
        spec = pod_spec(kind)
        for key in ("hostIPC", "hostNetwork", "hostPID"):
            assert not spec.get(key), f"{kind}: {key}"
        assert spec["securityContext"]["runAsNonRoot"] is True
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged")
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
    # The init container is root only to hand host directories to the uid: CHOWN and FOWNER, nothing more.
    for init in pod_spec("DaemonSet")["initContainers"]:
        sc = init["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert set(sc["capabilities"]["add"]) <= {"CHOWN", "FOWNER"}


def test_one_uid_everywhere() -> None:
    daemon, trainer = pod_spec("DaemonSet"), pod_spec("Job")
    uid, gid = daemon["securityContext"]["runAsUser"], daemon["securityContext"]["runAsGroup"]
    assert uid != 0
    assert (trainer["securityContext"]["runAsUser"], trainer["securityContext"]["runAsGroup"]) == (uid, gid)
    for c in daemon["containers"] + trainer["containers"]:
        assert c.get("securityContext", {}).get("runAsUser", uid) == uid, c["name"]
    cfg, spec, c = daemon_config()
    (init,) = spec["initContainers"]
    env = env_of(init)
    assert (env["CKPTSTAGE_UID"], env["CKPTSTAGE_GID"]) == (str(uid), str(gid))
    script = " ".join(init["command"])
    assert '"$CKPTSTAGE_UID:$CKPTSTAGE_GID"' in script
    # It hands over exactly the host directories the daemon writes: the socket's and the local tier's.
    chowned = {PurePosixPath(p) for p in shlex.split(script.split("chown", 1)[1])[1:]}
    for path in (Path(cfg.socket).parent, cfg.local.dir):
        vol, mount, _ = volume(spec, c, path)
        ivol, imount, _ = volume(spec, init, path)
        assert ivol == vol and imount == mount and PurePosixPath(mount) in chowned, path
    # The folder a trainer's uid connects through is 0700: only the owner.
    assert "chmod 0700" in script


def test_grace_period_outlasts_the_drain_before_stop_and_the_shutdown() -> None:
    cfg, spec, c = daemon_config()
    # preStop: `ckptstage drain --wait --timeout S`, each job's newest step first (a node going away).
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:3] == ["ckptstage", "drain", "--wait"] and "--timeout" in command
    pre_stop = float(command[command.index("--timeout") + 1])
    # SIGTERM then: in-flight writes get shutdown_timeout_s, the newest steps drain_on_stop_s, the gRPC
    # server a 2 s grace, then exit. The grace period counts from the preStop hook's start.
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + cfg.persist.shutdown_timeout_s + \
        cfg.shared.drain_on_stop_s + 5


def test_memory_limit_holds_the_arena_budget() -> None:
    cfg, _, c = daemon_config()
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    limit = parse_size(limits["memory"].replace("Gi", "GiB").replace("Mi", "MiB"), "limits.memory")
    assert limit >= cfg.arena.max_bytes + GiB, "the arenas are charged to the daemon's container"
    assert requests["memory"] == limits["memory"], "a node must not be overcommitted on the arenas"
    assert "cpu" not in limits, "a CPU limit throttles persists; [persist] nice yields to the trainer"


def test_probes_ask_the_daemon_itself() -> None:
    _, _, c = daemon_config()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c[probe]
        assert p["exec"]["command"][:2] == ["ckptstage", "status"], probe
        assert p["timeoutSeconds"] >= 5 + 1, "the CLI waits up to 5 s for Status"
    # A daemon indexing a large local tier at start must not be killed for it.
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 300


def test_metrics_port_annotations_and_podmonitor_agree() -> None:
    cfg, spec, c = daemon_config()
    assert cfg.metrics.listen is not None and cfg.metrics.host in ("0.0.0.0", "::")
    (port,) = [p for p in c["ports"] if p["containerPort"] == cfg.metrics.port]
    ds = one("DaemonSet")
    notes = ds["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/port"] == str(cfg.metrics.port) and notes["prometheus.io/scrape"] == "true"
    pm = one("PodMonitor")["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert pm["selector"]["matchLabels"].items() <= labels.items()
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [e["port"] for e in pm["podMetricsEndpoints"]] == [port["name"]]
    # The scrape job's name is the label's value: the one the daemon-down alerts select.
    jobs = set(re.findall(r'up\{job="([^"]+)"\}', ALERTS.read_text()))
    assert jobs == {labels[pm["jobLabel"]]}


# --- the trainer --------------------------------------------------------------------------------------


def test_the_trainer_reaches_the_daemon_its_arenas_and_its_checkpoints() -> None:
    cfg, dspec, dc = daemon_config()
    tspec = pod_spec("Job")
    tc = container(tspec)
    assert env_of(tc)["CKPTSTAGE_SOCKET"] == str(cfg.socket)
    assert cfg.shared.dir is not None
    # Same host directory or claim, at the same path in both pods: the socket, /dev/shm (the arenas the
    # daemon creates are mapped by the trainer by name), and both tiers (a restore reads the part
    # directories the daemon names).
    for path in (cfg.socket, "/dev/shm/x", cfg.local.dir, cfg.shared.dir):
        dvol, dmount, _ = volume(dspec, dc, path)
        tvol, tmount, tm = volume(tspec, tc, path)
        assert source(dvol) == source(tvol) and dmount == tmount, path
    for path in (cfg.local.dir, cfg.shared.dir):
        assert volume(tspec, tc, path)[2].get("readOnly") is True, f"the trainer only reads {path}"
    assert tspec["nodeSelector"] == dspec["nodeSelector"], "a trainer must land where a daemon runs"
    for tol in dspec.get("tolerations", []):
        assert tol in tspec.get("tolerations", [])


# --- the ConfigMap's config, run ------------------------------------------------------------------------


def test_the_pods_config_and_flags_start_a_real_daemon_and_the_probe_answers(tmp_path: Path) -> None:
    """The DaemonSet's command line and ConfigMap, with every mount moved under ``tmp_path/root``."""
    cfg, spec, c = daemon_config()
    root = tmp_path / "root"
    mounts = sorted((m["mountPath"] for m in c["volumeMounts"]), key=len, reverse=True)

    def moved(path: str | Path) -> str:
        p = PurePosixPath(str(path))
        assert any(p.is_relative_to(m) for m in mounts), f"{p} is on no volume"
        return str(root / p.relative_to("/"))

    for m in mounts:
        if m != "/dev/shm":  # the one host path used as it is, as in the pod
            Path(moved(m)).mkdir(parents=True, exist_ok=True)
    config_file = Path(moved(flag(c, "config")))
    config_file.parent.mkdir(parents=True, exist_ok=True)
    toml = one("ConfigMap")["data"][config_file.name]
    assert cfg.shared.dir is not None and cfg.metrics.listen is not None
    for path in (str(cfg.socket), str(cfg.shared.dir)):
        assert toml.count(f'"{path}"') == 1
        toml = toml.replace(f'"{path}"', f'"{moved(path)}"')
    port = free_port()
    toml = toml.replace(f'"{cfg.metrics.listen}"', f'"127.0.0.1:{port}"')  # loopback only, on a free port
    config_file.write_text(toml)
    args = [a for a in c["args"] if not a.startswith("--config=")]
    args = [a.replace("$(CKPTSTAGE_NODE_NAME)", NODE) for a in args]
    args = [f"--local-dir={moved(flag(c, 'local-dir').replace('$(CKPTSTAGE_NODE_NAME)', NODE))}" if a.startswith("--local-dir=")
            else a for a in args]
    assert c["command"] == ["ckptstaged"]
    d = DaemonProcess(tmp_path / "launcher", config=config_file, args=args)
    d.start()
    try:
        assert (Path(moved(cfg.local.dir)) / ".state").is_dir()  # the per-node local tier the flag names
        assert "ckptstage_build_info" in scrape(port)
        env = {**os.environ, "CKPTSTAGE_SOCKET": moved(env_of(c)["CKPTSTAGE_SOCKET"])}
        cli = [str(Path(sys.executable).with_name("ckptstage"))]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = c[probe]["exec"]["command"]
            out = subprocess.run(cli + command[1:], env=env, capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
        assert d.stop() == 0
        # The probe fails once the daemon is gone, so the kubelet notices.
        out = subprocess.run(cli + c["livenessProbe"]["exec"]["command"][1:], env=env, capture_output=True,
                             text=True, timeout=30)
        assert out.returncode != 0
    finally:
        d.stop()


def test_the_peer_port_token_and_address_are_wired_and_the_commented_config_runs(tmp_path: Path) -> None:
    """The ConfigMap's [peers] block, uncommented as the README says, is a valid config whose token is the
    file the init container makes (owned by the training uid, 0600, from the optional Secret), on the port
    the pod declares, advertised at the pod's address."""
    cfg, spec, c = daemon_config()
    assert cfg.peers.listen is None  # off until the operator has made the Secret
    text = one("ConfigMap")["data"]["ckptstaged.toml"]
    block = text[text.index("# [peers]"):]
    enabled = "\n".join(line.strip()[2:] for line in block.splitlines() if line.strip().startswith("# "))
    token_path = PurePosixPath(re.search(r'token_file = "([^"]+)"', enabled)[1])  # type: ignore[index]
    token = tmp_path / "token"
    token.write_text("f" * 64)
    token.chmod(0o600)
    toml = tmp_path / "peers.toml"
    toml.write_text(enabled.replace(str(token_path), str(token)))
    peers = load_config(toml, {"local.dir": str(tmp_path / "local")},
                        env={"HOME": str(tmp_path), "CKPTSTAGE_PEER_ADVERTISE": "10.1.2.3:7461"}).peers
    port = split_host_port(peers.listen or "")[1]
    assert peers.address == "10.1.2.3:7461" and split_host_port(peers.address)[1] == port
    assert {p["name"]: p["containerPort"] for p in c["ports"]}["peers"] == port
    env = env_of(c)
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["CKPTSTAGE_PEER_ADVERTISE"] == f"$(POD_IP):{port}"
    # The daemon reads the token from the memory volume the init container filled from the Secret.
    vol, mount, m = volume(spec, c, token_path)
    assert source(vol)[0] == "emptyDir" and vol["emptyDir"]["medium"] == "Memory" and m.get("readOnly")
    init = next(i for i in spec["initContainers"] if i["name"] == "prepare-dirs")
    script = init["command"][-1]
    assert f"cp /etc/ckptstage-peer-secret/token {token_path}" in script and f"chmod 0600 {token_path}" in script
    secret, _, _ = volume(spec, init, "/etc/ckptstage-peer-secret/token")
    assert secret["secret"]["secretName"] == "ckptstage-peer-token" and secret["secret"]["optional"] is True
