"""EngineConfig and SamplingParams: frozen, validated once on creation, ConfigError with a hint."""

from __future__ import annotations

import dataclasses

import hypothesis.strategies as st
import pytest
from hypothesis import given

from tiered import EngineConfig, SamplingParams
from tiered.errors import ConfigError, TieredError


def test_engine_config_defaults():
    c = EngineConfig()
    assert (c.dtype, c.decode_weights, c.max_context, c.num_threads) == ("auto", "auto", None, None)
    assert c.decode_weights_threshold >= 1


@pytest.mark.parametrize("kwargs", [
    dict(dtype="float16"), dict(dtype="fp32"), dict(decode_weights="int3"), dict(decode_weights="FP32"),
    dict(decode_weights_threshold=0), dict(max_context=0), dict(max_context=-5), dict(num_threads=0),
])
def test_engine_config_rejects(kwargs):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert isinstance(e.value, TieredError) and e.value.hint
    assert next(iter(kwargs)).split("_")[0] in e.value.message


@given(st.sampled_from(["auto", "float32", "bfloat16"]), st.sampled_from(["auto", "fp32", "bf16", "int4"]),
       st.integers(1, 10_000), st.none() | st.integers(1, 1 << 20), st.none() | st.integers(1, 256))
def test_engine_config_accepts_valid(dtype, dw, thr, ctx, threads):
    c = EngineConfig(dtype=dtype, decode_weights=dw, decode_weights_threshold=thr, max_context=ctx,
                     num_threads=threads)
    assert c.max_context == ctx


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().dtype = "bfloat16"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.0  # type: ignore[misc]


def test_sampling_params_defaults():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty) == (128, 1.0, 0, 1.0, 0.0, 1.0)
    assert p.seed is None and p.stop == () and p.stop_token_ids == () and not p.ignore_eos


@pytest.mark.parametrize("kwargs,word", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"), (dict(top_k=-1), "top_k"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(stop=("ok", "")), "stop"), (dict(stop=""), "stop"),
])
def test_sampling_params_reject(kwargs, word):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kwargs)
    assert word in e.value.message and e.value.hint


def test_sampling_params_normalize_stop_lists():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    hash(SamplingParams(stop=["a"], stop_token_ids=[1]))  # hashable once normalized


@given(st.integers(1, 4096), st.floats(0, 5), st.integers(0, 1000), st.floats(0.001, 1.0),
       st.floats(0.0, 1.0), st.floats(0.01, 10), st.none() | st.integers(0, 2**32),
       st.lists(st.text(min_size=1, max_size=5), max_size=3))
def test_sampling_params_accept_valid(max_tokens, t, k, p, min_p, rep, seed, stop):
    sp = SamplingParams(max_tokens=max_tokens, temperature=t, top_k=k, top_p=p, min_p=min_p,
                        repetition_penalty=rep, seed=seed, stop=stop)
    assert sp.stop == tuple(stop)


def test_threads_beyond_the_cores_are_capped():
    """An OpenMP team of 4096 threads on 2 cores crashed torch later in the process: plans cap it."""
    from tiered.config import cpu_threads, usable_cores

    assert cpu_threads(EngineConfig(num_threads=4096)) == usable_cores()
    assert cpu_threads(EngineConfig(num_threads=1)) == 1
