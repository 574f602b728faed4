"""The choice phases of the paper table (``select-*``), from validation results only
(``experiments/paper/select.py`` has the rules): the middle layer of
:class:`~experiments.paper.steps.Steps`."""

from __future__ import annotations

from typing import Any

import msgspec

from experiments.paper.phases import EvalSpec, SelectSpec
from experiments.paper.refs import Refs
from experiments.paper.select import Candidate, choose_best, choose_sft

__all__ = ["Choices", "grpo_origin"]


def grpo_origin(start_ref: str, rooms: bool) -> str:
    """The choice whose validation phase is GRPO's round 0: the warm start's (on the rows' rooms
    when ``select-rooms`` exists) or Base + SFT's."""
    if start_ref != "warm":
        return "select-sft"
    return "select-rooms" if rooms else "select-warm"


class Choices(Refs):
    """``select`` phases: the SFT candidate, GRPO's lr and round, the shared warm start's epoch."""

    def candidate(self, val_phase: str, **kw: Any) -> Candidate:
        """The validation result of ``val_phase`` as a :class:`Candidate`."""
        r = self._need(val_phase)
        top = str(max(int(k) for k in r["passk"]))
        return Candidate(
            name=val_phase,
            pass1=float(r["passk"]["1"]),
            parse_failure=float(r["parse_failure_rate"]),
            passk_max=float(r["passk"][top]),
            **kw,
        )

    def select(self, spec: SelectSpec) -> dict[str, Any]:
        """The choice ``spec`` names, from validation results only."""
        if spec.what == "sft":
            return self._select_sft(spec.candidates)
        if spec.what == "warm":
            return self._select_warm(spec.candidates)
        if spec.what == "rooms":
            return self._select_rooms(spec.candidates)
        if spec.what == "grpo-lr":
            cands = []
            for v in spec.candidates:
                train = self.by_name[v].spec.model.removeprefix("train:")  # type: ignore[union-attr]
                cands.append(self.candidate(v, lr=self._lr(self.by_name[train].spec.lr)))  # type: ignore[union-attr]
            choice = choose_best(cands)
            train = self.by_name[choice.chosen.name].spec.model  # type: ignore[union-attr]
            return self._choice(
                choice, cands, lr=choice.chosen.lr, weights=str(self.weights(train)), round=1
            )
        return self._select_grpo(spec.candidates, spec.start)

    def _choice(self, choice: Any, cands: list[Candidate], **extra: Any) -> dict[str, Any]:
        return {
            "chosen": choice.chosen.name,
            "rule_met": choice.rule_met,
            "why": choice.why,
            "candidates": [msgspec.to_builtins(c) for c in cands],
            **extra,
        }

    def _by_sft_rule(self, cands: list[Candidate]) -> Any:
        """``choose_sft`` with the config's rule (format, Pass@1 range and target, the cap at large
        k)."""
        w = self.cfg.warm
        return choose_sft(
            cands,
            max_parse_failure=w.max_parse_failure,
            pass1_range=w.pass1_range,
            pass1_target=w.pass1_target,
            max_passk=w.max_passk,
        )

    def _select_sft(self, vals: list[str]) -> dict[str, Any]:
        cands = []
        for v in vals:
            spec = self.by_name[v].spec
            assert isinstance(spec, EvalSpec)
            train, _, epoch = spec.model.removeprefix("train:").partition("@")
            demos = self.by_name[train].spec.demos  # type: ignore[union-attr]
            if self.done(v) is not None:
                cands.append(
                    self.candidate(v, variant=spec.variant, demos=int(demos), epochs=int(epoch))
                )
        w = self.cfg.warm
        choice = self._by_sft_rule(cands)
        c = choice.chosen
        weights = self.weights(self.by_name[c.name].spec.model)  # type: ignore[union-attr]
        return self._choice(
            choice,
            cands,
            variant=c.variant,
            env_options=dict(w.variants[c.variant]),
            demos=c.demos,
            epochs=c.epochs,
            weights=str(weights),
            val_phase=c.name,
        )

    def _select_warm(self, vals: list[str]) -> dict[str, Any]:
        """The shared warm start's epoch: the highest validation Pass@1 among the candidates that
        answer in format (fewer than ``warm.max_parse_failure`` unparseable), all of them if none
        does."""
        cands = [
            self.candidate(v, epochs=int(v.rpartition("-e")[2]))
            for v in vals
            if self.done(v) is not None
        ]
        formatted = [c for c in cands if c.parse_failure < self.cfg.warm.max_parse_failure]
        choice = choose_best(formatted or cands)
        weights = self.weights(self.by_name[choice.chosen.name].spec.model)  # type: ignore[union-attr]
        return self._choice(
            choice,
            cands,
            epochs=choice.chosen.epochs,
            weights=str(weights),
            val_phase=choice.chosen.name,
        )

    def _select_rooms(self, vals: list[str]) -> dict[str, Any]:
        """The rows' rooms: the warm start on each candidate variant's validation slice, chosen by
        the SFT rule (in format, Pass@1 in range nearest the target, Pass@k at the largest k <=
        warm.max_passk)."""
        cands = []
        for v in vals:
            spec = self.by_name[v].spec
            assert isinstance(spec, EvalSpec)
            if self.done(v) is not None:
                cands.append(self.candidate(v, variant=spec.variant))
        choice = self._by_sft_rule(cands)
        c = choice.chosen
        return self._choice(
            choice,
            cands,
            variant=c.variant,
            env_options=dict(self.cfg.room_variant(c.variant)),
            weights=str(self.weights("warm")),
            val_phase=c.name,
        )

    def _select_grpo(self, rounds: list[str], start_ref: str = "sft") -> dict[str, Any]:
        """GRPO's round, against its start on the same validation slice: the warm start's choice,
        or, when the rows run on other rooms than the warm start's own (``select-rooms``), its
        validation there."""
        origin = self._need(grpo_origin(start_ref, "select-rooms" in self.by_name))
        start = self.candidate(origin["val_phase"], round=0)
        first = self._need(rounds[0])
        cands = [self.candidate(first["chosen"], round=1, lr=float(first["lr"]))]
        for r, v in enumerate(rounds[1:], start=2):
            if self.done(v) is not None:
                cands.append(self.candidate(v, round=r))
        choice = choose_best(cands, start=start)
        k = choice.chosen.round
        weights = first["weights"] if k == 1 else self._need(f"grpo-r{k}-train")["final"]
        curve = [msgspec.to_builtins(start)] + [msgspec.to_builtins(c) for c in cands]
        return self._choice(
            choice, cands, round=k, weights=str(weights), curve=curve, beats_start=choice.rule_met
        )
