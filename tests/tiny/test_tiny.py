"""Tests of mlx_watchdog.tiny: tiny random-weight mlx-lm models, run offline."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generate_step, stream_generate
from mlx_lm.models.cache import (
    ArraysCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from support import mlx_says_evaluated, model_type_params, needs_model_type

from mlx_watchdog import tiny

# deepseek_v41's LayerCache has no merge/filter/extend, so BatchGenerator
# cannot batch it (mlx-lm 0.32.2; mlx-lm 0.31 has no deepseek_v41); see
# test_deepseek_v41_batch_generator.
BATCHABLE = [t for t in tiny.MODEL_TYPES if t != "deepseek_v41"]


def _has_none(value):
    if value is None:
        return True
    if isinstance(value, dict):
        return any(_has_none(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_none(v) for v in value)
    return False


def _greedy(model, prompt, n, **kwargs):
    steps = generate_step(mx.array(prompt), model, max_tokens=n, **kwargs)
    return [token for token, _ in steps]


@pytest.mark.parametrize("model_type", tiny.MODEL_TYPES)
def test_config_is_json_without_none(model_type):
    config = tiny.tiny_config(model_type, layers=4)
    assert config["model_type"] == model_type
    assert config["num_hidden_layers"] == 4
    assert config["vocab_size"] <= 512 and config["hidden_size"] <= 64
    assert not _has_none(config)
    assert json.loads(json.dumps(config)) == config


def test_config_overrides_and_errors():
    assert tiny.tiny_config("llama", 2, vocab_size=300)["vocab_size"] == 300
    assert "rope_scaling" not in tiny.tiny_config("llama", 2, rope_scaling=None)
    with pytest.raises(ValueError, match="'gpt9'.*llama.*qwen3_next"):
        tiny.tiny_config("gpt9")
    with pytest.raises(ValueError, match="full_attention_interval"):
        tiny.tiny_config("qwen3_next", layers=3)


def test_qwen3_next_is_hybrid():
    model = tiny.build_model("qwen3_next", layers=8)
    linear = [layer.is_linear for layer in model.layers]
    assert linear == [True, True, True, False] * 2
    assert sum(isinstance(c, ArraysCache) for c in model.make_cache()) == 6


@needs_model_type("deepseek_v41")
def test_deepseek_v41_is_tiny_and_compresses():
    config = tiny.tiny_config("deepseek_v41", layers=4)
    assert config["compress_ratios"] == [0, 2, 4, 2]
    model = tiny.build_model("deepseek_v41", layers=4)
    assert sum(p.size for _, p in tree_flatten(model.parameters())) < 2_000_000
    cache = model.make_cache()
    prompt = tiny.tiny_prompts(1, 5, 512)[0]
    tokens = _greedy(model, prompt, 12, prompt_cache=cache)
    assert len(tokens) == 12
    # The last sampled token is fed too (generate_step runs one step ahead).
    assert cache[0].offset == 5 + 12
    assert cache[0].window.shape[1] == 8 and cache[0].compress_kv is None
    for layer, ratio in ((1, 2), (2, 4)):
        assert cache[layer].compress_kv.shape[1] == 17 // ratio
        assert cache[layer].pending_kv.shape[1] == 17 % ratio


def test_build_model_is_deterministic():
    def params(seed):
        return tree_flatten(tiny.build_model("qwen3_moe", 2, seed=seed).parameters())

    a, b, c = params(0), params(0), params(1)
    assert all(mx.array_equal(x, y) for (_, x), (_, y) in zip(a, b))
    assert not all(mx.array_equal(x, y) for (_, x), (_, y) in zip(a, c))
    assert all(mlx_says_evaluated(p) for _, p in a)


def test_build_model_dtype():
    model = tiny.build_model("llama", 2, dtype=mx.bfloat16)
    assert {p.dtype for _, p in tree_flatten(model.parameters())} == {mx.bfloat16}
    assert len(_greedy(model, [1, 2, 3], 3)) == 3
    with pytest.raises(ValueError, match="float32"):
        tiny.build_model("qwen3_moe", 2, dtype=mx.bfloat16)


@pytest.mark.parametrize("model_type", model_type_params(tiny.MODEL_TYPES))
def test_greedy_decoding(model_type):
    layers = 8 if model_type == "qwen3_next" else 4
    model = tiny.build_model(model_type, layers=layers)
    prompt = tiny.tiny_prompts(1, 12, 512)[0]
    tokens = _greedy(model, prompt, 20)
    assert len(tokens) == 20
    assert all(0 <= t < 512 for t in tokens)
    assert len(set(tokens)) > 1
    assert _greedy(model, prompt, 20) == tokens


@pytest.mark.parametrize("model_type", model_type_params(BATCHABLE))
def test_batch_generator(model_type):
    layers = 8 if model_type == "qwen3_next" else 4
    model = tiny.build_model(model_type, layers=layers)
    # Different lengths, so the prompts are padded.
    prompts = [p[:n] for p, n in zip(tiny.tiny_prompts(3, 9, 512), (9, 5, 7))]
    gen = BatchGenerator(model, max_tokens=6)
    uids = gen.insert(prompts)
    tokens = {uid: [] for uid in uids}
    finished = {}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            if r.finish_reason is not None:
                finished[r.uid] = r.finish_reason
    gen.close()
    assert finished == {uid: "length" for uid in uids}
    assert all(len(t) == 6 and all(0 <= x < 512 for x in t) for t in tokens.values())


@needs_model_type("deepseek_v41")
def test_deepseek_v41_batch_generator():
    # Not supported by mlx-lm 0.32.2: its LayerCache cannot be merged.
    model = tiny.build_model("deepseek_v41", layers=2)
    gen = BatchGenerator(model, max_tokens=4)
    gen.insert(tiny.tiny_prompts(2, 5, 512))
    with pytest.raises(ValueError, match="does not yet support batching"):
        gen.next_generated()
    gen.close()


def test_a_model_type_the_installed_mlx_lm_lacks_is_named_and_not_built():
    import importlib.util

    import mlx_lm

    lacking = tiny.missing_model_types()
    for model_type in tiny.MODEL_TYPES:
        present = importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None
        assert (model_type in lacking) != present, model_type
    major, minor = (int(part) for part in mlx_lm.__version__.split(".")[:2])
    assert ("deepseek_v41" in lacking) == ((major, minor) < (0, 32)), (mlx_lm.__version__, lacking)
    for model_type, reason in lacking.items():
        assert reason == f"mlx-lm {mlx_lm.__version__} has no mlx_lm.models.{model_type}"
        with pytest.raises(ValueError, match=f"^mlx-lm .* has no mlx_lm.models.{model_type}$"):
            tiny.build_model(model_type, layers=4)


def test_qwen3_next_batch_left_padding_stays_lazy():
    """Equal-length prompts keep ArraysCache.left_padding, which each decode
    step lowers without evaluating it."""
    model = tiny.build_model("qwen3_next", layers=8)
    gen = BatchGenerator(model, max_tokens=5)
    gen.insert(tiny.tiny_prompts(3, 6, 512))
    for _ in range(3):
        assert gen.next_generated()
        caches = gen._generation_batch.prompt_cache
        arrays = [c for c in caches if isinstance(c, ArraysCache)]
        assert len(caches) == 8 and len(arrays) == 6
        assert not any(mlx_says_evaluated(c.left_padding) for c in arrays)
    gen.close()


def test_tiny_prompts():
    prompts = tiny.tiny_prompts(4, 10, 300, seed=3)
    assert prompts == tiny.tiny_prompts(4, 10, 300, seed=3)
    assert prompts != tiny.tiny_prompts(4, 10, 300, seed=4)
    assert [len(p) for p in prompts] == [10] * 4
    ids = {t for p in prompts for t in p}
    assert ids <= set(range(300)) - {256, 257, 258}


def test_tokenizer():
    tok = tiny.build_tokenizer(400)
    assert tok.get_vocab_size() == 400
    assert tok.token_to_id(tiny.EOS_TOKEN) == tiny.EOS_ID
    ids = tok.encode("<|im_start|>user\nhi there<|im_end|>").ids
    assert ids[0] == 257 and ids[-1] == tiny.EOS_ID
    assert tok.decode(ids) == "user\nhi there"
    with pytest.raises(ValueError):
        tiny.build_tokenizer(100)


_TOKENIZER_300 = tiny.build_tokenizer(300)


@settings(max_examples=50, deadline=None, database=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_tokenizer_round_trip(text):
    ids = _TOKENIZER_300.encode(text).ids
    assert all(0 <= i < 300 for i in ids)
    assert _TOKENIZER_300.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("model_type", model_type_params(tiny.MODEL_TYPES))
def test_save_and_load(tmp_path, monkeypatch, model_type):
    import mlx_lm

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    layers = 4
    path = tiny.save_model_dir(tmp_path / "model", model_type, layers=layers, seed=5)
    config = json.loads((path / "config.json").read_text())
    assert not _has_none(config)
    model, tokenizer = mlx_lm.load(str(path))

    prompt = mx.array(tiny.tiny_prompts(1, 6, 512)[0])[None]
    expected = tiny.build_model(model_type, layers=layers, seed=5)(prompt)
    assert mx.allclose(model(prompt), expected)

    ids = tokenizer.encode("hello world")
    assert all(0 <= i < 512 for i in ids)
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.eos_token_ids == {tiny.EOS_ID}
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    responses = list(stream_generate(model, tokenizer, "hello", max_tokens=8))
    assert 1 <= len(responses) <= 8
    assert isinstance("".join(r.text for r in responses), str)


def test_llama_max_kv_size():
    model = tiny.build_model("llama", layers=2)
    tokenizer = _wrapped_tokenizer()
    prompt = tiny.tiny_prompts(1, 10, 512)[0]
    out = stream_generate(model, tokenizer, prompt, max_tokens=20, max_kv_size=16)
    assert len(list(out)) >= 1
    # llama.Model.make_cache takes precedence over max_kv_size, so pass the
    # rotating cache explicitly (models without make_cache, like qwen3, get
    # it from max_kv_size).
    cache = [RotatingKVCache(max_size=16, keep=4) for _ in model.layers]
    assert len(_greedy(model, prompt, 20, prompt_cache=cache)) == 20
    assert cache[0].offset == len(prompt) + 20 and cache[0].keys.shape[2] == 16
    qwen3 = tiny.build_model("qwen3", layers=2)
    assert isinstance(make_prompt_cache(qwen3, max_kv_size=16)[0], RotatingKVCache)


def test_llama_quantized_kv_cache():
    model = tiny.build_model("llama", layers=2)
    prompt = tiny.tiny_prompts(1, 10, 512)[0]
    cache = make_prompt_cache(model)
    quantize = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}
    assert len(_greedy(model, prompt, 20, prompt_cache=cache, **quantize)) == 20
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 4 for c in cache)
    out = stream_generate(model, _wrapped_tokenizer(), prompt, max_tokens=8, **quantize)
    assert len(list(out)) >= 1


def _wrapped_tokenizer():
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tiny.build_tokenizer(512), eos_token=tiny.EOS_TOKEN)
    return TokenizerWrapper(fast)
