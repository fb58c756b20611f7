"""The Kubernetes manifests of deploy/k8s/, checked against the real schemas.

- Every YAML document of ``deploy/k8s/*.yaml`` and ``deploy/k8s/secrets/*.yaml`` is parsed,
  and each must be a Kubernetes object of a known kind.
- Custom resources (``RayService``, ``ServiceMonitor``) are validated against the
  ``openAPIV3Schema`` of the served version of their CRD, as released upstream and kept in
  ``deploy/k8s/schemas/`` (KubeRay v1.7.0, prometheus-operator v0.93.0), with the
  ``jsonschema`` package. The API server drops or refuses fields that a structural schema
  does not declare (``kubectl``'s strict field validation refuses them), where plain JSON
  Schema would accept them: ``strict_schema`` closes every object that declares its
  properties, so an unknown or misspelt field fails here as it fails on a cluster. CEL rules
  (``x-kubernetes-validations``) are not evaluated; ``cel_paths`` makes sure the manifests
  set no field that carries one.
- The core objects are checked for the fields that matter (selectors against pod labels,
  ports against container ports, Redis without persistence and with AUTH), and the pod
  template of the Redis Deployment and every Service against the core/v1 schemas that the
  RayService CRD embeds (``PodTemplateSpec``, ``Service``).
- The embedded ``serveConfigV2`` is parsed by Ray Serve's own ``ServeDeploySchema``, and its
  application's ``args`` are built into ``router.config.Settings`` as ``router.app.build_app``
  builds them (``Settings.given_twice`` against the environment the Ray pods get, then
  ``Settings(**args)``).
- Each check is also run on a broken copy, which it must refuse.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = K8S / "schemas"
CRDS = {  # (apiVersion, kind) -> the CRD that defines it
    ("ray.io/v1", "RayService"): SCHEMAS / "kuberay" / "ray.io_rayservices.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"):
        SCHEMAS / "prometheus-operator" / "monitoring.coreos.com_servicemonitors.yaml",
}
CORE_KINDS = {("v1", "Service"), ("v1", "Secret"), ("apps/v1", "Deployment"),
              ("networking.k8s.io/v1", "NetworkPolicy")}
DNS_1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# --- loading --------------------------------------------------------------------------------

def manifest_files() -> list[Path]:
    """The manifest files: ``deploy/k8s/*.yaml`` and the placeholder Secrets."""
    return sorted(K8S.glob("*.yaml")) + sorted((K8S / "secrets").glob("*.yaml"))


def load_documents() -> list[dict]:
    """Every non-empty YAML document of ``manifest_files()``, in file order."""
    docs = []
    for path in manifest_files():
        docs.extend(d for d in yaml.load_all(path.read_text(), Loader=Loader) if d is not None)
    return docs


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    """The one document of ``kind`` (and ``name``, when given)."""
    found = [d for d in docs if d["kind"] == kind
             and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} documents of kind {kind} named {name}"
    return found[0]


@pytest.fixture
def docs() -> list[dict]:
    """A fresh copy of every manifest document (tests may break theirs)."""
    return load_documents()


# --- CRD schemas ----------------------------------------------------------------------------

@lru_cache(maxsize=None)
def crd_schema(path: Path, version: str) -> dict:
    """The ``openAPIV3Schema`` of ``version`` of the CRD in ``path`` (which must serve it)."""
    crd = yaml.load(path.read_text(), Loader=Loader)
    assert crd["kind"] == "CustomResourceDefinition"
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            assert v["served"], f"{path.name}: version {version} is not served"
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"{path.name} defines no version {version}")


def strict_schema(schema: Any) -> Any:
    """A Kubernetes structural schema as JSON Schema (draft 4), as the API server applies it
    with strict field validation: an object that declares ``properties`` (and neither
    ``additionalProperties`` nor ``x-kubernetes-preserve-unknown-fields``) takes no other
    field; ``nullable`` admits null; ``x-kubernetes-int-or-string`` admits an integer or a
    string."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    if out.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out and "type" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


@lru_cache(maxsize=None)
def validator_for(path: Path, version: str) -> jsonschema.Draft4Validator:
    """A validator of ``strict_schema`` of the CRD's schema (checked as a draft-4 schema)."""
    schema = strict_schema(crd_schema(path, version))
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def object_meta_errors(doc: dict) -> list[str]:
    """What the API server would refuse in ``metadata`` (a CRD's schema leaves it open)."""
    meta = doc.get("metadata") or {}
    errors = [f"metadata.{k}: not set by these manifests"
              for k in meta if k not in ("name", "labels", "annotations")]
    if not DNS_1123_SUBDOMAIN.match(str(meta.get("name", ""))) or len(meta["name"]) > 63:
        errors.append(f"metadata.name {meta.get('name')!r} is no DNS-1123 name")
    for k, v in {**meta.get("labels", {}), **meta.get("annotations", {})}.items():
        if not isinstance(v, str):
            errors.append(f"metadata: the value of {k} is not a string")
    return errors


def schema_errors(doc: dict) -> list[str]:
    """The errors of a custom resource against its CRD's schema, one line each."""
    group_version, kind = doc.get("apiVersion", ""), doc.get("kind", "")
    path = CRDS[(group_version, kind)]
    validator = validator_for(path, group_version.split("/")[-1])
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in validator.iter_errors(doc)]
    return sorted(errors) + object_meta_errors(doc)


def cel_paths(schema: dict, value: Any, path: str = "") -> Iterator[str]:
    """The fields of ``value`` whose schema carries CEL rules (``x-kubernetes-validations``),
    which ``jsonschema`` cannot evaluate."""
    if "x-kubernetes-validations" in schema:
        yield path or "<root>"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k, extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from cel_paths(sub, v, f"{path}.{k}" if path else k)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            yield from cel_paths(schema["items"], v, f"{path}[{i}]")


def embedded_core_schema(*keys: str) -> jsonschema.Draft4Validator:
    """A validator of a core/v1 type as KubeRay's RayService CRD embeds it, by its path of
    property names in that CRD (``PodTemplateSpec``: the head group's ``template``;
    ``Service``: ``serveService``)."""
    schema = crd_schema(CRDS[("ray.io/v1", "RayService")], "v1")
    for k in keys:
        schema = schema["properties"][k]
    return jsonschema.Draft4Validator(strict_schema(schema))


POD_TEMPLATE_KEYS = ("spec", "rayClusterConfig", "headGroupSpec", "template")
SERVICE_KEYS = ("spec", "serveService")


def core_errors(validator: jsonschema.Draft4Validator, value: Any) -> list[str]:
    """``value``'s errors against an embedded core/v1 schema, one line each."""
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(value))


# --- the pieces of the manifests ------------------------------------------------------------

def serve_config(rayservice: dict) -> dict:
    """The RayService's ``serveConfigV2``, parsed."""
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def app_args(rayservice: dict) -> dict:
    """The ``args`` of the prefix-router application of the RayService's Serve config."""
    (app,) = [a for a in serve_config(rayservice)["applications"]
              if a["import_path"] == "router.app:build_app"]
    return app["args"]


def ray_pod_specs(rayservice: dict) -> dict[str, dict]:
    """The pod templates of the Ray pods: ``head`` and each worker group by its name."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in cluster.get("workerGroupSpecs", [])})
    return out


def ray_container(template: dict) -> dict:
    """The Ray container of a pod template (KubeRay runs Ray in the first one)."""
    return template["spec"]["containers"][0]


def secret_values(docs: list[dict]) -> dict[tuple[str, str], str]:
    """Every ``(secret name, key) -> value`` of the placeholder Secrets."""
    out = {}
    for s in (d for d in docs if d["kind"] == "Secret"):
        for k, v in (s.get("stringData") or {}).items():
            out[(s["metadata"]["name"], k)] = v
    return out


def container_env(container: dict, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """A container's environment as Kubernetes makes it: Secret references read (from the
    placeholders), and ``$(NAME)`` expanded from the variables defined before it only
    (a reference to a later or unknown one stays as it is, as on a cluster)."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "valueFrom" in e:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                    lambda m: env.get(m.group(1), m.group(0)), e["value"])
    return env


def secret_refs(value: Any) -> Iterator[tuple[str, str]]:
    """Every ``(secret, key)`` a document refers to: ``secretKeyRef``s, Secret volumes'
    items, and a ServiceMonitor's ``credentials``."""
    if isinstance(value, dict):
        if "secretKeyRef" in value:
            yield value["secretKeyRef"]["name"], value["secretKeyRef"]["key"]
        if "credentials" in value and isinstance(value["credentials"], dict):
            yield value["credentials"]["name"], value["credentials"]["key"]
        if "secret" in value and "secretName" in value["secret"]:
            for item in value["secret"].get("items", []):
                yield value["secret"]["secretName"], item["key"]
        for v in value.values():
            yield from secret_refs(v)
    elif isinstance(value, list):
        for v in value:
            yield from secret_refs(v)


def selects(selector: dict, labels: dict) -> bool:
    """Whether a ``matchLabels``-style selector (a plain label map) selects ``labels``."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def flag_value(args: list[str], flag: str) -> str | None:
    """The value after ``flag`` in a command line, or None without the flag."""
    return args[args.index(flag) + 1] if flag in args else None


def redis_problems(docs: list[dict]) -> list[str]:
    """What is wrong with the Redis Deployment and its Service: persistence must be off, the
    server must require a login (an ACL file from a Secret, or requirepass), and the Service
    must reach the container's port."""
    problems = []
    dep = find(docs, "Deployment", "prefix-router-redis")
    svc = find(docs, "Service", "prefix-router-redis")
    pod = dep["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    args = [*c.get("command", []), *c.get("args", [])]
    if flag_value(args, "--save") != "":
        problems.append('persistence: no --save ""')
    if flag_value(args, "--appendonly") != "no":
        problems.append("persistence: no --appendonly no")
    volumes = pod["spec"].get("volumes", [])
    if any("persistentVolumeClaim" in v or "hostPath" in v for v in volumes):
        problems.append("persistence: a persistent volume")
    acl = flag_value(args, "--aclfile")
    if acl is None and "--requirepass" not in args:
        problems.append("auth: neither --aclfile nor --requirepass")
    if acl is not None:
        mounts = {m["mountPath"].rstrip("/"): m["name"] for m in c.get("volumeMounts", [])}
        volume = {v["name"]: v for v in volumes}.get(mounts.get(str(Path(acl).parent), ""), {})
        items = {i["path"]: i["key"] for i in volume.get("secret", {}).get("items", [])}
        if Path(acl).name not in items:
            problems.append(f"auth: {acl} is not a key of a mounted Secret")
    if dep["spec"].get("replicas", 1) != 1:
        problems.append("more than one Redis server: each would hold its own index")
    if not selects(dep["spec"]["selector"]["matchLabels"], pod["metadata"]["labels"]):
        problems.append("the Deployment's selector does not select its pods")
    if not selects(svc["spec"]["selector"], pod["metadata"]["labels"]):
        problems.append("the Service does not select the Redis pods")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for p in svc["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        if target not in ports and target not in ports.values():
            problems.append(f"the Service's port {p['port']} targets no container port")
    return problems


# --- parsing --------------------------------------------------------------------------------

def test_every_manifest_document_parses_as_a_kubernetes_object_of_a_known_kind():
    files = manifest_files()
    assert {p.name for p in files} >= {"rayservice.yaml", "redis.yaml", "monitoring.yaml",
                                       "placeholders.yaml"}
    kinds = []
    for path in files:
        for doc in yaml.load_all(path.read_text(), Loader=Loader):
            if doc is None:
                continue
            assert isinstance(doc, dict), path
            key = (doc.get("apiVersion"), doc.get("kind"))
            assert key in CRDS or key in CORE_KINDS, f"{path.name}: unknown {key}"
            assert object_meta_errors(doc) == [], (path.name, object_meta_errors(doc))
            kinds.append(key[1])
    assert sorted(kinds) == sorted(["RayService", "Deployment", "Service", "NetworkPolicy",
                                    "Service", "ServiceMonitor", "Secret", "Secret", "Secret"])


# git's blob ids of the files at the upstream tags (``git rev-parse v1.7.0:<path>``)
UPSTREAM_BLOBS = {
    "kuberay/ray.io_rayservices.yaml": "7ee63d6ddd11237a5649e04b3a8db3c52074c867",
    "kuberay/LICENSE": "1dcfa84a3fb6aae76a0fb0890ba330d3296c913d",
    "prometheus-operator/monitoring.coreos.com_servicemonitors.yaml":
        "f5736255990a0e152851fadb55f84d6fd0f91d87",
    "prometheus-operator/LICENSE": "74e6ec6963979ae506d5a6b1d59adb7f3bdaf045",
    "prometheus-operator/NOTICE": "e520005cdda30b725b5534ce120ee905fd40b55a",
}


def git_blob_id(data: bytes) -> str:
    """The id git gives a file of these bytes (SHA-1 of ``blob <size>\\0`` and the bytes)."""
    import hashlib
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_schemas_are_the_upstream_files_with_their_licences():
    found = {str(p.relative_to(SCHEMAS)): git_blob_id(p.read_bytes())
             for p in SCHEMAS.rglob("*") if p.is_file()}
    assert found == UPSTREAM_BLOBS
    for crd in CRDS.values():
        assert (crd.parent / "LICENSE").read_text().lstrip().startswith("Apache License")
    readme = (K8S / "README.md").read_text()
    assert "v1.7.0" in readme and "v0.93.0" in readme


# --- custom resources against their CRDs ----------------------------------------------------

def test_custom_resources_are_valid_against_their_crds(docs):
    checked = 0
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in CRDS:
            assert schema_errors(doc) == [], doc["metadata"]["name"]
            schema = crd_schema(CRDS[key], key[0].split("/")[-1])
            assert list(cel_paths(schema, doc)) == [], "fields with CEL rules, not checked here"
            checked += 1
    assert checked == 2


def _drop_group_name(rs: dict) -> None:
    del rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]


def _unknown_worker_field(rs: dict) -> None:
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["gpusPerReplica"] = 1


def _numeric_ray_start_param(rs: dict) -> None:
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 4


def _misspelt_container_field(rs: dict) -> None:
    ray_container(ray_pod_specs(rs)["head"])["volumeMount"] = []


def _unknown_top_level_field(rs: dict) -> None:
    rs["spec"]["serveConfig"] = rs["spec"]["serveConfigV2"]


def _quantity_of_wrong_type(rs: dict) -> None:
    ray_container(ray_pod_specs(rs)["gpu-workers"])["resources"]["limits"]["memory"] = [64]


@pytest.mark.parametrize("breaks, expected", [
    (_drop_group_name, "'groupName' is a required property"),
    (_unknown_worker_field, "'gpusPerReplica' was unexpected"),
    (_numeric_ray_start_param, "4 is not of type 'string'"),
    (_misspelt_container_field, "'volumeMount' was unexpected"),
    (_unknown_top_level_field, "'serveConfig' was unexpected"),
    (_quantity_of_wrong_type, "is not valid under any of the given schemas"),
])
def test_a_broken_rayservice_is_refused(docs, breaks, expected):
    rs = find(docs, "RayService")
    breaks(rs)
    errors = schema_errors(rs)
    assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("breaks, expected", [
    (lambda sm: sm["spec"]["endpoints"][0]["authorization"]["credentials"].pop("key"),
     "'key' is a required property"),
    (lambda sm: sm["spec"]["endpoints"][0].update(bearerToken="x"),
     "'bearerToken' was unexpected"),
    (lambda sm: sm["spec"]["endpoints"][0].update(scheme="tcp"), "'tcp' is not one of"),
    (lambda sm: sm["metadata"].update(name="Prefix_Router"), "no DNS-1123 name"),
])
def test_a_broken_servicemonitor_is_refused(docs, breaks, expected):
    sm = find(docs, "ServiceMonitor")
    breaks(sm)
    errors = schema_errors(sm)
    assert any(expected in e for e in errors), errors


def test_core_objects_are_valid_against_the_core_schemas_kuberay_embeds(docs):
    pod_template = embedded_core_schema(*POD_TEMPLATE_KEYS)
    service = embedded_core_schema(*SERVICE_KEYS)
    dep = find(docs, "Deployment", "prefix-router-redis")
    assert core_errors(pod_template, dep["spec"]["template"]) == []
    for svc in (d for d in docs if d["kind"] == "Service"):
        assert core_errors(service, svc) == [], svc["metadata"]["name"]
    dep["spec"]["template"]["spec"]["containers"][0]["args"].append(6379)
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["exec"]["cmd"] = []
    errors = core_errors(pod_template, dep["spec"]["template"])
    assert any("6379 is not of type 'string'" in e for e in errors), errors
    assert any("'cmd' was unexpected" in e for e in errors), errors


# --- the Serve config and the router's settings ---------------------------------------------

def test_serve_config_parses_with_ray_serves_own_schema(docs):
    from ray.serve.schema import (HTTPOptionsSchema, ServeApplicationSchema,
                                  ServeDeploySchema)

    rs = find(docs, "RayService")
    cfg = serve_config(rs)
    parsed = ServeDeploySchema.model_validate(cfg)
    assert parsed.proxy_location.value == "EveryNode"
    (app,) = parsed.applications
    assert app.import_path == "router.app:build_app" and app.route_prefix == "/"
    # Serve ignores unknown keys (forward compatibility): a misspelt one would pass silently
    assert set(cfg) <= set(ServeDeploySchema.model_fields)
    assert set(cfg["http_options"]) <= set(HTTPOptionsSchema.model_fields)
    assert set(cfg["applications"][0]) <= set(ServeApplicationSchema.model_fields)
    # the head's Serve port is the port the proxies listen on
    head_ports = {p["name"]: p["containerPort"]
                  for p in ray_container(ray_pod_specs(rs)["head"])["ports"]}
    assert head_ports["serve"] == parsed.http_options.port == 8000
    assert parsed.http_options.host == "0.0.0.0"

    from pydantic import ValidationError
    cfg["proxy_location"] = "Everywhere"
    with pytest.raises(ValidationError, match="proxy_location"):
        ServeDeploySchema.model_validate(cfg)
    cfg["proxy_locaton"] = cfg.pop("proxy_location")  # accepted by Serve, not by the check
    ServeDeploySchema.model_validate(cfg)
    assert not set(cfg) <= set(ServeDeploySchema.model_fields)


def pod_settings(docs: list[dict], monkeypatch, pod: str = "head"):
    """The router's settings as ``build_app`` makes them in a Ray pod of the RayService:
    only that pod's environment (from the placeholder Secrets), then ``given_twice`` and
    ``Settings(**args)``.

    Raises:
        AssertionError: a setting is given twice with different values.
    """
    import os

    from router.config import Settings

    for name in [n for n in os.environ if n.startswith("PREFIX_ROUTER_")]:
        monkeypatch.delenv(name)
    rs = find(docs, "RayService")
    env = container_env(ray_container(ray_pod_specs(rs)[pod]), secret_values(docs))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = app_args(rs)
    conflicts = Settings.given_twice(args)
    assert conflicts == [], conflicts
    return Settings(**args)


@pytest.mark.parametrize("pod", ["head", "gpu-workers"])
def test_the_application_args_and_the_pods_environment_make_valid_settings(docs, monkeypatch,
                                                                           pod):
    s = pod_settings(docs, monkeypatch, pod)
    secrets = secret_values(docs)
    url = urlsplit(s.redis_url)
    redis_svc = find(docs, "Service", "prefix-router-redis")
    assert (url.scheme, url.hostname, url.port, url.path) == (
        "redis", redis_svc["metadata"]["name"], redis_svc["spec"]["ports"][0]["port"], "/0")
    assert url.password == secrets[("prefix-router-redis", "password")]
    assert url.username == "prefix-router"
    assert s.cache_salt_secret == secrets[("prefix-router-api-keys", "cache-salt-secret")]
    assert s.device == "gpu" and s.replica_num_gpus == 1
    assert "REDIS_PASSWORD" not in s.redacted()["redis_url"]


def test_an_invalid_argument_or_a_conflicting_environment_is_refused(docs, monkeypatch):
    from pydantic import ValidationError

    rs = find(docs, "RayService")
    cfg = serve_config(rs)
    cfg["applications"][0]["args"]["replica_num_gpu"] = 1  # misspelt
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)
    with pytest.raises(ValidationError, match="replica_num_gpu"):
        pod_settings(docs, monkeypatch)
    # the URL given in the args as well, to another value: refused at start
    del cfg["applications"][0]["args"]["replica_num_gpu"]
    cfg["applications"][0]["args"]["redis_url"] = "redis://prefix-router-redis:6379/0"
    rs["spec"]["serveConfigV2"] = yaml.safe_dump(cfg)
    with pytest.raises(AssertionError, match="PREFIX_ROUTER_REDIS_URL"):
        pod_settings(docs, monkeypatch)


def test_the_redis_password_reaches_the_url_only_when_defined_before_it(docs):
    rs = find(docs, "RayService")
    c = ray_container(ray_pod_specs(rs)["head"])
    secrets = secret_values(docs)
    assert "$(" not in container_env(c, secrets)["PREFIX_ROUTER_REDIS_URL"]
    c["env"].reverse()  # Kubernetes expands $(NAME) only from the variables before it
    assert "$(REDIS_PASSWORD)" in container_env(c, secrets)["PREFIX_ROUTER_REDIS_URL"]


def test_the_application_is_deploy_gpu_yamls(docs):
    """The same application as deploy/gpu.yaml; only what Kubernetes changes differs: the
    model and keys paths (a volume each), and redis_url (from the environment)."""
    gpu = yaml.safe_load((ROOT / "deploy" / "gpu.yaml").read_text())
    cfg = serve_config(find(docs, "RayService"))
    assert cfg["proxy_location"] == gpu["proxy_location"]
    assert cfg["http_options"] == gpu["http_options"]
    ours, theirs = cfg["applications"][0], gpu["applications"][0]
    assert {k: v for k, v in ours.items() if k != "args"} == \
        {k: v for k, v in theirs.items() if k != "args"}
    a, b = ours["args"], theirs["args"]
    moved = {"model", "api_keys_file", "redis_url"}
    assert {k: v for k, v in a.items() if k not in moved} == \
        {k: v for k, v in b.items() if k not in moved}
    assert Path(a["model"]).name == Path(b["model"]).name and Path(a["model"]).is_absolute()
    assert Path(a["api_keys_file"]).name == Path(b["api_keys_file"]).name
    assert "redis_url" not in a and urlsplit(b["redis_url"]).path == "/0"


# --- the Ray pods -----------------------------------------------------------------------------

def test_ray_pods_match_the_settings(docs):
    rs = find(docs, "RayService")
    args = app_args(rs)
    cluster = rs["spec"]["rayClusterConfig"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"ray[serve]=={cluster["rayVersion"]}"' in pyproject
    pods = ray_pod_specs(rs)
    assert set(pods) == {"head", "gpu-workers"}
    head, worker = ray_container(pods["head"]), ray_container(pods["gpu-workers"])
    (group,) = cluster["workerGroupSpecs"]
    # one engine replica per GPU pod, and exactly as many pods as replicas
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == str(args["replica_num_gpus"])
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == str(args["replica_num_gpus"])
    assert float(group["rayStartParams"]["num-cpus"]) == args["replica_num_cpus"]
    assert not cluster["enableInTreeAutoscaling"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] \
        == args["num_replicas"]
    # no GPU on the head, whose logical CPUs are the ingress replicas'
    assert "nvidia.com/gpu" not in json.dumps(head["resources"])
    assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    assert float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"]) == \
        args["ingress_replicas"] * args["ingress_num_cpus"]
    images = {c["image"] for t in pods.values()
              for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])}
    assert len(images) == 1, images


@pytest.mark.parametrize("pod", ["head", "gpu-workers"])
def test_each_ray_pod_has_the_model_and_the_keys_file(docs, pod):
    rs = find(docs, "RayService")
    args = app_args(rs)
    template = ray_pod_specs(rs)[pod]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    c = ray_container(template)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    # the model directory: made by the init container in a volume the Ray container mounts
    (init,) = [i for i in template["spec"]["initContainers"] if i["name"] == "make-model"]
    cmd = init["command"]
    assert cmd[:3] == ["python", "-m", "deploy.make_model"]
    assert flag_value(cmd, "--out") == args["model"]
    assert flag_value(cmd, "--shape") == args["generate_model_shape"]
    (init_mount,) = init["volumeMounts"]
    assert args["model"].startswith(init_mount["mountPath"] + "/")
    assert mounts[init_mount["mountPath"]]["name"] == init_mount["name"]
    assert "emptyDir" in volumes[init_mount["name"]]
    # the keys file: the Secret's item in a directory mount (no subPath, so it is updated)
    keys = Path(args["api_keys_file"])
    m = mounts[str(keys.parent)]
    assert m.get("readOnly") and "subPath" not in m
    secret = volumes[m["name"]]["secret"]
    assert {i["path"]: i["key"] for i in secret["items"]}[keys.name] == "api-keys.json"
    assert secret["secretName"] == "prefix-router-api-keys"


def test_the_client_service_and_the_metrics_service_reach_the_serve_port(docs):
    rs = find(docs, "RayService")
    pods = ray_pod_specs(rs)
    head = ray_container(pods["head"])
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    # KubeRay's Serve Service: its port merges with the head's port named "serve"
    (client_port,) = rs["spec"]["serveService"]["spec"]["ports"]
    assert client_port["name"] == "serve" and "serve" in head_ports
    assert client_port["targetPort"] == head_ports["serve"] == client_port["port"]
    for worker in (t for name, t in pods.items() if name != "head"):  # EveryNode proxies
        assert {p["name"]: p["containerPort"] for p in ray_container(worker)["ports"]}[
            "serve"] == head_ports["serve"]
    # the metrics Service: the head pod only (each /metrics answer is the whole cluster's)
    metrics = find(docs, "Service", "prefix-router-metrics")
    assert selects(metrics["spec"]["selector"], pods["head"]["metadata"]["labels"])
    assert not selects(metrics["spec"]["selector"], pods["gpu-workers"]["metadata"]["labels"])
    (mport,) = metrics["spec"]["ports"]
    assert mport["targetPort"] in head_ports
    # the ServiceMonitor scrapes that Service's port, with a bearer token from a Secret
    sm = find(docs, "ServiceMonitor")
    assert selects(sm["spec"]["selector"]["matchLabels"], metrics["metadata"]["labels"])
    assert not selects(sm["spec"]["selector"]["matchLabels"],
                       rs["spec"]["serveService"]["metadata"]["labels"])
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == mport["name"] and ep["path"] == "/metrics"
    assert ep["authorization"]["type"] == "Bearer"
    assert ep["authorization"]["credentials"]["name"] == "prefix-router-metrics-token"


def test_the_prometheus_scrape_config_keeps_the_metrics_service_only(docs):
    cfg = yaml.safe_load((K8S / "prometheus" / "scrape-config.yaml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["type"] == "Bearer"
    assert job["authorization"]["credentials_file"].endswith("/token")
    assert int(job["scrape_timeout"].rstrip("s")) < int(job["scrape_interval"].rstrip("s"))
    metrics = find(docs, "Service", "prefix-router-metrics")
    client = find(docs, "RayService")["spec"]["serveService"]

    def kept(service: dict, port_name: str) -> bool:
        meta = {"__meta_kubernetes_endpoint_port_name": port_name}
        for k, v in service["metadata"]["labels"].items():
            meta["__meta_kubernetes_service_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k)] = v
        return all(re.fullmatch(r["regex"], ";".join(meta.get(s, "")
                                                     for s in r["source_labels"]))
                   for r in job["relabel_configs"] if r.get("action") == "keep")

    assert kept(metrics, metrics["spec"]["ports"][0]["name"])
    assert not kept(client, client["spec"]["ports"][0]["name"])


# --- Redis and the Secrets ------------------------------------------------------------------

def test_redis_has_no_persistence_and_requires_a_login(docs):
    assert redis_problems(docs) == []


@pytest.mark.parametrize("breaks, expected", [
    (lambda c: c["args"].__setitem__(c["args"].index("--save") + 1, "3600 1"), "--save"),
    (lambda c: c["args"].__setitem__(c["args"].index("--appendonly") + 1, "yes"),
     "--appendonly"),
    (lambda c: c["args"].remove("--aclfile"), "auth"),
    (lambda c: c["ports"][0].update(name="valkey"), "targets no container port"),
])
def test_a_broken_redis_is_refused(docs, breaks, expected):
    breaks(find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0])
    problems = redis_problems(docs)
    assert any(expected in p for p in problems), problems


def test_redis_acl_is_the_routers_least_privilege_rule(docs):
    from router.config import Settings
    from router.redis_keys import acl_rules

    namespace = Settings(**app_args(find(docs, "RayService"))).index_namespace
    acl = secret_values(docs)[("prefix-router-redis", "users.acl")].splitlines()
    assert acl[0] == "user default off"
    user = acl[1].split()
    assert user[:2] == ["user", "prefix-router"]
    # the placeholder fails closed: the user is off until the real Secret is made
    assert user[2] == "off" and user[3].startswith(">")
    assert user[4:] == acl_rules(namespace)
    assert len(acl) == 2


def test_redis_is_reachable_from_the_ray_pods_only(docs):
    policy = find(docs, "NetworkPolicy")
    dep = find(docs, "Deployment", "prefix-router-redis")
    assert selects(policy["spec"]["podSelector"]["matchLabels"],
                   dep["spec"]["template"]["metadata"]["labels"])
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    for template in ray_pod_specs(find(docs, "RayService")).values():
        assert selects(peer["podSelector"]["matchLabels"], template["metadata"]["labels"])
    assert not selects(peer["podSelector"]["matchLabels"],
                       dep["spec"]["template"]["metadata"]["labels"])
    assert [p["port"] for p in rule["ports"]] == [6379]


def test_every_secret_reference_names_a_placeholder_key_and_no_secret_is_committed(docs):
    values = secret_values(docs)
    refs = {ref for d in docs if d["kind"] != "Secret" for ref in secret_refs(d)}
    assert refs and refs <= set(values), refs - set(values)
    assert set(values) == refs, set(values) - refs  # and every placeholder is used
    for (name, key), value in values.items():
        if key == "api-keys.json":
            continue
        assert "REPLACE_ME" in value, (name, key)
    # no password or key anywhere else in the manifests
    for path in K8S.glob("*.yaml"):
        assert not re.search(r"sk-pr-|redis://[^:@/]*:[^$@/][^@/]*@", path.read_text()), path


def test_the_placeholder_keys_file_is_valid_and_admits_nobody(docs, tmp_path):
    from router.serve.auth import ApiKeys
    from router.serve.errors import OpenAIError

    path = tmp_path / "api-keys.json"
    path.write_text(secret_values(docs)[("prefix-router-api-keys", "api-keys.json")])
    keys = ApiKeys(str(path))
    assert keys.enabled
    with pytest.raises(OpenAIError) as err:
        keys.authenticate("Bearer " + secret_values(docs)[("prefix-router-metrics-token",
                                                            "token")])
    assert err.value.status == 401


def test_the_image_recipe_matches_the_project_and_the_rayservice(docs):
    """deploy/Dockerfile (not built here: no Docker engine) starts from Ray's GPU image of
    the Ray and Python the project pins and the RayService declares, and installs the
    repository with its gpu extra."""
    import re
    import tomllib

    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM\s+(\S+)", dockerfile, re.M)
    m = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-gpu", base)
    assert m, base
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"ray[serve]=={m.group(1)}" in project["dependencies"]
    assert project["requires-python"] == f">={m.group(2)}.{m.group(3)}"
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    assert rs["spec"]["rayClusterConfig"]["rayVersion"] == m.group(1)
    assert re.search(r'pip install [^\n]*"\.\[gpu\]"', dockerfile)
    for path in re.findall(r"^COPY\s+(?:--\S+\s+)*(.+?)\s+\S+$", dockerfile, re.M):
        for p in path.split():
            assert (ROOT / p).exists(), p



def test_the_acl_rules_command_takes_a_namespace_and_refuses_unknown_options(capsys):
    """Found by an operator's review: ``python -m router.redis_keys --help`` printed the
    rules of a namespace called ``--help``."""
    import pytest

    from router.redis_keys import acl_rules, main
    main(["my-ns", "--cluster"])
    assert capsys.readouterr().out.split() == acl_rules("my-ns", cluster=True)
    main([])
    assert capsys.readouterr().out.split() == acl_rules("prefix-router")
    for argv, code in ((["--help"], 0), (["--bogus"], 2)):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == code
        assert "resetkeys" not in capsys.readouterr().out


def test_run_sh_with_skip_setup_installs_nothing_and_needs_a_venv(tmp_path):
    """Found by an operator's review: ``deploy/run.sh`` always ran ``deploy/setup.sh``
    (pip when pyproject.toml changed, Prometheus from apt as root), so a service manager's
    restart after an upgrade installed packages. With ``SKIP_SETUP=1`` it runs none of it;
    without a ``.venv`` it stops at once, saying so."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "deploy").mkdir()
    shutil.copy(root / "deploy" / "run.sh", tmp_path / "deploy" / "run.sh")
    (tmp_path / "deploy" / "setup.sh").write_text("touch setup-ran\n")
    out = subprocess.run(["bash", "deploy/run.sh"], cwd=tmp_path, capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "SKIP_SETUP": "1"},
                         timeout=30)
    assert out.returncode == 2 and "no .venv" in out.stderr
    assert not (tmp_path / "setup-ran").exists()
