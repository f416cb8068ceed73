"""Which requests take their first token from prefill, and the sampling each leg then runs with."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from app.flow.first_token import after_seed, can_seed, prefill_sampling


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_greedy_requests_are_seeded_in_both_modes(mode):
    assert can_seed(SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, min_tokens=2), mode)


def test_local_requests_have_no_prefill_to_seed_from():
    assert not can_seed(SamplingParams(temperature=0), "local")


@pytest.mark.parametrize("fields", [{"presence_penalty": 0.5}, {"frequency_penalty": -0.2}, {"stop": ["\n\n"]}],
                         ids=["presence", "frequency", "stop-string"])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_requests_whose_output_would_change_are_not_seeded(mode, fields):
    assert not can_seed(SamplingParams(temperature=0, **fields), mode)


def test_a_grammar_or_bad_words_keep_pull_unseeded_but_not_greedy_push():
    structured = SamplingParams(temperature=0, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    bad_words = SamplingParams(temperature=0, bad_words=["the sea"])
    assert not can_seed(structured, "pull") and not can_seed(bad_words, "pull")
    assert can_seed(structured, "push") and can_seed(bad_words, "push")  # decode samples the first token again
    assert prefill_sampling(structured, False).structured_outputs is None  # its token is dropped: no grammar


def test_random_sampling_is_seeded_in_pull_only_without_a_seed():
    unseeded_random = SamplingParams(temperature=0.8)
    assert can_seed(unseeded_random, "pull")
    assert not can_seed(unseeded_random, "push")  # decode would draw its own first token
    assert not can_seed(SamplingParams(temperature=0.8, seed=7), "pull")  # the random stream would restart


def test_prefill_samples_one_token_under_the_requests_rules_only_when_seeded():
    request = SamplingParams(temperature=0, max_tokens=20, min_tokens=5)
    seeded, unseeded = prefill_sampling(request, True), prefill_sampling(request, False)
    assert (seeded.max_tokens, seeded.min_tokens) == (1, 1)  # EOS stays masked for the first token
    assert (unseeded.max_tokens, unseeded.min_tokens) == (1, 0)
    assert (request.max_tokens, request.min_tokens) == (20, 5)  # the request itself is untouched


def test_decode_continues_with_one_token_less_of_each_budget():
    params = after_seed(SamplingParams(temperature=0, max_tokens=20, min_tokens=5))
    assert (params.max_tokens, params.min_tokens) == (19, 4)
    assert after_seed(SamplingParams(max_tokens=2)).min_tokens == 0
