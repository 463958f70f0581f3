"""Decoding benchmark prompts on a pool of Ray actors, shared by jobs.evaluate and jobs.calibrate.

Each `EvalWorker` holds the target and every drafter and decodes whole prompts in all requested modes
(target-only and each drafter). The pool (pipelines.actor_pool) starts only the workers that fit,
drops workers that cannot start in `workers.start_timeout_s`, and gives a dead worker's prompt to
another; `num_workers: 0` decodes in the calling process.
"""
from __future__ import annotations

import sys

from pydantic import Field

from dspark.eval import evaluate as ev
from dspark.config import StrictModel
from dspark.models.precision import AUTO_DESCRIPTION, DtypeSetting
from pipelines.actor_pool import DEFAULT_START_TIMEOUT_S, START_TIMEOUT_DESCRIPTION


class WorkersConfig(StrictModel):
    num_workers: int = Field(2, description="Ray actors decoding prompts; 0 = decode in the driver process (no Ray)")
    num_cpus: float = Field(1.0, description="per actor")
    num_gpus: float = Field(0.0, description="per actor (> 0 puts target and drafters on cuda)")
    torch_threads: int | None = Field(None, description="per actor; default max(1, int(num_cpus))")
    dtype: DtypeSetting = Field("auto", description="weights dtype of target and drafters, resolved on each "
                                "worker's device; " + AUTO_DESCRIPTION)
    start_timeout_s: float = Field(DEFAULT_START_TIMEOUT_S, gt=0, description=START_TIMEOUT_DESCRIPTION)



class EvalWorker:
    """Holds the target and every drafter; decodes whole prompts in all requested modes."""

    def __init__(self, spec: dict):
        import torch

        from dspark.io import storage
        from dspark.io.drafter_source import load_drafter_ref
        from dspark.models.precision import torch_dtype
        from dspark.models.target import load_target

        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        # "auto" resolves here, on the worker's own device (bf16 only where it is native)
        self.target = load_target(spec["target"], dtype=torch_dtype(spec["dtype"], spec["device"]),
                                  device=spec["device"], local_copy=storage.local_copy)
        self.drafters = {name: load_drafter_ref(ref, self.target) for name, ref in spec["drafters"].items()}
        if spec.get("raw_confidences"):  # calibration collects uncalibrated confidences
            for drafter in self.drafters.values():
                drafter.calibration = None
        self.settings = ev.DecodeSettings.model_validate(spec["decode"])
        self.seed, self.threshold_on = spec["seed"], spec.get("threshold_on", "prefix")

    def run(self, item: dict) -> list[ev.ConversationResult]:
        return ev.evaluate_prompt(self.target, self.drafters, item["benchmark"], item["index"], item["turns"],
                                  item["modes"], self.settings, self.seed, self.threshold_on,
                                  system=item.get("system"))


def worker_spec(cfg_target: str, drafter_refs: dict[str, str], decode: ev.DecodeSettings, seed: int,
                workers: WorkersConfig, **extra) -> dict:
    return {"target": cfg_target, "drafters": drafter_refs, "decode": decode.model_dump(), "seed": seed,
            "dtype": workers.dtype, "device": "cuda" if workers.num_gpus > 0 else "cpu",
            "threads": workers.torch_threads or max(1, int(workers.num_cpus)),
            **extra}


def decode_items(items: list[dict], spec: dict, workers: WorkersConfig,
                 desc: str = "prompts") -> list[ev.ConversationResult]:
    """Decode every item, in this process (num_workers 0) or over a pool of Ray actors (Ray must be
    initialised by the caller, e.g. jobs.common.init_ray)."""
    from tqdm import tqdm

    results: list[ev.ConversationResult] = []
    bar = tqdm(total=len(items), desc=desc, unit="prompt", file=sys.stderr)
    if workers.num_workers == 0:
        worker = EvalWorker(spec)
        for item in items:
            results += worker.run(item)
            bar.update()
        bar.close()
        return results
    import ray

    from pipelines.actor_pool import WorkerAsk, map_unordered

    actor_cls = ray.remote(num_cpus=workers.num_cpus, num_gpus=workers.num_gpus or None)(EvalWorker)
    ask = WorkerAsk(f"{desc} workers", workers.num_workers, workers.num_cpus, workers.num_gpus,
                    "workers.num_workers / workers.num_cpus / workers.num_gpus")
    try:  # workers that cannot start in start_timeout_s are dropped; a dead worker's prompt goes to another
        for out in map_unordered(lambda: actor_cls.remote(spec), lambda actor, item: actor.run.remote(item),
                                 items, ask, workers.start_timeout_s):
            results += out
            bar.update()
    finally:
        bar.close()
    return results
