"""deploy/k8s and deploy/slurm: every manifest passes Kubernetes' own API schemas, and the parts
refer to each other correctly.

Schemas: `kubernetes-validate` (a dev dependency; it ships the OpenAPI schemas of each Kubernetes
release and validates offline) checks every document against K8S_VERSIONS in strict mode, where a
field the schema does not name is an error; a misspelled field (`contianers`) fails it. On top,
cross-references the schemas cannot see: every Secret, ConfigMap, Service, claim, port and image
that one object names exists in another with the same spelling. The SLURM script must pass
`bash -n` (tests/deploy/test_slurm.py runs it under real SLURM daemons).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
NAMESPACE = "elastic"


def _docs() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


DOCS = _docs()


def _one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for d in DOCS
            if d["kind"] in ("Job", "StatefulSet")]


def _containers() -> list[tuple[str, dict[str, Any]]]:
    return [(owner, c) for owner, spec in _pod_specs() for c in spec["containers"]]


def _script(container: dict[str, Any]) -> str:
    return " ".join([*container.get("command", []), *container.get("args", [])])


def test_every_document_is_a_named_kubernetes_object() -> None:
    assert {p.name for p in K8S.glob("*.yaml")} >= {
        "etcd.yaml",
        "train.yaml",
        "controller.yaml",
        "secret.yaml",
    }
    for doc in DOCS:
        assert {"apiVersion", "kind", "metadata"} <= doc.keys(), doc
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"])
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]
    assert _one("Namespace", NAMESPACE)


def test_etcd_statefulset_service_and_cluster_agree() -> None:
    sts = _one("StatefulSet", "etcd")
    headless = _one("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert headless["spec"]["selector"].items() <= labels.items()
    container = sts["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (
        {p["name"]: p["port"] for p in headless["spec"]["ports"]} == ports == {"client": 2379, "peer": 2380}
    )
    # --initial-cluster names exactly the replicas, at their stable DNS names on the peer port.
    flag = next(a for a in container["command"] if a.startswith("--initial-cluster="))
    members = dict(m.split("=", 1) for m in flag.split("=", 1)[1].split(","))
    replicas = sts["spec"]["replicas"]
    assert replicas in (1, 3)
    assert members == {
        f"etcd-{i}": f"http://etcd-{i}.{headless['metadata']['name']}.{NAMESPACE}.svc:{ports['peer']}"
        for i in range(replicas)
    }
    claim = sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert claim in {m["name"] for m in container["volumeMounts"]}


def test_job_config_secret_and_etcd_endpoint_exist() -> None:
    config = _one("ConfigMap", "elastic-job")["data"]
    host, port = config["ETCD_ENDPOINT"].rsplit(":", 1)
    service, namespace = host.split(".")[:2]
    client = _one("Service", service)
    assert namespace == NAMESPACE
    assert int(port) in {p["port"] for p in client["spec"]["ports"]}
    assert (
        client["spec"]["selector"].items()
        <= _one("StatefulSet", "etcd")["spec"]["selector"]["matchLabels"].items()
    )
    for owner, container in _containers():
        for ref in container.get("envFrom", []):
            _one("ConfigMap", ref["configMapRef"]["name"])
        for env in container.get("env", []):
            source = env.get("valueFrom", {})
            if "secretKeyRef" in source:
                secret = _one("Secret", source["secretKeyRef"]["name"])
                assert source["secretKeyRef"]["key"] in secret.get("stringData", secret.get("data", {})), (
                    owner
                )
            if "configMapKeyRef" in source:
                cm = _one("ConfigMap", source["configMapKeyRef"]["name"])
                assert source["configMapKeyRef"]["key"] in cm["data"], owner
        # Every $VAR a shell command line uses is defined for that container.
        defined = {e["name"] for e in container.get("env", [])}
        for ref in container.get("envFrom", []):
            defined |= set(_one("ConfigMap", ref["configMapRef"]["name"])["data"])
        if container.get("command", [])[:2] == ["/bin/sh", "-c"]:
            used = set(re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", _script(container)))
            assert used <= defined, f"{owner}: {sorted(used - defined)} undefined"


def test_training_job_one_pod_per_node_with_the_rendezvous() -> None:
    config = _one("ConfigMap", "elastic-job")["data"]
    train = _one("Job", "elastic-train")
    spec = train["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(config["NODES"])
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] in ("OnFailure", "Never")
    nodes_service = _one("Service", pod["subdomain"])
    assert nodes_service["spec"]["clusterIP"] == "None"
    assert nodes_service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (node,) = pod["containers"]
    script = _script(node)
    assert "torchrun" in script and "--rdzv-backend=elastic-etcd" in script
    assert '--rdzv-endpoint="$ETCD_ENDPOINT"' in script and '--rdzv-id="$ELASTIC_JOB"' in script
    assert "-m elastic.roles.agent" in script
    assert "node_id=node$NODE_INDEX" in script
    env = {e["name"]: e for e in node["env"]}
    assert env["ELASTIC_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["GLOO_SOCKET_IFNAME"]["value"] == "eth0"
    assert "job-completion-index" in env["NODE_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert node["resources"]["requests"]["cpu"] and node["resources"]["requests"]["memory"]
    assert int(node["resources"]["limits"]["nvidia.com/gpu"]) == int(config["GPUS_PER_NODE"])
    # Liveness probes the metrics port, which the agent is told to serve on.
    probe_port = node["livenessProbe"]["httpGet"]["port"]
    ports = {p["name"]: p["containerPort"] for p in node["ports"]}
    assert ports[probe_port] == int(env["ELASTIC_METRICS_PORT"]["value"])
    assert {p["name"]: p["port"] for p in nodes_service["spec"]["ports"]}[probe_port] == ports[probe_port]


def test_controller_publishes_the_same_job_and_volumes_exist() -> None:
    controller = _one("Job", "elastic-controller")
    pod = controller["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    script = _script(pod["containers"][0])
    assert "elastic run --agents external" in script
    assert '--job "$ELASTIC_JOB"' in script and '--etcd "$ETCD_ENDPOINT"' in script
    for _, spec in _pod_specs():
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                _one("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
        mounts = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in spec.get("volumes", [])} | {"data"}


def test_project_image_is_the_same_everywhere() -> None:
    images = {c["image"] for owner, c in _containers() if owner != "etcd"}
    assert len(images) == 1, images
    (image,) = images
    assert image in (DEPLOY / "Dockerfile").read_text()


def test_sbatch_script_parses_and_uses_the_rendezvous() -> None:
    script = DEPLOY / "slurm" / "elastic.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    assert "--rdzv-backend=elastic-etcd" in text and "srun" in text and "-m elastic.roles.agent" in text
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", text, re.M)


def test_every_etcd_compacts_its_history_as_the_embedded_one_does() -> None:
    from elastic.coordinator.etcd_server import AUTO_COMPACTION

    mode, retention = AUTO_COMPACTION
    command = _one("StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"][0]["command"]
    assert f"--auto-compaction-mode={mode}" in command and f"--auto-compaction-retention={retention}" in command
    sbatch = (DEPLOY / "slurm" / "elastic.sbatch").read_text()
    assert f"--auto-compaction-mode {mode} --auto-compaction-retention {retention}" in sbatch
    assert f"--auto-compaction-mode={mode} --auto-compaction-retention={retention}" in (DEPLOY / "README.md").read_text()


def test_preemption_grace_periods_nest() -> None:
    """SIGTERM becomes a drain (elastic/roles/agent.py): the agent's grace must end before
    torchrun's wait for it, and that before the pod's (or SLURM's) SIGKILL."""
    from elastic.roles.agent_preemption import PREEMPT_GRACE_ENV, PREEMPT_GRACE_S

    pod = _one("Job", "elastic-train")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    grace, shutdown = float(env[PREEMPT_GRACE_ENV]), float(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    assert 0 < grace < shutdown < pod["terminationGracePeriodSeconds"], (grace, shutdown, pod)
    assert PREEMPT_GRACE_S < 30, "the default must fit Kubernetes' default grace period"
    sbatch = (DEPLOY / "slurm" / "elastic.sbatch").read_text()
    signal = re.search(r"^#SBATCH --signal=TERM@(\d+)$", sbatch, re.M)
    assert signal, "the batch script asks for SIGTERM before the time limit"
    defaults = {name: float(value) for name, value in re.findall(r"^export (\w+)=\$\{\1:-([\d.]+)\}$", sbatch, re.M)}
    slurm_grace, slurm_shutdown = defaults[PREEMPT_GRACE_ENV], defaults["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    kill_wait = 30.0  # SLURM's default KillWait between SIGTERM and SIGKILL
    assert 0 < slurm_grace < slurm_shutdown < min(kill_wait, float(signal.group(1))), defaults


K8S_VERSIONS = ("1.35.0", "1.36.0", "1.37.0")
"""Kubernetes releases whose schemas every manifest must pass (deploy/k8s/README.md names them)."""


def _schema_check(doc: dict[str, Any], version: str) -> None:
    """Validate `doc` against Kubernetes `version`'s schema, strict (unknown fields refused);
    kubernetes_validate.ValidationError if it does not pass."""
    used = kubernetes_validate.validate(doc, version, strict=True)
    assert used == version.rsplit(".", 1)[0], f"validated against {used}, not the schemas of {version}"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_passes_the_kubernetes_schemas_strictly(version: str) -> None:
    for doc in DOCS:
        try:
            _schema_check(doc, version)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} fails Kubernetes {version}: {exc}")


def _train_pod_spec_with(edit: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A copy of the training Job with `edit` applied to its pod spec."""
    job = copy.deepcopy(_one("Job", "elastic-train"))
    edit(job["spec"]["template"]["spec"])
    return job


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_a_misspelled_field_fails_the_schema_check(version: str) -> None:
    def misspell(spec: dict[str, Any]) -> None:
        spec["contianers"] = spec.pop("containers")

    def add_misspelled(spec: dict[str, Any]) -> None:
        spec["contianers"] = spec["containers"]  # `containers` still there: only strict mode sees it

    with pytest.raises(kubernetes_validate.ValidationError, match="containers"):
        _schema_check(_train_pod_spec_with(misspell), version)
    with pytest.raises(kubernetes_validate.ValidationError, match="'contianers' was unexpected"):
        _schema_check(_train_pod_spec_with(add_misspelled), version)


def test_the_validator_command_passes_the_manifests_and_fails_a_misspelled_one(tmp_path: Path) -> None:
    """`kubernetes-validate --strict` by hand (deploy/k8s/README.md): exit 0 on the manifests,
    non-zero on train.yaml with `containers` misspelled."""
    cmd = [str(Path(sys.executable).with_name("kubernetes-validate")), "--strict", "--quiet",
           "-k", K8S_VERSIONS[-1]]
    subprocess.run([*cmd, *map(str, sorted(K8S.glob("*.yaml")))], check=True, timeout=60)
    bad = tmp_path / "train.yaml"
    bad.write_text((K8S / "train.yaml").read_text().replace("containers:", "contianers:"))
    failed = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, timeout=60, check=False)
    assert failed.returncode != 0 and "'containers' is a required property" in failed.stdout, failed


def _secret_keys(name: str) -> set[str]:
    secret = _one("Secret", name)
    return set(secret.get("stringData", secret.get("data", {})))


def _secret_file(spec: dict[str, Any], container: dict[str, Any], path: str) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in `container`: a read-only mount of a Secret
    volume holds it under its key (AssertionError naming the path otherwise)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        directory = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(directory) and "secret" in volumes.get(mount["name"], {}):
            assert mount.get("readOnly") is True, f"{path}: mount {mount['name']} must be read-only"
            secret, key = volumes[mount["name"]]["secret"]["secretName"], path[len(directory):]
            assert key in _secret_keys(secret), f"{path}: Secret {secret} has no key {key}"
            return secret, key
    raise AssertionError(f"{path} is not in a mounted Secret of container {container['name']}")


def test_tls_settings_are_consistent() -> None:
    """etcd serves client TLS from a mounted Secret; every pod that talks to it has the
    ELASTIC_ETCD_* files in a mounted Secret at the paths its env names, the user and password
    from a Secret (never a literal, never on a command line), and one CA for both sides."""
    from elastic.coordinator.credentials import (
        ETCD_CA_ENV,
        ETCD_CERT_ENV,
        ETCD_KEY_ENV,
        ETCD_PASSWORD_ENV,
        ETCD_USER_ENV,
    )

    sts = _one("StatefulSet", "etcd")
    spec = sts["spec"]["template"]["spec"]
    etcd = spec["containers"][0]
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in etcd["command"][1:])
    assert "--client-cert-auth" in flags
    assert flags["--listen-client-urls"].startswith("https://") and flags["--advertise-client-urls"].startswith("https://")
    server = {f: _secret_file(spec, etcd, flags[f]) for f in ("--trusted-ca-file", "--cert-file", "--key-file")}
    for probe in ("readinessProbe", "livenessProbe"):  # a probe has no client certificate: the metrics listener
        port = etcd[probe]["httpGet"]["port"]
        assert flags["--listen-metrics-urls"].startswith("http://") and flags["--listen-metrics-urls"].endswith(f":{port}")
    clients = [(o, c) for o, c in _containers() if o in ("elastic-train", "elastic-controller")]
    assert len(clients) == 2
    for owner, container in clients:
        pod = next(s for name, s in _pod_specs() if name == owner)
        env = {e["name"]: e for e in container["env"]}
        files = {var: _secret_file(pod, container, env[var]["value"]) for var in (ETCD_CA_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV)}
        assert files[ETCD_CA_ENV][1] == server["--trusted-ca-file"][1] == "ca.crt", (owner, files, server)
        assert len({secret for secret, _ in files.values()}) == 1, files  # one Secret: certificate, key and CA
        for var in (ETCD_USER_ENV, ETCD_PASSWORD_ENV):
            ref = env[var]["valueFrom"]["secretKeyRef"]
            assert ref["key"] in _secret_keys(ref["name"]), (owner, var)
        assert "PASSWORD" not in _script(container), owner
    train = next(c for o, c in clients if o == "elastic-train")
    assert {e["name"]: e.get("value") for e in train["env"]}["ELASTIC_TLS_SERVER_NAME"], \
        "shard servers are checked against one shared name"


def test_sbatch_tls_settings_are_consistent() -> None:
    """With TLS_DIR the script's etcd serves client TLS from the files the clients' env names."""
    text = (DEPLOY / "slurm" / "elastic.sbatch").read_text()
    exported = dict(re.findall(r"^\s*export (ELASTIC_ETCD_(?:CA|CERT|KEY))=(\S+)$", text, re.M))
    assert exported == {"ELASTIC_ETCD_CA": '"$TLS_DIR/ca.crt"', "ELASTIC_ETCD_CERT": '"$TLS_DIR/node.crt"',
                        "ELASTIC_ETCD_KEY": '"$TLS_DIR/node.key"'}, exported
    assert '--trusted-ca-file "$TLS_DIR/ca.crt"' in text and "--client-cert-auth" in text
    assert '--cert-file "$TLS_DIR/etcd-server.crt" --key-file "$TLS_DIR/etcd-server.key"' in text
    assert "ELASTIC_ETCD_PASSWORD=" not in text.replace("${ELASTIC_ETCD_PASSWORD", ""), "a password is never set in the script"
