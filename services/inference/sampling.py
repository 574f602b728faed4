"""Next-token choice for the CPU inference server: greedy, or seeded sampling with temperature,
top-k and top-p (SGLang's rules), batched over rows that each own a ``torch.Generator``.

Sampling is Gumbel-max: every sampled row draws one uniform per vocabulary entry from its own
generator (seeded by ``sampling_seed``), indexed by token id, and takes the argmax of ``logits / T +
noise`` over the allowed tokens. So a seeded request gives the same tokens whatever else shares its
batch: the choice flips only if the top two perturbed scores differ by less than the float noise of
batched matmuls, which is rare, unlike inverse-CDF sampling over a 49k-token vocabulary.

As in SGLang, top-k and top-p both apply to the temperature-scaled distribution: a token is kept
when its rank is below top_k and the probability mass before it is at most top_p. Reported logprobs
are ``log_softmax`` of the raw logits (temperature 1, before filtering), as SGLang reports them by
default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from leafe.services.inference.decode import GenSequence, GenSpec

__all__ = ["choose_tokens"]

_THRESHOLDS = (1e-4, 1e-6, 0.0)
"""Probability floors tried for the candidate set of top-k/top-p: the first whose candidates already
decide the cut (hold top_k tokens, or top_p of the mass) is exact, since every token left out is
less likely than every candidate; 0.0 is a full sort of the vocabulary."""


def _gumbel(vocab: int, generator: torch.Generator) -> torch.Tensor:
    uniform = torch.rand(vocab, generator=generator).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def _filtered_choice(
    scores: torch.Tensor, probs: torch.Tensor, noise: torch.Tensor, spec: GenSpec
) -> int:
    """Gumbel-max within top-k/top-p, sorting only the likely tokens (a full sort of the vocabulary
    costs milliseconds per row, ``torch.topk`` with a large k even more)."""
    for floor in _THRESHOLDS:
        cand = (probs >= floor).nonzero()[:, 0]
        if (0 < spec.top_k <= len(cand)) or (
            spec.top_p < 1.0 and float(probs[cand].sum()) >= spec.top_p
        ):
            break
    p_sorted, order = torch.sort(probs[cand], descending=True)
    idx = cand[order]
    keep = (torch.cumsum(p_sorted, dim=0) - p_sorted) <= spec.top_p
    if spec.top_k > 0:
        keep &= torch.arange(len(idx)) < spec.top_k
    perturbed = (scores[idx] + noise[idx]).masked_fill(~keep, float("-inf"))
    return int(idx[int(torch.argmax(perturbed))])


def _sample(scores: torch.Tensor, noise: torch.Tensor, specs: list[GenSpec]) -> list[int]:
    """Gumbel-max over ``scores`` ``[R, V]`` (already divided by temperature) within top-k/top-p."""
    vocab = scores.shape[-1]
    choice = [int(t) for t in torch.argmax(scores + noise, dim=-1).tolist()]
    filtered = [row for row, spec in enumerate(specs) if 0 < spec.top_k < vocab or spec.top_p < 1.0]
    if filtered:
        probs = torch.softmax(scores[filtered], dim=-1)
        for j, row in enumerate(filtered):
            choice[row] = _filtered_choice(scores[row], probs[j], noise[row], specs[row])
    return choice


def choose_tokens(
    logits: torch.Tensor, seqs: Sequence[GenSequence]
) -> tuple[list[int], list[float]]:
    """Next token of each row of ``logits`` ``[B, V]`` and its logprob under the raw logits."""
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    rows = [i for i, s in enumerate(seqs) if s.spec.temperature > 0.0 and s.spec.top_k != 1]
    if rows:
        vocab = logits.shape[-1]
        noise = torch.stack([_gumbel(vocab, seqs[i].generator) for i in rows])
        temps = torch.tensor([seqs[i].spec.temperature for i in rows], dtype=logits.dtype)[:, None]
        sampled = _sample(logits[rows] / temps, noise, [seqs[i].spec for i in rows])
        for i, tok in zip(rows, sampled, strict=True):
            tokens[i] = tok
    picked = logprobs.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    return tokens, picked
