"""Static checks of ``deploy/``: everything parses, and the pieces refer to each other
correctly (selectors, ports, config/secret keys, compose dependencies, dashboard metric
names). These are the mistakes that otherwise only show up as a pod that never gets
traffic or a dashboard panel with "no data".

Kubernetes objects are also validated against the bundled OpenAPI schemas of the
``kubernetes-validate`` package when it is installed (skipped otherwise).
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from kvbaton.services.metrics import metric_names

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.31"
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
CONNECTOR = ("kvbaton.connector.kvbaton_connector", "KvbatonConnector")


def k8s_objects() -> list[dict[str, Any]]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = []
    for res in kust["resources"]:
        out.extend(d for d in yaml.safe_load_all((K8S / res).read_text()) if d)
    return out


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def probes(container: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name in ("readinessProbe", "livenessProbe", "startupProbe"):
        if name in container:
            yield name, container[name]


def port_ok(ref: int | str, container_ports: list[dict[str, Any]]) -> bool:
    return any(ref == p.get("name") or ref == p["containerPort"] for p in container_ports)


# -- parsing ------------------------------------------------------------------------

def test_every_deploy_file_parses() -> None:
    files = [p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml", ".json")]
    assert len(files) >= 10
    for path in files:
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert [d for d in yaml.safe_load_all(path.read_text()) if d], path


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == on_disk
    names = [(o["kind"], o["metadata"]["name"]) for o in k8s_objects()]
    assert len(names) == len(set(names)), "duplicate objects"


# -- Kubernetes cross-references ------------------------------------------------------

def test_services_select_pods_and_target_their_ports() -> None:
    objs = k8s_objects()
    workloads = [o for o in objs if o["kind"] in WORKLOADS]
    for svc in by_kind(objs, "Service"):
        sel = svc["spec"]["selector"]
        matched = [w for w in workloads if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert matched, f"Service {svc['metadata']['name']} selects no pod template"
        for port in svc["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for w in matched:
                ports = [p for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
                assert port_ok(target, ports), f"Service {svc['metadata']['name']} targets {target!r}, " \
                                               f"not a port of {w['metadata']['name']}"


def test_workload_selectors_match_their_templates_and_pdbs_select_something() -> None:
    objs = k8s_objects()
    workloads = [o for o in objs if o["kind"] in WORKLOADS]
    for w in workloads:
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    for pdb in by_kind(objs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        hits = [w for w in workloads if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(hits) == 1, f"PDB {pdb['metadata']['name']} selects {len(hits)} workloads"
        assert hits[0]["spec"].get("replicas", 1) > pdb["spec"].get("minAvailable", 0), \
            f"PDB {pdb['metadata']['name']} would block every voluntary eviction"


def test_probe_ports_exist_and_control_plane_uses_grpc_probes() -> None:
    for w in [o for o in k8s_objects() if o["kind"] in WORKLOADS]:
        for c in containers(w):
            for name, probe in probes(c):
                for kind in ("grpc", "httpGet", "tcpSocket"):
                    if kind in probe:
                        assert port_ok(probe[kind]["port"], c.get("ports", [])), \
                            f"{w['metadata']['name']}/{c['name']} {name} port {probe[kind]['port']!r}"
            if w["metadata"]["labels"].get("app.kubernetes.io/component") in ("registrar", "rendezvous", "lease"):
                # The gRPC port is mutual TLS, which kubelet's gRPC probes cannot speak: the
                # services are probed on /healthz of their metrics port.
                for probe in (c["readinessProbe"], c["livenessProbe"]):
                    assert probe["httpGet"]["path"] == "/healthz" and probe["httpGet"]["port"] == "metrics"


def test_env_configmap_and_secret_references_exist() -> None:
    objs = k8s_objects()
    cms = {o["metadata"]["name"]: {**o.get("data", {})} for o in by_kind(objs, "ConfigMap")}
    secrets = {o["metadata"]["name"]: {**o.get("data", {}), **o.get("stringData", {})} for o in by_kind(objs, "Secret")}
    for w in [o for o in objs if o["kind"] in WORKLOADS]:
        where = w["metadata"]["name"]
        for c in containers(w):
            declared = {e["name"] for e in c.get("env", [])}
            for e in c.get("env", []):
                src = e.get("valueFrom", {})
                if "configMapKeyRef" in src:
                    ref = src["configMapKeyRef"]
                    assert ref["key"] in cms.get(ref["name"], {}), f"{where}: configmap {ref}"
                if "secretKeyRef" in src:
                    ref = src["secretKeyRef"]
                    assert ref["key"] in secrets.get(ref["name"], {}), f"{where}: secret {ref}"
            for ef in c.get("envFrom", []):
                if "configMapRef" in ef:
                    assert ef["configMapRef"]["name"] in cms
                if "secretRef" in ef:
                    assert ef["secretRef"]["name"] in secrets
            # $(VAR) in command/args must name a declared env var, or Kubernetes passes it literally.
            for arg in c.get("command", []) + c.get("args", []):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", str(arg)):
                    assert var in declared, f"{where}/{c['name']}: $({var}) is not in env"
        for vol in w["spec"]["template"]["spec"].get("volumes", []):
            if "configMap" in vol:
                assert vol["configMap"]["name"] in cms, f"{where}: volume {vol}"
            if "secret" in vol:
                assert vol["secret"]["secretName"] in secrets, f"{where}: volume {vol}"
        for c in containers(w):
            vols = {v["name"] for v in w["spec"]["template"]["spec"].get("volumes", [])}
            vols |= {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{where}/{c['name']}: mount {m['name']}"


def test_statefulset_etcd_is_three_members_behind_a_headless_service() -> None:
    objs = k8s_objects()
    (etcd,) = [s for s in by_kind(objs, "StatefulSet") if s["metadata"]["name"] == "etcd"]
    assert etcd["spec"]["replicas"] == 3
    svc = next(s for s in by_kind(objs, "Service") if s["metadata"]["name"] == etcd["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"
    store = next(c for c in by_kind(objs, "ConfigMap") if c["metadata"]["name"] == "kvbaton-settings")["data"]["KVBATON_STORE"]
    assert store == "etcds://" + ",".join(f"etcd-{i}.etcd:2379" for i in range(3))
    args = containers(etcd)[0]["command"]
    for flag in ("--client-cert-auth", "--peer-client-cert-auth"):
        assert flag in args
    assert all(not a.startswith(("--listen-client-urls=http:", "--listen-peer-urls=http:")) for a in args)


def test_engines_load_the_kvbaton_connector() -> None:
    engines = [w for w in by_kind(k8s_objects(), "Deployment") if w["metadata"]["labels"].get("app.kubernetes.io/name") == "vllm"]
    assert {w["metadata"]["labels"]["app.kubernetes.io/component"] for w in engines} == {"prefill", "decode"}
    for w in engines:
        args = containers(w)[0]["args"]
        cfg = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert (cfg["kv_connector_module_path"], cfg["kv_connector"]) == CONNECTOR
        assert cfg["kv_connector_extra_config"]["control_plane"]


def test_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate for schema checks")
    for obj in k8s_objects():
        try:
            kv.validate(obj, K8S_VERSION, strict=True)
        except kv.ValidationError as exc:
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}") from None


# -- compose -------------------------------------------------------------------------

def test_compose_services_and_dependencies() -> None:
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        for dep in deps if isinstance(deps, list) else deps.keys():
            assert dep in services, f"{name} depends on unknown {dep}"
            if not isinstance(deps, list) and deps[dep].get("condition") == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy; it has no healthcheck"
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / "compose" / src).resolve().exists(), f"{name}: {src}"
            else:
                assert src in compose.get("volumes", {}), f"{name}: volume {src}"
    for role in ("registrar", "rendezvous", "lease"):
        cmd = services[role]["command"]
        assert cmd[:2] == ["serve", role] and "etcds://etcd:2379" in cmd
        assert {"--tls-cert", "--tls-client-ca", "--tokens", "--etcd-cert"} <= set(cmd)
    for role in ("prefill", "decode"):
        cmd = services[role]["command"]
        cfg = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
        assert (cfg["kv_connector_module_path"], cfg["kv_connector"]) == CONNECTOR
        host = cfg["kv_connector_extra_config"]["control_plane"].split(":")[0]
        assert host in services
    assert services["router"]["depends_on"].keys() >= {"prefill", "decode"}


def test_dockerfile_targets_exist() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", text, re.M))
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    used = {s["build"]["target"] for s in [compose.get("x-control-plane", {}), compose.get("x-engine", {})] if "build" in s}
    assert used and used <= targets
    for src in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / src).exists(), src


# -- Grafana -------------------------------------------------------------------------

def _exprs(dash: dict[str, Any]) -> Iterator[str]:
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            yield target["expr"]
    for var in dash.get("templating", {}).get("list", []):
        if isinstance(var.get("query"), str):
            yield var["query"]


def test_grafana_queries_use_only_defined_metrics() -> None:
    dash = json.loads((DEPLOY / "grafana" / "kvbaton.json").read_text())
    known = metric_names()
    used: set[str] = set()
    for expr in _exprs(dash):
        for name in re.findall(r"\bkvbaton_[a-z0-9_]+", expr):
            assert name in known, f"dashboard uses undefined metric {name} in {expr}"
            used.add(name)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    # Every control-plane metric family is on the dashboard somewhere.
    families = {n for n in known if not n.endswith("_created")}
    for core in ("kvbaton_rendezvous_matches_total", "kvbaton_rendezvous_match_wait_seconds_bucket",
                 "kvbaton_rendezvous_match_to_outcome_seconds_bucket", "kvbaton_rendezvous_expired_total",
                 "kvbaton_transfers_total", "kvbaton_transfer_bytes_total", "kvbaton_leases",
                 "kvbaton_lease_renewals_total", "kvbaton_lease_renewal_writes_total", "kvbaton_lease_pins_total",
                 "kvbaton_lease_ends_total", "kvbaton_retained_blocks", "kvbaton_store_operation_seconds_bucket",
                 "kvbaton_engines", "kvbaton_engine_registrations_total"):
        assert core in families and core in used, core


# -- security (issue 16) ------------------------------------------------------------

def test_no_plaintext_anywhere_in_deploy() -> None:
    """No --insecure, every control-plane client with TLS and a token, engine ids fixed
    (tokens are scoped to them; the router binds push transfers to them)."""
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".json", ".sh", "") and path.name != "Dockerfile":
            assert "--insecure" not in path.read_text(errors="replace"), path
    objs = k8s_objects()
    for w in by_kind(objs, "Deployment"):
        for c in containers(w):
            text = json.dumps(c.get("args", []) + c.get("command", []))
            comp = w["metadata"]["labels"].get("app.kubernetes.io/component")
            if comp in ("registrar", "rendezvous", "lease"):
                assert "--tls-client-ca" in text and "--tokens" in text, comp
            if comp == "router":
                assert all(f in text for f in ("--control-plane", "--tls-ca", "--tls-cert", "--token-file",
                                               "--prefill-engine-id", "--decode-engine-id")), text
            if w["metadata"]["labels"].get("app.kubernetes.io/name") == "vllm":
                args = c["args"]
                extra = json.loads(args[args.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
                assert {"control_tls_ca", "control_tls_cert", "control_tls_key", "control_token_file"} <= extra.keys()
                assert "POD_NAME" not in extra["engine_id"]
    envoy = yaml.safe_load(next(o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"] == "kvbaton-envoy")
                           ["data"]["envoy.yaml"])
    for res in (envoy, yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())):
        chain = res["static_resources"]["listeners"][0]["filter_chains"][0]
        assert chain["transport_socket"]["typed_config"]["require_client_certificate"] is True
        assert all("transport_socket" in cl for cl in res["static_resources"]["clusters"])


def test_network_policy_denies_by_default_and_guards_etcd() -> None:
    policies = {o["metadata"]["name"]: o for o in by_kind(k8s_objects(), "NetworkPolicy")}
    assert policies["default-deny-ingress"]["spec"]["podSelector"] == {}
    etcd_rules = policies["etcd"]["spec"]["ingress"]
    client = next(r for r in etcd_rules if r["ports"][0]["port"] == 2379)
    assert client["from"][0]["podSelector"]["matchExpressions"][0]["values"] == ["registrar", "rendezvous", "lease"]


def test_make_certs_script_makes_a_working_pki(tmp_path) -> None:
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    out = tmp_path / "pki"
    subprocess.run(["bash", str(DEPLOY / "make-certs.sh"), str(out), "kvbaton"], check=True, timeout=120,
                   capture_output=True)
    for name in ("control-plane", "gateway", "etcd", "etcd-client", "prefill-0", "decode-0", "router", "operator"):
        subprocess.run(["openssl", "verify", "-CAfile", str(out / "ca.crt"), str(out / f"{name}.crt")], check=True,
                       capture_output=True, timeout=30)
    from kvbaton.services.auth import TokenBook

    book = TokenBook.load(out / "tokens.json")
    dec = book.lookup((out / "decode-0.token").read_text().strip())
    assert dec is not None and dec.role == "engine" and dec.engines == {"decode-0"}
    secrets = {o["metadata"]["name"]: o for o in yaml.safe_load_all((out / "secrets.yaml").read_text()) if o}
    base = {o["metadata"]["name"]: o for o in by_kind(k8s_objects(), "Secret")}
    for name, sec in secrets.items():  # the generated Secrets carry every key the manifests mount
        assert set(base[name]["stringData"]) <= set(sec["data"]), name
