"""What to serve and how: the Serve config (model, engine + scheduler, HTTP API limits and auth, Ray Serve
deployment shape), device choice and building the engine it describes."""
from __future__ import annotations

import logging
import os
from typing import Literal

from pydantic import Field, model_validator

from dspark.config import ModelRef, StrictModel
from dspark.decoding.engine import Engine, EngineConfig
from dspark.flywheel.config import FlywheelConfig
from dspark.models.precision import resolve_dtype  # model.dtype -> the weights dtype on the replica's device

log = logging.getLogger("dspark.serve")


# ---- configuration ----------------------------------------------------------------------------------
class ModelSection(StrictModel):
    target: str = Field("tiny", description='"tiny" | "smollm2-135m" | local dir | s3:// dir | hub name')
    drafter: ModelRef | None = Field(None, description="local dir | s3://... | runs:/<id>/<path> | models:/<name>@<alias> (None: mode off)")
    served_name: str | None = Field(None, description='the `model` clients send; None -> "dspark-<target>"')
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights dtype of target and drafter; auto: bfloat16 where the replica's device "
                            "computes it natively (a CUDA GPU with bf16, a CPU with avx512_bf16 or AMX), else float32")
    # "auto": cuda when this replica has a GPU assigned and CUDA works, else cpu; "cuda" fails the
    # replica start (naming this key) where CUDA is unavailable, instead of silently serving on CPU
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when this replica has a GPU and CUDA works, else cpu; cuda: fail the replica start (naming this key) where CUDA is unavailable")


PROMPT_CHARS_PER_TOKEN = 32  # default api.max_prompt_chars = this × engine.max_model_len


class ApiSection(StrictModel):
    api_key_env: str = Field("DSPARK_API_KEY", description="when this env var is set on the replica, Bearer auth is required")
    max_tokens_limit: int = Field(1024, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(256, description="when a request gives none (capped by the room left in the context)")
    max_prompts: int = Field(16, description="prompts per /v1/completions request")
    max_choices: int = Field(16, ge=1, description="choices per request at most: n × the number of prompts")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description=(
        "largest request body in bytes; larger ones get 413 before they are read (by Content-Length) or "
        "as soon as they pass the limit, and are never parsed"))
    max_prompt_chars: int | None = Field(None, ge=1, description=(
        f"largest prompt (all messages' text, or all prompts) in characters, checked before tokenizing; "
        f"None: {PROMPT_CHARS_PER_TOKEN} × engine.max_model_len"))


class AutoscalingSection(StrictModel):
    min_replicas: int = Field(1, ge=0, description="fewest replicas")
    max_replicas: int = Field(2, ge=1, description="most replicas")
    target_ongoing_requests: float = Field(32.0, gt=0, description="requests per replica the autoscaler aims at "
                                           "(below engine.max_batch: a replica batches up to that)")

    @model_validator(mode="after")
    def _order(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class DeploymentSection(StrictModel):
    name: str = Field("dspark", description="Serve application name")
    num_replicas: int = Field(1, description="engine replicas (one engine each)")
    max_ongoing_requests: int = Field(128, description="per replica; keep >= engine.max_batch so the engine can batch")
    max_queued_requests: int = Field(256, description="Serve-side queue; beyond it Serve answers 503")
    num_cpus: float = Field(1.0, description="CPUs reserved per replica (fractional is fine)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per replica (ray_actor_options.num_gpus)")
    torch_threads: int | None = Field(None, description="None -> max(1, round(num_cpus))")
    health_check_period_s: float = Field(10.0, description="seconds between Serve's replica health checks")
    health_check_timeout_s: float = Field(30.0, description="a replica not answering its health check within this is restarted")
    graceful_shutdown_timeout_s: float = Field(
        300.0, ge=0, description="a replica being stopped (downscale, upgrade, promotion roll-out) finishes its open "
        "requests for up to this long before it is killed (Ray Serve's default of 20 s cuts long streams)")
    autoscaling: AutoscalingSection | None = Field(None, description="replicas between min and max by load (Ray "
                                                   "Serve autoscaling_config; num_replicas is then ignored); None: "
                                                   "num_replicas fixed")


class HttpSection(StrictModel):
    host: str = Field("127.0.0.1", description="address the Serve proxy listens on (127.0.0.1: this machine only)")
    port: int = Field(8000, description="HTTP port of the Serve proxy")
    route_prefix: str = Field("/", description="URL prefix of the app")
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode", description="where Serve runs HTTP proxies: EveryNode (a proxy per node, for a load "
        "balancer in front; survives losing any worker node) or HeadOnly (one proxy on the head; needed when "
        "several Ray nodes share one host address, e.g. a multi-node test cluster on 127.0.0.1)")


class ServeConfig(StrictModel):
    model: ModelSection = Field(default_factory=ModelSection, description="what to serve")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="the draft-plus-verify engine and its scheduler")
    api: ApiSection = Field(default_factory=ApiSection, description="HTTP API limits and auth")
    deployment: DeploymentSection = Field(default_factory=DeploymentSection, description="Ray Serve deployment shape")
    http: HttpSection = Field(default_factory=HttpSection, description="where the Serve proxy listens")
    flywheel: FlywheelConfig = Field(default_factory=FlywheelConfig, description="per-domain acceptance summaries and opt-in traffic capture (README: Keeping a drafter fresh)")


def served_name(cfg: ServeConfig) -> str:
    return cfg.model.served_name or f"dspark-{os.path.basename(cfg.model.target.rstrip('/'))}"


def resolve_device(setting: str, has_gpus: bool) -> str:
    """model.device -> the torch device target, drafter and engine tensors live on ("cpu" | "cuda")."""
    import torch

    cuda = torch.cuda.is_available()
    if setting == "cuda" and not cuda:
        raise ValueError("model.device='cuda' but CUDA is not available on this replica "
                         "(torch.cuda.is_available() is False); give the deployment a GPU "
                         "(deployment.num_gpus / ray_actor_options.num_gpus) with a CUDA build of torch, "
                         "or set model.device to 'auto' or 'cpu'")
    if setting == "auto":
        if has_gpus and not cuda:
            log.warning("model.device=auto: GPUs are assigned but CUDA is unavailable; serving on cpu")
        return "cuda" if has_gpus and cuda else "cpu"
    return setting


def build_engine(cfg: ServeConfig, device: str | None = None, has_gpus: bool | None = None) -> Engine:
    """Load the target and drafter named in the config and start nothing (call engine.start()).
    device None: resolved from model.device (see `resolve_device`) and `has_gpus` (whether this process
    was given GPUs; default deployment.num_gpus > 0 — a Serve replica passes Ray's assignment)."""
    import torch

    from dspark.io import storage
    from dspark.io.drafter_source import load_drafter_ref
    from dspark.models.target import load_target

    has_gpus = cfg.deployment.num_gpus > 0 if has_gpus is None else has_gpus
    device = device or resolve_device(cfg.model.device, has_gpus)
    dtype = resolve_dtype(cfg.model.dtype, device)
    log.info("serving %s on %s in %s (model.dtype=%s)", cfg.model.target, device, dtype, cfg.model.dtype)
    target = load_target(cfg.model.target, dtype=getattr(torch, dtype), device=device,
                         local_copy=storage.local_copy)
    drafter = None
    if cfg.engine.scheduler.mode != "off":
        if not cfg.model.drafter:
            raise ValueError(f"engine.scheduler.mode={cfg.engine.scheduler.mode!r} needs model.drafter "
                             "(a local dir, s3://, runs:/ or models:/ reference); or set engine.scheduler.mode=off")
        drafter = load_drafter_ref(cfg.model.drafter, target, device=device).eval()
    return Engine(target, drafter, cfg.engine)  # the engine puts its KV slots and RNG on target.device
