"""Models: load any local Hugging Face causal LM directory, and make tiny ones from a config.

load_policy(path)   model + tokenizer from a local directory (never a hub download), on
                    CUDA when available, CPU otherwise; bf16 where the device supports it
render_prompt       a prompt (text, or chat messages) as the text the model continues
                    (pipeline/core/chat.py: the one rendering serving, training, the gate and the judge share)
init_tiny(out)      a small Llama- or Qwen2-style model, built from a config and seeded, with
                    a character-level tokenizer (the demo) or a byte-level BPE with a
                    ChatML/tool-call chat template (train/tiny_tokenizers.py): for tests
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.core.chat import render_prompt, render_turns  # noqa: F401 - re-exported
from train.tiny_tokenizers import SIMPLE_CHAT_TEMPLATE, TOKENIZERS, bpe_tokenizer, char_tokenizer

TINY_ARCHS = ("llama", "qwen2")


class ModelError(RuntimeError):
    """A model directory is missing or unusable; the message names the path."""


@dataclass
class Policy:
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    path: Path
    device: str

    @property
    def revision(self) -> str:
        """What identifies the weights: the commit hash when known, else the config's hash."""
        return getattr(self.model.config, "_commit_hash", None) or config_hash(self.path)


def config_hash(path: Path) -> str:
    import hashlib

    return hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:12]


def pick_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def set_cpu_threads(n: int | None) -> None:
    """torch's intra-op threads for this process (None: leave torch's default, one per core).
    A parallel op waits for its slowest thread, so on cores that another process keeps busy
    (serving) training ran 1.6x slower on two threads than on one, and greedy generation 2-4x
    (docs/benchmarks.md, "Training step")."""
    if n is not None:
        import torch

        torch.set_num_threads(n)


def pick_dtype(device: str):
    import torch

    # bf16 where the device does it natively; on CPU, float32 (bf16 matmuls are emulated, slow)
    if device == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def import_model_code(path: str | Path) -> None:
    """Import the code that loading and training the model at `path` runs: its architecture's
    module (with transformers' generation and weight-loading machinery) and peft. transformers
    imports these lazily, on the first load in a process -- seconds, which a daemon's first cycle
    would otherwise pay. A missing or broken directory is a ModelError naming the path."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    path = Path(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports modeling_<architecture>
    except Exception as exc:  # noqa: BLE001 - missing files, bad json, unknown architecture
        raise ModelError(f"cannot load the model at {path}: {type(exc).__name__}: {exc}") from None
    importlib.import_module("peft")


def load_policy(path: str | Path, device: str | None = None, dtype=None) -> Policy:
    """Load a local model directory; a missing or broken one is a ModelError naming the path."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelError(
            f"no model at {path}: expected a Hugging Face model directory with config.json "
            f"(make one for tests with `rtrl model init-tiny --out {path}`)"
        )
    device = device or pick_device()
    try:
        tokenizer = _tokenizer_class(path).from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or pick_dtype(device))
    except Exception as exc:  # noqa: BLE001 - corrupt files raise many types (safetensors, json, ...)
        raise ModelError(f"cannot load the model at {path}: {type(exc).__name__}: {exc}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.chat_template is None:
        tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return Policy(model=model.to(device), tokenizer=tokenizer, path=path, device=device)


def _tokenizer_class(path: Path):
    """AutoTokenizer, unless the directory declares a plain fast tokenizer: transformers 5 maps
    by model type (a Qwen2 config gets Qwen2Tokenizer and its pre-tokenizer) and would override
    the tokenizer the model was trained with."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        declared = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (FileNotFoundError, json.JSONDecodeError):
        declared = None
    return PreTrainedTokenizerFast if declared == "PreTrainedTokenizerFast" else AutoTokenizer


def init_tiny(
    out: str | Path,
    arch: str = "llama",
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    tokenizer: str = "char",
    vocab: int = 32_768,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    model_vocab: int | None = None,
    tool_markers: bool = False,
) -> Path:
    """Write a small randomly initialised model and its tokenizer to `out` (`vocab`: the BPE's
    size; `model_vocab`: embedding rows, when more than the tokenizer has, as real models pad them;
    `tool_markers`: the char tokenizer with the tool-call markers as tokens -- the BPE has them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if arch not in TINY_ARCHS:
        raise ModelError(f"unknown tiny architecture {arch!r}: choose one of {', '.join(TINY_ARCHS)}")
    if tokenizer not in TOKENIZERS:
        raise ModelError(f"unknown tokenizer {tokenizer!r}: choose one of {', '.join(TOKENIZERS)}")
    if hidden % heads:
        raise ModelError(f"hidden ({hidden}) must be a multiple of heads ({heads})")
    if tokenizer == "bpe" and not 1_000 <= vocab <= 262_144:
        raise ModelError(f"--vocab must be between 1000 and 262144 (got {vocab})")
    tok = char_tokenizer(tool_markers) if tokenizer == "char" else bpe_tokenizer(vocab, seed)
    config_cls, model_cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    config = config_cls(
        vocab_size=max(len(tok), model_vocab or 0),
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        max_position_embeddings=2048 if tokenizer == "bpe" else 512,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # see _tokenizer_class
    config_path.write_text(json.dumps(tok_config, indent=2))
    return out
