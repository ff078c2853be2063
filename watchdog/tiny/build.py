"""Tiny random-weight mlx-lm models, tokenizers and model folders for tests.

Nothing here downloads anything: the models are built from a small config with
random weights, and ``save_model_dir`` writes a folder that ``mlx_lm.load``
opens offline.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import itertools
import json
import random
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

MODEL_TYPES = ("llama", "qwen3", "qwen3_next", "deepseek_v41", "qwen3_moe")

# Mixture-of-experts models route through GatherMM, which MLX's CPU backend
# runs only in float32.
MOE_TYPES = ("qwen3_next", "deepseek_v41", "qwen3_moe")

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
EOS_ID = 256 + SPECIAL_TOKENS.index(EOS_TOKEN)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Sizes every model type shares: 64 wide, 4 query heads of 32, 2 KV heads.
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}

_MOE: dict[str, Any] = {
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}

_CONFIGS: dict[str, dict[str, Any]] = {
    # llama.Model.make_cache ignores generate's max_kv_size (a RotatingKVCache
    # must be passed as prompt_cache); qwen3 has no make_cache, so it gets one.
    "llama": {},
    "qwen3": {},
    "qwen3_moe": dict(_MOE, num_experts=32),
    "qwen3_next": dict(
        _MOE,
        num_experts=8,
        shared_expert_intermediate_size=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        partial_rotary_factor=0.25,
        full_attention_interval=4,
    ),
    # The real defaults are huge (129k vocab, 5120 wide, 384 experts): every
    # size is overridden. Layer 0 attends to its sliding window only; the
    # others also compress their KV with ratio 2 or 4 and pick the compressed
    # groups with their own indexer, so within a few decode steps the window
    # slides, the pending rows fill and groups close. mlx-lm 0.32.2's
    # BatchGenerator cannot batch it: its LayerCache has no merge, so the
    # first next() raises "... does not yet support batching with history".
    "deepseek_v41": {
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "o_groups": 2,
        "o_lora_rank": 32,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": 8,
        "candidate_source_layer_id": -1,
        "index_n_heads": 2,
        "index_head_dim": 32,
        "index_topk": 4,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
    },
}


def _deepseek_layers(layers: int) -> dict:
    """Layer 0 window-only, then compress ratios 2, 4, 2, ... each with an indexer."""
    ratios = [0] + [2 if i % 2 else 4 for i in range(1, layers)]
    sources = [i for i, r in enumerate(ratios) if r]
    return {
        "compress_ratios": ratios,
        "kv_source_layer_ids": sources,
        "index_source_layer_ids": sources,
    }


def tiny_config(model_type: str = "qwen3_next", layers: int = 8, **overrides) -> dict:
    """A config.json-style dict for a tiny ``model_type`` model with ``layers``
    layers; ``overrides`` replace or add keys. It holds no None values."""
    if model_type not in _CONFIGS:
        raise ValueError(f"Unknown model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}.")
    config = {"model_type": model_type, **_COMMON, **_CONFIGS[model_type]}
    config = copy.deepcopy(config)
    config["num_hidden_layers"] = layers
    config["eos_token_id"] = EOS_ID
    if model_type == "deepseek_v41":
        config.update(_deepseek_layers(layers))
    config.update(overrides)
    config = {key: value for key, value in config.items() if value is not None}
    interval = config.get("full_attention_interval")
    if model_type == "qwen3_next" and config["num_hidden_layers"] < interval:
        # mlx-lm indexes the cache of layer interval - 1 for the attention mask.
        raise ValueError(f"qwen3_next needs at least full_attention_interval={interval} layers.")
    return config


def missing_model_types() -> dict[str, str]:
    """The model types of ``MODEL_TYPES`` the installed mlx-lm does not ship (``deepseek_v41``
    came in mlx-lm 0.32), each with a sentence that says so: for skips and clear errors."""
    import mlx_lm.models

    version = getattr(importlib.import_module("mlx_lm"), "__version__", "?")
    return {
        model_type: f"mlx-lm {version} has no mlx_lm.models.{model_type}"
        for model_type in MODEL_TYPES
        if importlib.util.find_spec(f"{mlx_lm.models.__name__}.{model_type}") is None
    }


def build_model(
    model_type: str = "qwen3_next",
    layers: int = 8,
    seed: int = 0,
    dtype=None,
    **overrides,
) -> nn.Module:
    """Build ``mlx_lm.models.<model_type>.Model`` from ``tiny_config`` with
    random weights drawn from ``seed`` (this seeds MLX's global generator).

    Every matrix is drawn from N(0, 1/d), d its last dimension; vectors
    (norms, biases, gates) keep the values the model sets. With untied
    embeddings this keeps greedy decoding from repeating one token.
    ``dtype`` None means float32, the only dtype MoE models run in on CPU.
    """
    config = tiny_config(model_type, layers, **overrides)
    dtype = dtype or mx.float32
    if model_type in MOE_TYPES and dtype != mx.float32 and not mx.metal.is_available():
        raise ValueError(
            f"{model_type} is a mixture of experts: MLX's CPU backend runs its "
            f"GatherMM only in float32, not {dtype}."
        )
    missing = missing_model_types().get(config["model_type"])
    if missing is not None:
        raise ValueError(missing)
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    randomize(model)
    if dtype != mx.float32:
        _cast(model, dtype)
    mx.eval(model.parameters())
    model.eval()
    return model


def randomize(model: nn.Module) -> None:
    """Draw every floating matrix from N(0, 1/d), d its last dimension (from MLX's global
    generator); vectors (norms, biases, gates) keep the values the model sets."""
    params = [
        (
            name,
            mx.random.normal(p.shape) * p.shape[-1] ** -0.5
            if p.ndim >= 2 and mx.issubdtype(p.dtype, mx.floating)
            else p,
        )
        for name, p in _parameters(model)
    ]
    model.update(tree_unflatten(params))


def _cast(model: nn.Module, dtype) -> None:
    """Cast the floating parameters the model allows to ``dtype``."""
    keep = getattr(model, "cast_predicate", lambda name: True)

    def cast_one(name, p):
        floating = mx.issubdtype(p.dtype, mx.floating)
        return p.astype(dtype) if floating and keep(name) else p

    params = [(name, cast_one(name, p)) for name, p in _parameters(model)]
    model.update(tree_unflatten(params))


def _parameters(model: nn.Module) -> list[tuple[str, mx.array]]:
    """The model's parameters as (name, array) pairs (``tree_flatten``'s list form)."""
    return cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    chars = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``tokenizers.Tokenizer`` with exactly ``vocab_size``
    ids: the 256 bytes (id = byte value), the special tokens
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (the EOS), then merges
    of two bytes. Any text encodes to ids below ``vocab_size``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    n_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    if not 0 <= n_merges <= 256 * 256:
        raise ValueError(
            f"vocab_size must be between {256 + len(SPECIAL_TOKENS)} and "
            f"{256 + len(SPECIAL_TOKENS) + 256 * 256}, not {vocab_size}."
        )
    chars = _bytes_to_unicode()
    vocab = {chars[byte]: byte for byte in range(256)}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    # Merges of two bytes, those of frequent letters and the space first:
    # every pair of the first k characters comes before the (k+1)-th.
    order = [chars[ord(c)] for c in " etaoinshrdlucmfwypvbgkjqxz"]
    order += [chars[b] for b in range(256) if chars[b] not in order]
    pairs = sorted(itertools.product(range(256), repeat=2), key=max)
    merges = [(order[a], order[b]) for a, b in pairs[:n_merges]]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_model_dir(path, model_type: str = "qwen3_next", layers: int = 8, seed: int = 0, **overrides) -> Path:
    """Write a folder ``mlx_lm.load`` opens offline: config.json,
    model.safetensors (the model's own parameter names, which every supported
    model's sanitize passes through) and the tokenizer files. Returns the path.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_config(model_type, layers, **overrides)
    model = build_model(model_type, layers, seed, **overrides)
    mx.save_safetensors(
        str(path / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=2))
    build_tokenizer(config["vocab_size"]).save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special = {"eos_token": EOS_TOKEN, "pad_token": "<|endoftext|>"}
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
    return path


def tiny_prompts(n: int, length: int, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> list[list[int]]:
    """``n`` deterministic prompts of ``length`` token ids below
    ``vocab_size``, none of them a special token of ``build_tokenizer``."""
    rng = random.Random(seed)
    special = range(256, 256 + len(SPECIAL_TOKENS))
    ids = [i for i in range(vocab_size) if i not in special]
    return [[rng.choice(ids) for _ in range(length)] for _ in range(n)]
