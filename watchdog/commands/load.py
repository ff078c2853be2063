"""The model a command is pointed at (``--model``): ``mlx_lm.load`` with errors a user can act on,
and the prompts encoded with its tokenizer."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .common import UsageError, local_model_problem, looks_local, package_version

DEFAULT_PROMPT = "The watchdog counts the buffers each decode step leaves behind."


def load_model(spec: str):
    """``mlx_lm.load(spec)`` with errors a user can act on. Returns (model, tokenizer, info)."""
    if not isinstance(spec, str) or not spec.strip():
        raise UsageError(f"--model must be a local model folder or a Hugging Face id, got {spec!r}")
    local = Path(os.path.expanduser(spec))
    problem = local_model_problem(spec)
    if problem is not None:
        raise UsageError(problem)
    target = str(local) if looks_local(spec) else spec
    model_type = _config_model_type(local / "config.json") if local.is_dir() else None
    import mlx_lm

    try:
        model, tokenizer, *_ = mlx_lm.load(target)
    except ValueError as exc:
        if "not supported" in str(exc).lower():
            raise UsageError(
                f"unknown model type {model_type or '?'!r} in {spec}: mlx-lm "
                f"{package_version('mlx-lm')} does not support it ({exc})"
            ) from exc
        raise UsageError(f"cannot load model {spec}: {exc}") from exc
    except Exception as exc:  # hub errors, missing weights, bad safetensors
        raise UsageError(f"cannot load model {spec}: {type(exc).__name__}: {exc}") from exc
    info = {"model_type": model_type or _model_type(model)}
    return model, tokenizer, info


def _config_model_type(path: Path) -> str | None:
    try:
        return str(json.loads(path.read_text()).get("model_type")) or None
    except Exception:
        return None


def _model_type(model: Any) -> str:
    args = getattr(model, "args", None)
    return str(getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1])


def encode_prompts(tokenizer, texts: Sequence[str] | None) -> list[list[int]]:
    """The token ids of each ``--prompt`` text (none given: ``DEFAULT_PROMPT``)."""
    texts = list(texts) if texts else [DEFAULT_PROMPT]
    prompts = []
    for text in texts:
        ids = list(tokenizer.encode(text))
        if not ids:
            raise UsageError(f"--prompt {text!r} encodes to no tokens")
        prompts.append([int(i) for i in ids])
    return prompts
