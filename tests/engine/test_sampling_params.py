from __future__ import annotations

import math

import pytest

from chatserve.sampling_params import SamplingParams

# (kwargs, field the error message must name)
INVALID: list[tuple[dict[str, object], str]] = [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"n": True}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": "1"}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # 0 in float32: -inf * 0 = NaN logits
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": None}, "frequency_penalty"),
    ({"seed": 1.0}, "seed"),
    ({"seed": "7"}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 10.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"output_kind": "stream"}, "output_kind"),
]


@pytest.mark.parametrize(("kwargs", "field"), INVALID, ids=[f"{f}={k[f]!r}" for k, f in INVALID])
def test_every_validation_error_names_its_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_error_message_shows_the_bad_value() -> None:
    with pytest.raises(ValueError, match=r"temperature must be >= 0.*got -1"):
        SamplingParams(temperature=-1)


def test_defaults_are_valid_and_normalised() -> None:
    params = SamplingParams()
    assert params.stop == []
    assert params.stop_token_ids == []
    assert params.max_tokens == 16
    assert params.top_k == 0
    assert not params.is_greedy
    assert not params.has_penalties


@pytest.mark.parametrize(
    ("stop", "expected"),
    [(None, []), ("###", ["###"]), (["a", "b"], ["a", "b"]), (("x",), ["x"])],
)
def test_stop_is_normalised_to_a_list(stop: object, expected: list[str]) -> None:
    assert SamplingParams(stop=stop).stop == expected  # type: ignore[arg-type]


def test_stop_token_ids_are_normalised_to_a_list() -> None:
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]  # type: ignore[arg-type]


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=0).top_k == 0
    assert SamplingParams(top_k=40).top_k == 40


def test_ints_are_accepted_for_floats_and_become_floats() -> None:
    params = SamplingParams(temperature=1, top_p=1, presence_penalty=-2, frequency_penalty=2)
    assert isinstance(params.temperature, float) and params.temperature == 1.0
    assert isinstance(params.presence_penalty, float)


def test_edge_values_are_accepted() -> None:
    SamplingParams(temperature=0, top_p=1.0, min_p=1.0, presence_penalty=2.0, frequency_penalty=-2.0)
    SamplingParams(max_tokens=None, min_tokens=1000, logprobs=0)
    SamplingParams(max_tokens=5, min_tokens=5, logprobs=20, seed=-1)
    for kind in ("cumulative", "delta", "final_only"):
        SamplingParams(output_kind=kind)  # type: ignore[arg-type]


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


def test_has_penalties() -> None:
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties


def test_clone_is_deep_and_equal() -> None:
    params = SamplingParams(stop=["a"], stop_token_ids=[1], seed=3)
    copy = params.clone()
    assert copy == params
    copy.stop.append("b")  # type: ignore[union-attr]
    copy.stop_token_ids.append(2)  # type: ignore[union-attr]
    copy.max_tokens = 99
    assert params.stop == ["a"] and params.stop_token_ids == [1] and params.max_tokens == 16


def test_top_k_beyond_int32_is_refused_per_request():
    """Regression: 10**26 passed validation and then overflowed the batched sampler, killing the step."""
    import pytest

    from chatserve import SamplingParams

    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=10**26)
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
