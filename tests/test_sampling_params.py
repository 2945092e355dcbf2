"""SamplingParams: defaults, SGLang field names, and one clear error per invalid value."""

from __future__ import annotations

import math

import pytest

from sglite.sampling_params import SamplingParams

INVALID = [
    ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0"),
    ({"max_new_tokens": 1.5}, "max_new_tokens must be an integer"),
    ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    ({"min_new_tokens": -2}, "min_new_tokens must be an integer >= 0"),
    ({"min_new_tokens": 5, "max_new_tokens": 4}, r"min_new_tokens \(5\) must not exceed"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": math.inf}, "temperature must be a finite number"),
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"temperature": "hot"}, "temperature must be a finite number"),
    ({"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\]"),
    ({"top_p": 1.01}, r"top_p must be in \(0.0, 1.0\]"),
    ({"top_p": math.nan}, "top_p must be a finite number"),
    ({"top_k": 0}, "top_k must be -1 .disabled. or an integer >= 1"),
    ({"top_k": -2}, "top_k must be -1"),
    ({"top_k": 2.0}, "top_k must be -1"),
    ({"min_p": -0.1}, r"min_p must be in \[0.0, 1.0\]"),
    ({"min_p": 1.5}, r"min_p must be in \[0.0, 1.0\]"),
    ({"frequency_penalty": 2.5}, r"frequency_penalty must be in \[-2.0, 2.0\]"),
    ({"frequency_penalty": -3}, "frequency_penalty must be in"),
    ({"presence_penalty": -2.01}, r"presence_penalty must be in \[-2.0, 2.0\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0.0, 2.0\]"),
    ({"repetition_penalty": 2.5}, "repetition_penalty must be in"),
    ({"stop": ""}, "stop must be a non-empty string or a list"),
    ({"stop": ["ok", 3]}, "stop must be a non-empty string or a list"),
    ({"stop": 7}, "stop must be a non-empty string or a list"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids must be a list of integers >= 0"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids must be a list"),
    ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
    ({"skip_special_tokens": 1}, "skip_special_tokens must be true or false"),
    ({"no_stop_trim": None}, "no_stop_trim must be true or false"),
    ({"seed": 1.5}, "seed must be an integer or null"),
    ({"seed": "7"}, "seed must be an integer or null"),
    ({"logit_bias": [1]}, "logit_bias must be an object"),
    ({"logit_bias": {"a": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 101}}, r"logit_bias\[5\] must be in \[-100.0, 100.0\]"),
    ({"logit_bias": {"5": "x"}}, r"logit_bias\[5\] must be a finite number"),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=lambda v: str(v)[:40])
def test_invalid_values_raise_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=message):
        SamplingParams.from_dict(kwargs)


def test_defaults_follow_sglang():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.min_new_tokens, p.stop, p.stop_token_ids, p.seed) == (0, None, None, None)
    assert (p.ignore_eos, p.skip_special_tokens, p.no_stop_trim) == (False, True, False)
    assert not p.is_greedy


def test_valid_edges_are_accepted():
    p = SamplingParams(
        max_new_tokens=0,
        temperature=0,
        top_p=1,
        top_k=1,
        min_p=1,
        frequency_penalty=-2,
        presence_penalty=2,
        repetition_penalty=2,
        stop=["a", "bc"],
        stop_token_ids=[0, 5],
        seed=-3,
    )
    assert p.is_greedy and p.stop_strs == ("a", "bc")
    assert SamplingParams(stop="x").stop_strs == ("x",)
    assert SamplingParams(top_k=1).is_greedy and SamplingParams(temperature=1e-9).is_greedy


def test_from_dict_rejects_unknown_keys_and_round_trips():
    with pytest.raises(ValueError, match="unknown sampling parameter.*'max_tokens'.*known:"):
        SamplingParams.from_dict({"max_tokens": 5})
    with pytest.raises(ValueError, match="sampling_params must be an object"):
        SamplingParams.from_dict([1])
    p = SamplingParams.from_dict({"temperature": 0.5, "top_k": 4, "stop": "\n"})
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_check_vocab_rejects_out_of_range_stop_ids():
    SamplingParams(stop_token_ids=[9]).check_vocab(10)
    with pytest.raises(ValueError, match=r"stop_token_ids \[10\] are out of range .* 10 tokens"):
        SamplingParams(stop_token_ids=[3, 10]).check_vocab(10)


def test_check_vocab_rejects_out_of_range_logit_bias_ids():
    SamplingParams(logit_bias={"9": 1.0, 3: -2}).check_vocab(10)
    with pytest.raises(ValueError, match=r"logit_bias token ids \[12\] are out of range"):
        SamplingParams(logit_bias={"12": 1.0}).check_vocab(10)


def test_model_defaults_come_from_generation_config(tmp_path):
    import json

    from sglite.sampling_params import model_sampling_defaults

    assert model_sampling_defaults(tmp_path) == {}  # no file
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 0, "min_p": 7, "do_sample": True})
    )
    # top_k 0 is transformers' "off"; an invalid value (min_p 7) is not a default
    assert model_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": -1}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert model_sampling_defaults(tmp_path) == {}


def test_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.3
