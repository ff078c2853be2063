"""Every architecture the installed mlx-lm ships, built tiny: narrow widths, its real layer pattern.

``families()`` lists the modules of ``mlx_lm.models`` that define a ``Model`` and its
``ModelArgs``. ``family_config(name)`` fills that ``ModelArgs``: its own defaults where it has
them (the layer count and pattern of the checkpoint it was written for), tiny widths for every
size field it knows by name (hidden 64, 4 heads of 16, 2 KV heads, vocabulary 512, 4 experts
of which 2 routed, state 16), the layer-type fields of the hybrid families from ``PATTERNS``,
and a value by type for any other required field. Wrappers (``text_config``) get the config of
the text model they build. ``build(name)`` builds it with random weights (``tiny.randomize``'s
rule: N(0, 1/d) matrices), in float32 (MoE runs on MLX's CPU only in float32).

Nothing is downloaded. A family that cannot be built raises; the scan reports the error.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.util
import inspect
import pkgutil
import re
import typing
from collections.abc import Callable
from typing import Any

DEFAULT_LAYERS = 24  # where ModelArgs has no layer count of its own (a mid-size checkpoint's depth)

# Size fields by name: every one of them is set (defaults too: they are the full-size model's).
SIZES = {
    ("vocab_size", "num_vocab", "vocab_size_per_layer_input"): 512,
    ("hidden_size", "d_model", "n_embd", "model_dim", "hidden_dim", "dim", "dim_model_base", "block_dim"): 64,
    (
        "intermediate_size",
        "ffn_hidden_size",
        "n_inner",
        "ff_intermediate_size",
        "intermediate_size_mlp",
        "block_ff_dim",
        "ffn_dim",
        "d_ff",
        "moe_hidden_size",
    ): 128,
    (
        "moe_intermediate_size",
        "expert_ffn_hidden_size",
        "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "shared_intermediate_size",
    ): 32,
    (
        "num_attention_heads",
        "n_head",
        "num_heads",
        "num_query_heads",
        "n_heads",
        "num_swa_attention_heads",
        "swa_num_attention_heads",
        "linear_num_value_heads",
        "mamba_n_heads",
        "mamba_num_heads",
    ): 4,
    (
        "num_key_value_heads",
        "num_kv_heads",
        "n_kv_heads",
        "num_attention_groups",
        "num_global_key_value_heads",
        "num_swa_key_value_heads",
        "swa_num_key_value_heads",
        "linear_num_key_heads",
    ): 2,
    (
        "head_dim",
        "kv_channels",
        "hidden_size_per_head",
        "mamba_d_head",
        "mamba_head_dim",
        "global_head_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "swa_head_dim",
        "swa_v_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "index_head_dim",
        "hidden_size_per_layer_input",
    ): 16,
    ("qk_rope_head_dim", "rotary_dim"): 8,
    (
        "kv_lora_rank",
        "q_lora_rank",
        "o_lora_rank",
        "a_low_rank_dim",
        "v_low_rank_dim",
        "gate_low_rank_dim",
        "decay_low_rank_dim",
    ): 16,
    ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "moe_topk", "moe_k", "num_experts_per_token", "moe_top_k", "index_n_heads"): 2,
    ("n_shared_experts", "num_shared_experts", "num_shared_expert", "moe_num_shared_experts"): 1,
    ("n_group", "topk_group", "n_groups", "mamba_n_groups", "o_groups"): 1,
    ("index_topk",): 4,
    ("mamba_d_state", "state_size", "ssm_state_size", "d_state"): 16,
    ("mamba_d_ssm",): 64,
    ("time_step_rank",): 8,
    (
        "max_position_embeddings",
        "n_positions",
        "n_ctx",
        "block_size",
        "model_max_length",
        "original_max_position_embeddings",
    ): 4096,
    ("sliding_window", "sliding_window_size", "attention_window_size", "window_size"): 16,
}
_SIZE = {name: value for names, value in SIZES.items() for name in names}
# Depth fields: the ModelArgs default (the checkpoint's), else DEFAULT_LAYERS.
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_transformer_layers")
# Required fields that are no size, by name.
REQUIRED = {
    "rope_theta": 10000.0,
    "rotary_emb_base": 10000.0,
    "rope_scaling": None,
    "partial_rotary_factor": 0.5,
    "rotary_pct": 0.25,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "full_attention_interval": 4,
    "conv_kernel": 4,
    "mamba_d_conv": 4,
    "conv_L_cache": 3,
    "linear_conv_kernel_dim": 4,
    "conv1d_width": 4,
    "conv_window": 2,
    "hidden_act": "silu",
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "routed_scaling_factor": 1.0,
    "logits_scaling": 1.0,
    "attention_multiplier": 0.25,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "scale_depth": 1.0,
    "scale_emb": 1.0,
    "logit_scale": 1.0,
    "logits_soft_cap": 30.0,
    "time_step_limit": [0.0, float("inf")],
    "layer_group_size": 4,
    "group_norm_size": 1,
    "ffn_dim_divisor": 16,
    "ffn_multipliers": [1.0, 2.0],
    "gegelu_limit": 20.0,
    "dense_attention_every_n_layers": 2,
    "cla_share_factor": 2,
    "mamba_expand": 2,
    "attn_layer_offset": 4,
    "attn_layer_period": 8,
    "expert_layer_offset": 1,
    "expert_layer_period": 2,
    "zero_expert_num": 0,
    "zero_expert_type": "identity",
    "attention_method": "MLA",
    "block_multiple_of": 16,
    "block_ffn_dim_multiplier": 1.0,
    "norm_eps": 1e-5,
    "n_shared_head": 8,
    "num_kv_reuse_layers": 2,
}

# The depth of a checkpoint of the families whose ModelArgs has none (the leaks are per layer).
DEPTHS = {
    "qwen3_5": 64,
    "qwen3_5_moe": 48,
    "mamba2": 64,
    "lfm2": 16,
    "lfm2_moe": 24,
    "nemotron_h": 52,
    "granitemoehybrid": 40,
    "kimi_linear": 27,
    "qwen3_next": 48,
    "jamba": 32,
    "olmo_hybrid": 32,
    "bailing_hybrid": 32,
    "falcon_h1": 36,
    "recurrent_gemma": 26,
    "mamba": 64,
    "rwkv7": 24,
}
_ROPE = {
    "rope_theta": 10000.0,
    "rope_type": "default",
    "factor": 1.0,
    "original_max_position_embeddings": 4096,
    "llama_4_scaling_beta": 0.1,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "alpha": 1.0,
    "type": "default",
}


def _every(n: int, period: int, phase: int, hit: Any, miss: Any) -> list:
    return [hit if i % period == phase else miss for i in range(n)]


def _nemotron_h(n: int) -> list[str]:
    # Mamba2 (M) and MLP (-) blocks alternate; attention without RoPE (*) every 13th: 4 of 52.
    return ["*" if i % 13 == 7 else ("M" if i % 2 == 0 else "-") for i in range(n)]


def _kimi(n: int) -> dict:
    full = [4, 8, 12, 16, 20, 24, 27] if n == 27 else [i + 1 for i in range(n) if i % 4 == 3]
    return {
        "linear_attn_config": {
            "kda_layers": [i + 1 for i in range(n) if i + 1 not in full],
            "full_attn_layers": full,
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
        }
    }


# The layer pattern of the hybrid families: their layer-type fields, for ``layers`` layers.
# Each is a checkpoint's pattern, repeated (the ratio of layer kinds is the real one).
PATTERNS: dict[str, Callable[[int], dict[str, Any]]] = {
    # Nemotron-H 8B-like: Mamba2 (M), MLP (-), attention without RoPE (*): 4 attention of 52.
    "nemotron_h": lambda n: {"hybrid_override_pattern": _nemotron_h(n)},
    # Granite-4.0-H: mamba layers, every 6th attention (NoPE: position_embedding_type "nope").
    "granitemoehybrid": lambda n: {
        "layer_types": ["attention" if i % 6 == 5 else "mamba" for i in range(n)],
        "position_embedding_type": "nope",
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 32,
    },
    # Kimi-Linear: KDA layers, every 4th MLA (1-based layer numbers).
    "kimi_linear": _kimi,
    "kimi_k3": _kimi,
    "jamba": lambda n: {},  # attn_layer_offset/period give it
    "recurrent_gemma": lambda n: {"block_types": ["recurrent", "recurrent", "attention"]},
    "mimo_v2_flash": lambda n: {
        "hybrid_layer_pattern": _every(n, 6, 0, 0, 1),
        "moe_layer_freq": [0] + [1] * (n - 1),
    },
    "baichuan_m1": lambda n: {"sliding_window_layers": [i for i in range(n) if i % 2]},
    "exaone_moe": lambda n: {
        "layer_types": ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(n)],
        "is_moe_layer": [i > 0 for i in range(n)],
    },
    "mellum": lambda n: {
        "layer_types": _every(n, 4, 3, "full_attention", "sliding_attention"),
        "rope_parameters": {"full_attention": dict(_ROPE), "sliding_attention": dict(_ROPE)},
    },
    "gear": lambda n: {"layer_types": _every(n, 4, 3, "full_attention", "conv_mixer")},
    "deepseek_v2": lambda n: {"rope_scaling": dict(_ROPE, type="yarn")},
    "minicpm3": lambda n: {
        "rope_scaling": {
            "original_max_position_embeddings": 4096,
            "long_factor": [1.0] * 4,
            "short_factor": [1.0] * 4,
        }
    },
    "hunyuan": lambda n: {"rope_scaling": dict(_ROPE, type="dynamic"), "moe_intermediate_size": 32},
    "glm_moe_dsa": lambda n: {"rope_parameters": dict(_ROPE)},
    "ministral3": lambda n: {"rope_parameters": dict(_ROPE)},
    "mistral3": lambda n: {"rope_parameters": dict(_ROPE)},
    "mistral4": lambda n: {"rope_parameters": dict(_ROPE)},
    "longcat_flash": lambda n: {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": lambda n: {"mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "muse_spark": lambda n: {
        "rope_parameters": dict(_ROPE),
        "mlp_layer_types": ["sparse"] * n,
        "num_shared_experts": 0,
    },
    "openelm": lambda n: {"num_query_heads": [4] * n, "num_kv_heads": [2] * n, "ffn_multipliers": [2.0] * n},
    "plamo": lambda n: {"n_shared_head": 2},
    "spark2_5": lambda n: {
        "rope_parameters": {"full_attention": dict(_ROPE), "sliding_attention": dict(_ROPE)}
    },
    "llama4": lambda n: {"num_experts_per_tok": 1},
    "llama4_text": lambda n: {"num_experts_per_tok": 1, "no_rope_layers": _every(n, 4, 3, 0, 1)},
    "afmoe": lambda n: {
        "layer_types": ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(n)]
    },
    "lfm2": lambda n: {"full_attn_idxs": [i for i in range(n) if i % 3 == 2]},
    "lfm2_moe": lambda n: {"full_attn_idxs": [i for i in range(n) if i % 3 == 2]},
    "dbrx": lambda n: {
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
        "attn_config": {"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 10000.0},
    },
}


def families() -> list[str]:
    """The model families of the installed mlx-lm (modules with a Model and a ModelArgs class),
    sorted; found by the source text, so a module that fails to import is still listed."""
    import mlx_lm.models as models

    names = []
    for info in pkgutil.iter_modules(models.__path__):
        try:
            spec = importlib.util.find_spec(f"{models.__name__}.{info.name}")
            loader = spec.loader if spec is not None else None
            if not isinstance(loader, importlib.abc.InspectLoader):
                continue
            source = loader.get_source(f"{models.__name__}.{info.name}") or ""
        except Exception:
            continue
        if re.search(r"^class Model\(", source, re.M) and re.search(r"^class ModelArgs\(", source, re.M):
            names.append(info.name)
    return sorted(names)


def load(name: str):
    try:
        return importlib.import_module(f"mlx_lm.models.{name}")
    except SystemExit as exc:  # some modules exit on a missing optional package
        raise ImportError(f"importing mlx_lm.models.{name} exited ({exc})") from None


def _fields(args_class) -> dict[str, tuple[Any, Any]]:
    """name -> (default or MISSING, annotation)."""
    hints = {}
    try:
        hints = typing.get_type_hints(args_class)
    except Exception:
        pass
    out = {}
    for f in dataclasses.fields(args_class):
        default = f.default
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out[f.name] = (default, hints.get(f.name, f.type))
    return out


def _by_type(annotation: Any) -> Any:
    text = str(annotation).lower()
    if "bool" in text:
        return False
    if "int" in text:
        return 1
    if "float" in text:
        return 1e-5
    if "list" in text or "tuple" in text:
        return []
    if "dict" in text:
        return {}
    if "str" in text:
        return ""
    return None


def fill(args_class, name: str, layers: int | None = None, sizes: dict | None = None) -> dict:
    """A config dict for ``args_class`` (see the module's docstring); ``sizes`` replace some of
    ``SIZES`` (``{"head_dim": 32}``: a quantized KV cache needs rows of 32)."""
    size = dict(_SIZE, **(sizes or {}))
    config: dict[str, Any] = {}
    fields = _fields(args_class)
    for field, (default, annotation) in fields.items():
        if field in size and not (default is None and field in ("q_lora_rank", "n_shared_experts")):
            config[field] = size[field]
        elif field in LAYER_FIELDS:
            config[field] = (
                layers
                or DEPTHS.get(name)
                or (default if isinstance(default, int) and default > 0 else DEFAULT_LAYERS)
            )
        elif field.endswith(("eps", "epsilon")) and default is dataclasses.MISSING:
            config[field] = 1e-5
        elif field == "rope_theta" and default is None:
            config[field] = REQUIRED[field]
        elif default is not dataclasses.MISSING:
            continue  # the module's own default
        elif field in REQUIRED:
            config[field] = REQUIRED[field]
        else:
            config[field] = _by_type(annotation)
    if "model_type" in fields:
        config["model_type"] = name
    config["tie_word_embeddings"] = (
        False  # untied: greedy decoding of random weights does not repeat one token
    )
    depth = next((config[f] for f in LAYER_FIELDS if f in config), DEFAULT_LAYERS)
    if name in PATTERNS:
        config.update(PATTERNS[name](depth))
    return config


def _text_args(module, depth: int = 0) -> tuple[type, str] | None:
    """The ModelArgs class (and its family) a wrapper builds its text model from: named in its
    source, or in that of a sibling module it imports (qwen3_5_moe builds on qwen3_5)."""
    source = inspect.getsource(module)
    match = re.search(r"([\w.]+)\.from_dict\(\s*(?:args|self|config|params)\.text_config", source)
    if not match:
        for sibling in re.findall(r"^from \.(\w+) import", source, re.M) if depth == 0 else ():
            found = _text_args(load(sibling), depth + 1) if sibling not in ("base", "cache") else None
            if found is not None:
                return found
        return None
    target: Any = module
    for part in match.group(1).split("."):
        target = getattr(target, part, None)
    if not (isinstance(target, type) and dataclasses.is_dataclass(target)):
        return None
    home = target.__module__.rsplit(".", 1)[-1]
    return target, (
        home if home != module.__name__.rsplit(".", 1)[-1] else module.__name__.rsplit(".", 1)[-1]
    )


def family_config(name: str, layers: int | None = None, sizes: dict | None = None) -> dict:
    """The config dict ``build`` gives ``ModelArgs.from_dict`` (a wrapper's with its text_config)."""
    module = load(name)
    config = fill(module.ModelArgs, name, layers, sizes)
    if "text_config" in _fields(module.ModelArgs):
        text = _text_args(module)
        if text is None:  # its defaults would build the full-size model
            raise ValueError(f"{name}: a text_config wrapper whose text model's arguments were not found")
        args_class, text_name = text
        config["text_config"] = fill(args_class, text_name, layers or DEPTHS.get(name), sizes)
        if "vocab_size" in config:
            config["vocab_size"] = config["text_config"].get("vocab_size", 512)
    return config


def build(name: str, layers: int | None = None, seed: int = 0, sizes: dict | None = None):
    """(model, config): ``mlx_lm.models.<name>.Model`` built tiny with random weights."""
    import mlx.core as mx

    from .build import randomize

    module = load(name)
    config = family_config(name, layers, sizes)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    randomize(model)
    mx.eval(model.parameters())
    model.eval()
    return model, config
