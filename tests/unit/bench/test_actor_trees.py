"""bench/actor_trees.py: the Stage 1 workload rebuilt from a shipped log is exactly what the actors
sent (every prompt's hash checked), and a log that does not rebuild is refused, not replayed
approximately."""

from __future__ import annotations

import msgspec
import pytest

from bench.actor_trees import LOG, WorkloadError, workload_from_log
from bench.inference_workload import ideal_prefix_share
from leafe.learner.model_io import HFChatTokenizer, tiny_model_dir
from leafe.protocol.events import EpisodeStarted, Reflection, Step
from leafe.services.eventlog.fileformat import read_events


@pytest.fixture(scope="module")
def head() -> list:
    """Every event of the shipped log's first three trees, in stream order (the trees
    interleave)."""
    events = list(read_events(LOG))
    first = list(dict.fromkeys(e.episode_id for e in events if isinstance(e, EpisodeStarted)))[:3]
    return [e for e in events if e.episode_id in first]


def test_the_requests_of_the_first_trees_are_rebuilt_exactly(head: list) -> None:
    tok = HFChatTokenizer.from_dir(tiny_model_dir())
    requests, kinds = workload_from_log(head, 2, tok)
    first = set(
        list(dict.fromkeys(e.episode_id for e in head if isinstance(e, EpisodeStarted)))[:2]
    )
    sent = [
        e
        for e in head
        if e.episode_id in first and isinstance(e, Step | Reflection) and e.prompt_sha256
    ]
    assert len(requests) == len(sent) > 50 and {"root_step", "branch_step", "reflection"} == set(
        kinds
    )
    assert [r.order for r in requests] == list(range(len(requests)))
    for episode in range(2):
        mine = [r.turn for r in requests if r.episode == episode]
        assert mine == list(range(len(mine)))
    assert [r.completion_tokens for r in requests] == [max(1, len(e.token_ids)) for e in sent]
    assert [
        len(r.input_ids) for r, e in zip(requests, sent, strict=True) if isinstance(e, Step)
    ] == [e.prompt_tokens for e in sent if isinstance(e, Step)]


def test_a_log_whose_prompts_do_not_rebuild_is_refused(head: list) -> None:
    tok = HFChatTokenizer.from_dir(tiny_model_dir())
    i = next(i for i, e in enumerate(head) if isinstance(e, Step) and e.t == 0)
    tampered = [*head[:i], msgspec.structs.replace(head[i], observation="#####"), *head[i + 1 :]]
    with pytest.raises(WorkloadError, match="not the one the actor sent"):
        workload_from_log(tampered, 2, tok)
    with pytest.raises(WorkloadError, match="holds 3 episodes; asked for 4"):
        workload_from_log(head, 4, tok)


def test_the_ceiling_per_kind_counts_every_earlier_prompt() -> None:
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5], [9, 9], [1, 2, 7, 7]]
    assert ideal_prefix_share(prompts, [True] * 4) == ideal_prefix_share(prompts)
    # the second prompt alone: 3 of its 4 tokens were in the first
    assert ideal_prefix_share(prompts, [False, True, False, False]) == 0.75
