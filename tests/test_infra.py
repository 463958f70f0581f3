"""Cluster deployment files (infra/) are parsed and validated; benchmarks/run_all.py collects results.

Checks per file: required fields (apiVersion/kind, head and GPU worker groups, images, env), and
that every entrypoint names a real job module under jobs/ and an existing config file that
validates against that job's config model. No cluster, Docker daemon or network is needed.
"""
from __future__ import annotations

import ast
import importlib
import json
import re
import shlex
import sys
import textwrap
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
IMAGE_DIR = "/app"  # where infra/docker/Dockerfile puts the repo inside the image
KUBERAY_FILES = ["raycluster.yaml", "rayjob-generate.yaml", "rayjob-train.yaml", "rayservice.yaml"]


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


def config_model_name(module_path: Path) -> str:
    """Name of the config class a job module passes to load_job_config/load_config."""
    tree = ast.parse(module_path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "load_job_config", "load_config") and node.args and isinstance(node.args[0], ast.Name):
            return node.args[0].id
    raise AssertionError(f"{module_path}: no load_job_config(<Model>, ...) call found")


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

    model = getattr(importlib.import_module(module), config_model_name(module_path))
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
    and Secret of infra/services/k8s-mlflow-minio.yaml. Returns the images used."""
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
    docs = load_all("infra/services/k8s-mlflow-minio.yaml")
    config_maps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
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
    ignore = (INFRA / "docker" / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".dspark" in ignore, "build context must exclude .venv and .dspark"


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


@pytest.mark.parametrize("name,stage", [("rayjob-generate.yaml", "generate"), ("rayjob-train.yaml", "train")])
def test_kuberay_rayjobs_run_real_jobs_with_real_configs(name, stage):
    doc = load_yaml(f"infra/kuberay/{name}")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    spec = doc["spec"]
    module, config = check_entrypoint(spec["entrypoint"])
    assert module == f"jobs.{stage}"
    assert config.parent.name == stage, f"{config} is not a {stage} config (configs/{stage}/...)"
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
    from jobs.train import TrainJobConfig

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


def test_kuberay_rayservice_args_build_the_serve_app():
    """The RayService's app args are accepted by the application builder (a valid ServeConfig), and
    it deploys the same app as infra/serve/serve_config.yaml."""
    from dspark.serve import deployment

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
    services_ns = {d["metadata"].get("namespace") for d in load_all("infra/services/k8s-mlflow-minio.yaml")
                   if d["kind"] != "Namespace"}
    assert namespaces == services_ns, f"KubeRay namespaces {namespaces} != services namespaces {services_ns}"


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
def test_compose_runs_mlflow_with_artifacts_in_minio():
    doc = load_yaml("infra/services/docker-compose.yaml")
    services = doc["services"]
    assert {"minio", "mlflow", "create-buckets"} <= set(services)
    mlflow = services["mlflow"]
    assert mlflow["image"].endswith(f"v{version('mlflow')}"), "MLflow server version != client version"
    command = mlflow["command"]
    assert "--artifacts-destination s3://mlflow" in command and "--serve-artifacts" in command
    assert "--backend-store-uri postgresql://" in command, "MLflow needs a SQL backend"
    assert mlflow["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    buckets = services["create-buckets"]["entrypoint"]
    assert "local/dspark" in buckets and "local/mlflow" in buckets, "the dspark and mlflow buckets must be created"
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert mlflow["depends_on"]["create-buckets"]["condition"] == "service_completed_successfully"


def test_k8s_services_manifest_is_consistent():
    docs = load_all("infra/services/k8s-mlflow-minio.yaml")
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d
    by_kind: dict[str, dict[str, dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    assert {"Namespace", "Secret", "ConfigMap", "Deployment", "Service", "Job", "PersistentVolumeClaim"} <= set(by_kind)
    deployments = by_kind["Deployment"]
    assert {"minio", "mlflow"} <= set(deployments)
    for name, dep in deployments.items():
        selector = dep["spec"]["selector"]["matchLabels"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"Deployment {name}: selector does not match its pods"
        for volume in dep["spec"]["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in by_kind["PersistentVolumeClaim"]
        for c in dep["spec"]["template"]["spec"]["containers"]:
            for ref in c.get("envFrom", []):
                if "secretRef" in ref:
                    assert ref["secretRef"]["name"] in by_kind["Secret"]
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in deployments.values()]
    for name, svc in by_kind["Service"].items():
        assert any(svc["spec"]["selector"].items() <= labels.items() for labels in pod_labels), \
            f"Service {name} selects no Deployment"
    env = by_kind["ConfigMap"]["dspark-env"]["data"]
    for var in ("MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL"):
        host = re.match(r"http://([^.:/]+)", env[var]).group(1)
        assert host in by_kind["Service"], f"{var} points at {host}, which is not a Service here"
    mlflow = deployments["mlflow"]["spec"]["template"]["spec"]["containers"][0]
    assert mlflow["image"].endswith(f"v{version('mlflow')}")
    assert "--serve-artifacts" in mlflow["args"][0] and "s3://mlflow" in mlflow["args"][0]
    assert set(by_kind["Secret"]["dspark-s3"]["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}


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
