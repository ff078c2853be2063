"""Tiny random-weight mlx-lm models, tokenizers and model folders: for the demo, tests and
benchmarks, nothing downloaded (``build.py``); ``families.py`` builds every architecture the
installed mlx-lm ships, tiny (``mlx-watchdog scan``)."""

from .build import (
    CHAT_TEMPLATE,
    EOS_ID,
    EOS_TOKEN,
    MODEL_TYPES,
    MOE_TYPES,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    build_model,
    build_tokenizer,
    missing_model_types,
    randomize,
    save_model_dir,
    tiny_config,
    tiny_prompts,
)

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_ID",
    "EOS_TOKEN",
    "MODEL_TYPES",
    "MOE_TYPES",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "build_model",
    "build_tokenizer",
    "missing_model_types",
    "randomize",
    "save_model_dir",
    "tiny_config",
    "tiny_prompts",
]
