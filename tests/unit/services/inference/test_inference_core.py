"""Pure parts of the CPU inference server: /generate request validation, SGLang stop rules, seeded
sampling and prefill grouping. No model, no HTTP (the prefix tree:
``inference/test_prefix_tree.py``).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from leafe.services.inference.api import (
    RequestError,
    copy_seed,
    output_body,
    parse_generate,
    parse_sampling,
)
from leafe.services.inference.decode import GenSequence, GenSpec, StopChecker
from leafe.services.inference.prefill import PrefillRow, plan_chunks
from leafe.services.inference.prefix import PrefixMatch
from leafe.services.inference.sampling import choose_tokens

EOS = 0


class ByteTokenizer:
    """Token id = byte value + 1; id 0 is EOS (a special token)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = bytes(i - 1 for i in ids if i != EOS).decode("utf-8", "replace")
        return text if skip_special_tokens or EOS not in ids else text + "</s>"


def ids(text: str) -> list[int]:
    return [b + 1 for b in text.encode()]


def run(spec: GenSpec, tokens: list[int]) -> GenSequence:
    checker = StopChecker(ByteTokenizer(), frozenset({EOS}))
    seq = GenSequence(prompt=[1], spec=spec)
    for t in tokens:
        if checker.accept(seq, t, -1.0):
            break
    checker.finalize(seq)
    return seq


def parse(body: dict[str, Any], context_len: int = 64) -> Any:
    return parse_generate(
        body, encode=ids, vocab_size=300, context_len=context_len, max_text_bytes=context_len * 8
    )


# ---- request validation
# -----------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["seed", "max_tokens", "stop_sequences"])
def test_unknown_sampling_key_is_rejected_by_name(key: str) -> None:
    """Any key outside SGLang's SamplingParams is refused with SGLang's TypeError text naming it."""
    with pytest.raises(RequestError, match=re.escape(f"unexpected keyword argument '{key}'")):
        parse_sampling({key: 1}, context_left=10)


def test_unimplemented_sglang_keys_only_at_neutral_values() -> None:
    """SGLang keys we do not implement are accepted at their neutral value and refused otherwise."""
    spec, n = parse_sampling(
        {"min_p": 0.0, "repetition_penalty": 1.0, "regex": None}, context_left=50
    )
    assert n == 1 and spec.max_new_tokens == 50
    with pytest.raises(RequestError, match=re.escape("'frequency_penalty'=0.5 is not supported")):
        parse_sampling({"frequency_penalty": 0.5}, context_left=10)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": -1}, "temperature must be non-negative"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be -1"),
        ({"max_new_tokens": -2}, "max_new_tokens must be at least 0"),
        ({"n": 0}, "n must be at least 1"),
        ({"max_new_tokens": "many"}, "Invalid sampling_params"),
    ],
)
def test_out_of_range_values_are_named(params: dict[str, Any], message: str) -> None:
    """Bad values are 400s whose message names the field and value."""
    with pytest.raises(RequestError, match=message):
        parse_sampling(params, context_left=10)


def test_defaults_stop_forms_and_context_cap() -> None:
    """SGLang defaults (128 new tokens, temperature 1), a single stop string, and max_new_tokens
    capped at the room left in the context (None = all of it)."""
    spec, _ = parse_sampling({}, context_left=1000)
    assert (spec.max_new_tokens, spec.temperature, spec.top_k, spec.stop) == (128, 1.0, -1, ())
    spec, _ = parse_sampling(
        {"stop": "</a>", "stop_token_ids": [5], "max_new_tokens": 99}, context_left=7
    )
    assert spec.stop == ("</a>",) and spec.stop_token_ids == {5} and spec.max_new_tokens == 7
    assert parse_sampling({"max_new_tokens": None}, context_left=33)[0].max_new_tokens == 33


def test_generate_body_shapes() -> None:
    """Single ids, a batch with per-prompt params and rids, and text prompts are understood; n>1
    makes the response a list."""
    jobs, batched = parse({"input_ids": [1, 2, 3]})
    assert not batched and jobs[0].input_ids == [1, 2, 3] and jobs[0].rid is None
    jobs, batched = parse(
        {
            "input_ids": [[1], [2, 3]],
            "sampling_params": [{"n": 2}, {}],
            "rid": ["a", "b"],
            "return_logprob": [True, False],
        }
    )
    assert batched and [j.n for j in jobs] == [2, 1] and [j.rid for j in jobs] == ["a", "b"]
    assert [j.return_logprob for j in jobs] == [True, False]
    jobs, batched = parse({"text": "hi", "sampling_params": {"n": 3}})
    assert batched and jobs[0].input_ids == ids("hi")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "Either text or input_ids should be provided"),
        ({"text": "a", "input_ids": [1]}, "not both"),
        ({"input_ids": []}, "non-empty list"),
        (
            {"input_ids": [1, 300]},
            r"Token id 300 at position 1 is outside the vocabulary \(size 300\)",
        ),
        (
            {"input_ids": [1] * 64},
            r"The input \(64 tokens\) is longer than the model's context length \(64",
        ),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{}]},
            "sampling_params has 1 entries for 2 prompts",
        ),
        ({"input_ids": [1], "stream": True}, "stream=true is not supported"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_generate_bodies(body: Any, message: str) -> None:
    """Malformed bodies are RequestErrors (HTTP 400) that say what is wrong."""
    with pytest.raises(RequestError, match=message):
        parse(body)


def test_copy_seeds_and_output_body() -> None:
    """Copy 0 keeps the request's seed, other copies get distinct seeds; the response has SGLang's
    keys and logprob triples when asked."""
    assert copy_seed(7, 0) == 7 and copy_seed(None, 3) is None
    assert len({copy_seed(7, i) for i in range(5)}) == 5
    seq = run(GenSpec(max_new_tokens=2), [5, 6])
    body = output_body(seq, rid="r1", return_logprob=True)
    assert body["output_ids"] == [5, 6] and body["meta_info"]["id"] == "r1"
    assert body["meta_info"]["output_token_logprobs"] == [[-1.0, 5, None], [-1.0, 6, None]]
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert (
        "output_token_logprobs" not in output_body(seq, rid=None, return_logprob=False)["meta_info"]
    )


# ---- stop rules
# ---------------------------------------------------------------------------------------
def test_eos_is_kept_in_ids_and_left_out_of_text() -> None:
    """EOS ends generation: it is the last output id, matched in finish_reason, absent from text."""
    seq = run(GenSpec(max_new_tokens=9), [*ids("ok"), EOS, *ids("more")])
    assert seq.output_ids == [*ids("ok"), EOS] and seq.text == "ok"
    assert seq.finish == {"type": "stop", "matched": EOS}


def test_stop_token_ids_and_ignore_eos() -> None:
    """A stop token id ends generation and is trimmed from text (kept with no_stop_trim); ignore_eos
    disables both EOS and stop_token_ids."""
    stop = ids("!")[0]
    seq = run(GenSpec(max_new_tokens=9, stop_token_ids=frozenset({stop})), ids("hi!x"))
    assert (
        seq.output_ids == ids("hi!")
        and seq.text == "hi"
        and seq.finish == {"type": "stop", "matched": stop}
    )
    kept = run(
        GenSpec(max_new_tokens=9, stop_token_ids=frozenset({stop}), no_stop_trim=True), ids("hi!x")
    )
    assert kept.text == "hi!"
    free = run(
        GenSpec(max_new_tokens=5, stop_token_ids=frozenset({stop}), ignore_eos=True),
        [*ids("a!"), EOS, 9, 9],
    )
    assert len(free.output_ids) == 5 and free.finish == {"type": "length", "length": 5}


def test_stop_strings_cut_text_at_first_match() -> None:
    """The earliest stop string found in the decoded output ends generation; text is cut before
    it."""
    seq = run(GenSpec(max_new_tokens=30, stop=("</a>", "b")), ids("<a>up</a> and b"))
    assert seq.text == "<a>up" and seq.finish == {"type": "stop", "matched": "</a>"}
    assert seq.output_ids == ids("<a>up</a>")
    kept = run(GenSpec(max_new_tokens=30, stop=("</a>",), no_stop_trim=True), ids("<a>up</a>zz"))
    assert kept.text == "<a>up</a>"


def test_length_wins_on_the_last_token() -> None:
    """As in SGLang, reaching max_new_tokens is reported as length even if that token is EOS."""
    seq = run(GenSpec(max_new_tokens=2), [7, EOS])
    assert seq.finish == {"type": "length", "length": 2} and seq.output_ids == [7, EOS]


# ---- sampling
# -------------------------------------------------------------------------------------------
def test_greedy_and_seeded_sampling() -> None:
    """temperature 0 and top_k 1 pick the argmax; a seed fixes the sampled tokens; logprobs are
    log_softmax of the raw logits at the chosen tokens."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    greedy = [
        GenSequence(prompt=[1], spec=GenSpec(temperature=0.0)),
        GenSequence(prompt=[1], spec=GenSpec(top_k=1)),
    ]
    tokens, lps = choose_tokens(logits[:2], greedy)
    assert tokens == logits[:2].argmax(-1).tolist()
    assert lps == pytest.approx(torch.log_softmax(logits[:2], -1).max(-1).values.tolist())
    draws = [
        choose_tokens(logits, [GenSequence(prompt=[1], spec=GenSpec(seed=s)) for s in (4, 4, 5)])[0]
        for _ in range(2)
    ]
    assert draws[0] == draws[1]


def test_top_p_and_top_k_restrict_the_support() -> None:
    """Samples stay inside the top-k set and the nucleus; a tiny top_p leaves only the argmax."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    topk = {
        choose_tokens(logits, [GenSequence(prompt=[1], spec=GenSpec(top_k=2, seed=s))])[0][0]
        for s in range(40)
    }
    assert topk <= {0, 1} and len(topk) == 2
    nucleus = {
        choose_tokens(logits, [GenSequence(prompt=[1], spec=GenSpec(top_p=0.01, seed=s))])[0][0]
        for s in range(20)
    }
    assert nucleus == {0}


def _frequencies(logits: torch.Tensor, spec: GenSpec, draws: int = 4000) -> torch.Tensor:
    seqs = [
        GenSequence(prompt=[1], spec=GenSpec(**{**spec.__dict__, "seed": s})) for s in range(draws)
    ]
    tokens, _ = choose_tokens(logits.expand(draws, -1), seqs)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float() / draws


def test_sampling_follows_the_filtered_distribution() -> None:
    """Seeded Gumbel-max samples follow softmax(logits / T); with top_p the kept tokens (mass before
    them <= top_p, SGLang's rule) are sampled in proportion to their probabilities."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    freq = _frequencies(logits, GenSpec(temperature=2.0))
    assert torch.allclose(freq, torch.softmax(logits[0] / 2.0, -1), atol=0.03)
    nucleus = _frequencies(logits, GenSpec(top_p=0.8))
    expected = torch.softmax(logits[0, :2], -1)
    assert nucleus[2:].sum() == 0 and torch.allclose(nucleus[:2], expected, atol=0.03)


def test_flat_distributions_still_filter_exactly() -> None:
    """When no token is likely (a flat 12k-token distribution), top-k still keeps exactly the k
    best."""
    logits = torch.randn(1, 12000, generator=torch.Generator().manual_seed(0)) * 0.01
    best = set(torch.topk(logits[0], 3).indices.tolist())
    freq = _frequencies(logits, GenSpec(top_k=3), draws=40)
    assert set(freq.nonzero()[:, 0].tolist()) <= best


def _full_gumbel_choice(logits: torch.Tensor, spec: GenSpec) -> int:
    """The reference: Gumbel noise over the whole vocabulary from the row's seeded generator."""
    assert spec.seed is not None
    generator = torch.Generator().manual_seed(spec.seed)  # as GenSequence seeds it
    uniform = torch.rand(logits.shape[-1], generator=generator).clamp_(min=1e-20, max=1.0 - 1e-7)
    return int(torch.argmax(logits.float() / spec.temperature - torch.log(-torch.log(uniform))))


@pytest.mark.parametrize("scale", [0.01, 1.0, 5.0, 30.0])
def test_a_seeded_sample_is_the_gumbel_max_of_the_seeds_uniforms(scale: float) -> None:
    """The sampling contract that makes seeded runs reproducible across engines' batches and
    versions: the token is ``argmax(logits / T - log(-log(u)))`` with ``u`` the seed's uniforms over
    the whole vocabulary (SmolLM2's 49,152 tokens), for flat, peaked and very peaked logits."""
    vocab, draws = 49152, 48
    logits = torch.randn(draws, vocab, generator=torch.Generator().manual_seed(7)) * scale
    specs = [
        GenSpec(temperature=t, seed=s)
        for s, t in zip(range(draws), [0.7, 1.0, 1.3] * 16, strict=True)
    ]
    seqs = [GenSequence(prompt=[1], spec=spec) for spec in specs]
    tokens, _ = choose_tokens(logits, seqs)
    assert tokens == [_full_gumbel_choice(logits[i], spec) for i, spec in enumerate(specs)]


# ---- prefill grouping
# ----------------------------------------------------------------------------------
def test_prefill_chunks_bound_padding() -> None:
    """Distinct prompts are grouped by the number of tokens they still need (after their cached
    prefix), so a pass pads at most ~25% and stays under the token cap; a cached prefix does not
    count."""

    def row(length: int, cached: int = 0) -> PrefillRow:
        return PrefillRow(prompt=[1] * length, seqs=[], cached=PrefixMatch(cached))

    rows = [row(10), row(12), row(100), row(300, cached=200), row(400), row(420), row(430)]
    chunks = plan_chunks(rows, max_tokens=1000)
    assert [[r.suffix for r in c] for c in chunks] == [[10, 12], [100, 100], [400, 420], [430]]
