"""Action and reflection parsing: lenient, but exact about what was accepted and how."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leafe.actors.parsing import (
    ParsedAction,
    format_reflection,
    invalid_action_feedback,
    parse_action,
    parse_reflection,
)
from leafe.protocol.reflection import ANSWER_TAG

MOVES = ["up", "down", "left", "right"]


@pytest.mark.parametrize(
    ("text", "action", "method"),
    [
        ("<action>up</action>", "up", "tag"),
        ("<action> Left. </action>", "left", "tag"),
        ("<ACTION>down", "down", "tag"),  # closing tag cut by the stop string
        ("<action>move up</action>", "up", "tag_mention"),
        ("<action>jump</action> well, I would rather go down", "down", "mention"),
        ("I think moving Right is best, then up.", "right", "mention"),
        ("Let's go: up-left", "up", "mention"),
        ("upward is not a move; down is", "down", "mention"),
    ],
)
def test_action_rules_in_order_with_known_valid_actions(
    text: str, action: str, method: str
) -> None:
    """The tag wins when valid, then a mention inside the tag, then the first whole-word mention."""
    assert parse_action(text, MOVES) == ParsedAction(action=action, method=method)


def test_the_canonical_spelling_is_returned() -> None:
    """The env's own spelling of the action is returned, whatever the case and spacing in the
    text."""
    valid = ["open fridge", "take red apple from fridge", "go north"]
    assert parse_action("<action>Open   FRIDGE</action>", valid).action == "open fridge"
    assert (
        parse_action("I will take red apple from fridge now", valid).action
        == "take red apple from fridge"
    )


def test_longest_action_wins_at_the_same_position() -> None:
    """When two valid actions start at the same place, the longer (more specific) one is
    accepted."""
    valid = ["take apple", "take apple from table", "look"]
    assert parse_action("take apple from table please", valid).action == "take apple from table"


def test_nothing_valid_is_a_failure_with_a_reason() -> None:
    """No valid action anywhere: action None, method none, a reason quoting the text."""
    parsed = parse_action("I am thinking about it", MOVES)
    assert parsed.action is None and parsed.method == "none"
    assert "no valid action in 'I am thinking about it'" in parsed.reason
    assert parse_action("   ", MOVES).reason == "empty completion"


def test_unknown_valid_actions_accept_tag_fence_or_raw_text() -> None:
    """Without a list of valid actions: the tag, else the first fenced block, else the stripped
    text."""
    assert parse_action("x <action>look around</action>", None) == ParsedAction(
        action="look around", method="tag"
    )
    code = "Here:\n```python\ndef f():\n    return 1\n```\nDone."
    assert parse_action(code, None) == ParsedAction(action="def f():\n    return 1", method="fence")
    assert parse_action("  open door \n", None) == ParsedAction(action="open door", method="raw")
    assert parse_action("", None).action is None


@pytest.mark.parametrize(
    ("text", "valid", "action"),
    [
        (
            "<think>Moving left hits the wall; up pushes the box.</think><action>up</action>",
            MOVES,
            "up",
        ),
        ("<think>left is a trap</think><action>up", MOVES, "up"),  # the stop string cut </action>
        (
            "<think>I could go left or down</think> so: right",
            MOVES,
            "right",
        ),  # mentions after the block
        (
            "<think>why</think>```python\ndef f():\n    return 1\n```",
            None,
            "def f():\n    return 1",
        ),
    ],
)
def test_self_reflection_answers_yield_the_action_after_the_think_block(
    text: str, valid: list[str] | None, action: str
) -> None:
    """The Early Experience answer format <think>why</think><action>a</action>: the action is read
    after the reasoning, never from a move mentioned while reasoning."""
    assert parse_action(text, valid).action == action


def test_an_unclosed_think_block_holds_no_action() -> None:
    """Reasoning cut by the length cap names moves but commits to none: nothing is accepted."""
    parsed = parse_action("<think>maybe left, maybe up", MOVES)
    assert parsed.action is None and parsed.method == "none"


def test_invalid_action_feedback_lists_valid_actions_truncated() -> None:
    """Feedback names why and shows the valid actions (at most max_shown, then a count)."""
    parsed = parse_action("hmm", MOVES)
    assert invalid_action_feedback(parsed, MOVES) == (
        "invalid action: no valid action in 'hmm'; valid actions: up, down, left, right"
    )
    many = [f"a{i}" for i in range(30)]
    assert invalid_action_feedback(parsed, many, max_shown=3).endswith("a0, a1, a2 (+27 more)")
    assert invalid_action_feedback(parsed, None) == "invalid action: no valid action in 'hmm'"


@given(st.text(max_size=200))
@settings(max_examples=50)
def test_any_accepted_action_is_valid(text: str) -> None:
    """Whatever the text, an accepted action is one of the valid actions, verbatim."""
    parsed = parse_action(text, MOVES)
    assert parsed.action is None or parsed.action in MOVES
    assert (parsed.action is None) == (parsed.method == "none")


def test_well_formed_reflection() -> None:
    """Both tags present and tau in range: parse_ok, no flags, whitespace normalised."""
    r = parse_reflection("<step>2</step><experience>Push the box\n left first.</experience>", 5)
    assert (r.tau, r.experience, r.parse_ok, r.flags) == (2, "Push the box left first.", True, [])


@pytest.mark.parametrize(
    ("text", "at_t", "tau", "flags"),
    [
        ("<step>9</step><experience>x</experience>", 4, 3, ["tau_clamped"]),
        ("<step>-2</step><experience>x</experience>", 4, 0, ["tau_clamped"]),
        ("The mistake was step 1. <experience>x</experience>", 4, 1, ["tau_untagged"]),
        ("<experience>go left at 2</experience> I blame 3", 4, 3, ["tau_guessed"]),
        ("<experience>x</experience>", 4, 3, ["tau_missing"]),
        ("<step>1</step> you should go left", 4, 1, ["experience_untagged"]),
        ("<step>1</step>", 4, 1, ["experience_missing"]),
        ("<step>1</step><experience>   </experience>", 4, 1, ["experience_missing"]),
    ],
)
def test_reflection_fallbacks_are_flagged(text: str, at_t: int, tau: int, flags: list[str]) -> None:
    """Out-of-range tau is clamped, missing parts default, and every deviation is flagged."""
    r = parse_reflection(text, at_t)
    assert r.tau == tau and r.flags == flags and not r.parse_ok
    assert 0 <= r.tau < at_t


def test_long_experience_is_truncated_and_flagged_but_ok() -> None:
    """An over-long experience is cut to max_experience_chars; truncation alone is not a parse
    failure."""
    r = parse_reflection(
        f"<step>0</step><experience>{'word ' * 200}</experience>", 3, max_experience_chars=50
    )
    assert len(r.experience) <= 50 and r.experience.endswith("...")
    assert r.flags == ["experience_truncated"] and r.parse_ok


def test_reflection_needs_a_history() -> None:
    """at_t = 0 has no step to blame: a ValueError naming the value."""
    with pytest.raises(ValueError, match="at_t = 0"):
        parse_reflection("<step>0</step>", 0)


@given(st.text(max_size=300), st.integers(min_value=1, max_value=40))
@settings(max_examples=50)
def test_reflection_tau_always_in_range(text: str, at_t: int) -> None:
    """For any text, tau is within 0..at_t-1 and a missing experience is empty and flagged."""
    r = parse_reflection(text, at_t)
    assert 0 <= r.tau < at_t
    assert (r.experience == "") == ("experience_missing" in r.flags)


_experiences = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=120
).map(lambda text: " ".join(text.split()))


@given(at_t=st.integers(1, 40), data=st.data(), raw=_experiences)
@settings(max_examples=200, deadline=None)
def test_format_reflection_parses_back_to_the_same_tau_and_e(
    at_t: int, data: st.DataObject, raw: str
) -> None:
    """Every label the warm start trains on is read back by the parser exactly: tau and e, parse_ok,
    no flags."""
    tau = data.draw(st.integers(0, at_t - 1))
    if not raw or ANSWER_TAG.search(raw):
        with pytest.raises(ValueError, match="experience"):
            format_reflection(tau, raw)
        return
    parsed = parse_reflection(
        format_reflection(tau, raw), at_t, max_experience_chars=max(len(raw), 1)
    )
    assert (parsed.tau, parsed.experience, parsed.parse_ok, parsed.flags) == (tau, raw, True, [])


def test_format_reflection_refuses_what_would_not_parse_back() -> None:
    """A negative tau, untrimmed whitespace or an answer tag inside e would be read back
    differently."""
    assert (
        format_reflection(2, "Move left first.")
        == "<step>2</step><experience>Move left first.</experience>"
    )
    for tau, e in (
        (-1, "x"),
        (0, " padded"),
        (0, "two  spaces"),
        (0, ""),
        (0, "a </experience> b"),
    ):
        with pytest.raises(ValueError):
            format_reflection(tau, e)
