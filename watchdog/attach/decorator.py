"""``@watch``: a generate function with mlx-lm's calling convention, watched for each call."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from ..core.watchdog import Watchdog
from .model import Watching, check_options, watchdog_from


def watch(
    fn: Callable | None = None,
    *,
    watchdog: Watchdog | None = None,
    metrics_port: int | None = None,
    metrics_addr: str = "127.0.0.1",
    **options,
):
    """Decorator for generate functions with mlx-lm's convention
    ``fn(model, tokenizer, prompt, ..., prompt_cache=None, ...)``.

    Every forward pass of the call is observed. When the caller passes no ``prompt_cache`` and
    the function accepts one, the cache is built here with the model's own rules
    (``make_prompt_cache``), so the watchdog sees it from the first step. Works for plain
    functions and generators (the watchdog steps as items are consumed and detaches when the
    generator is closed). ``watchdog=`` shares one watchdog; otherwise one is created from
    ``options`` for the decorated function. ``metrics_port`` starts the metrics server once."""
    if fn is None:
        # Bad options fail here, at @watch(...), not later when a function is decorated.
        if watchdog is None:
            check_options(options)
        else:
            watchdog_from(watchdog, options)
        return functools.partial(
            watch, watchdog=watchdog, metrics_port=metrics_port, metrics_addr=metrics_addr, **options
        )
    watchdog = watchdog_from(watchdog, options)
    metrics_server = None
    if metrics_port is not None:
        from ..exporters.server import start_metrics_server

        metrics_server = start_metrics_server(metrics_port, addr=metrics_addr)
    signature = inspect.signature(fn)
    var_keyword = next(
        (p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None
    )
    takes_cache = "prompt_cache" in signature.parameters or var_keyword is not None

    def prepare(args, kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        # Options passed on through **kwargs (generate -> stream_generate) are given too.
        given = (
            {**bound.arguments.get(var_keyword, {}), **bound.arguments} if var_keyword else bound.arguments
        )
        model = given.get("model", args[0] if args else None)
        if model is None:
            raise TypeError(f"{fn.__name__}() was called without a model")
        if takes_cache and given.get("prompt_cache") is None and hasattr(model, "layers"):
            from mlx_lm.models.cache import make_prompt_cache

            draft = given.get("draft_model")
            if draft is not None:
                # Speculative decoding takes one list: the model's caches, then the draft's.
                cache = make_prompt_cache(model) + make_prompt_cache(draft)
            else:
                cache = make_prompt_cache(model, max_kv_size=given.get("max_kv_size"))
            if "prompt_cache" in signature.parameters or var_keyword is None:
                bound.arguments["prompt_cache"] = cache
            else:
                bound.arguments[var_keyword] = {**bound.arguments.get(var_keyword, {}), "prompt_cache": cache}
            return model, bound.args, bound.kwargs
        return model, args, kwargs

    if inspect.isgeneratorfunction(fn):

        @functools.wraps(fn)
        def generator_wrapper(*args, **kwargs):
            model, args, kwargs = prepare(args, kwargs)
            with Watching(model, watchdog):
                yield from fn(*args, **kwargs)

        # .metrics_server: its .port, when port 0 picked one
        generator_wrapper.__dict__.update(watchdog=watchdog, metrics_server=metrics_server)
        return generator_wrapper

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        model, args, kwargs = prepare(args, kwargs)
        with Watching(model, watchdog):
            return fn(*args, **kwargs)

    wrapper.__dict__.update(watchdog=watchdog, metrics_server=metrics_server)
    return wrapper
