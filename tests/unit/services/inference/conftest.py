"""A peaked tiny model and engines over it, for exactness tests of the generation engine (no
HTTP)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from leafe.learner.model_io import load_model, load_tokenizer, tiny_model_dir
from leafe.services.inference.decode import GenSequence, GenSpec, StopChecker
from leafe.services.inference.engine import GenerationEngine
from leafe.services.inference.prefix import PrefixCache


def perturbed_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """The model's weights with Gaussian noise on its matrices: next-token distributions become
    peaked (the random tiny model's are uniform, so greedy choices would be ties)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v if "norm" in k else v + 0.5 * torch.randn(v.shape, generator=gen)
        for k, v in model.state_dict().items()
    }


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(tiny_model_dir())


@pytest.fixture(scope="module")
def sharp_state() -> dict[str, torch.Tensor]:
    return perturbed_state(load_model(tiny_model_dir()), seed=0)


@dataclass
class Result:
    """What a request got back."""

    output_ids: list[int]
    logprobs: list[float]
    cached_tokens: int


EngineFactory = Callable[..., GenerationEngine]


@pytest.fixture
def make_engine(tokenizer: Any, sharp_state: dict[str, torch.Tensor]) -> Iterator[EngineFactory]:
    """``make_engine(cache_tokens=None, max_batch=16, batch_wait_s=0.005, **trims)``: a
    started engine over the peaked tiny model (``cache_tokens=None``: no prefix cache); stopped
    after the test."""
    engines: list[GenerationEngine] = []

    def make(
        cache_tokens: int | None = None,
        max_batch: int = 16,
        batch_wait_s: float = 0.005,
        trim_idle_s: float = 0.0,
        trim_growth_bytes: int = 0,
        trim_every_s: float = 0.0,
    ) -> GenerationEngine:
        model = load_model(tiny_model_dir())
        model.load_state_dict(sharp_state)
        engine = GenerationEngine(
            model,
            StopChecker(tokenizer, frozenset({int(tokenizer.eos_token_id)})),
            pad_id=int(tokenizer.pad_token_id),
            max_batch=max_batch,
            batch_wait_s=batch_wait_s,
            prefix_cache=PrefixCache(cache_tokens) if cache_tokens else None,
            trim_idle_s=trim_idle_s,
            trim_growth_bytes=trim_growth_bytes,
            trim_every_s=trim_every_s,
        )
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def submit(engine: GenerationEngine, prompt: list[int], new_tokens: int) -> Any:
    """One greedy request that generates exactly ``new_tokens`` tokens; returns its future."""
    spec = GenSpec(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return engine.submit([GenSequence(prompt=list(prompt), spec=spec)]).future


def generate(
    engine: GenerationEngine, prompts: Sequence[list[int]], new_tokens: int
) -> list[Result]:
    """Submit every prompt at once (one request each) and wait for all."""
    futures = [submit(engine, p, new_tokens) for p in prompts]
    return [_result(f.result(timeout=120)) for f in futures]


def _result(seqs: list[GenSequence]) -> Result:
    [s] = seqs
    return Result(
        output_ids=list(s.output_ids), logprobs=list(s.logprobs), cached_tokens=s.cached_tokens
    )


def alone(engine: GenerationEngine, prompts: Sequence[list[int]], new_tokens: int) -> list[Result]:
    """Each prompt on its own, one after another (the reference)."""
    return [generate(engine, [p], new_tokens)[0] for p in prompts]
