"""What the stages of ``leafe run`` share: the config, the run directory, the services, the results."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from nats.js import JetStreamContext
from rich.console import Console

from actors.evaluate import EvalResult
from services.bus import NatsOptions
from services.bus.nats_server import EmbeddedNats
from services.run.presets import RunConfig
from services.run.progress import RunProgress
from services.run.supervisor import ServiceProcess

__all__ = ["RunContext"]


@dataclass
class RunContext:
    """What the stages share (filled in as the run starts; see ``services/run/launch.py``)."""

    config: RunConfig
    console: Console
    stop: asyncio.Event
    live: bool = True
    run_dir: Path = field(init=False)
    model_dir: Path | None = None
    nats: NatsOptions = field(default_factory=NatsOptions)
    nats_server: EmbeddedNats | None = None
    engine_urls: list[str] = field(default_factory=list)
    js: JetStreamContext | None = None
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    progress: RunProgress | None = None
    stage: str = "starting"
    evals: dict[str, EvalResult] = field(default_factory=dict)
    explore_keys: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    learner_log_offset: int = 0

    def __post_init__(self) -> None:
        self.run_dir = Path(self.config.runs_dir) / self.config.run_id

    @property
    def jetstream(self) -> JetStreamContext:
        """The supervisor's JetStream context (raises if asked for before the run started)."""
        if self.js is None:
            raise RuntimeError("the run has no NATS connection yet")
        return self.js

    def service(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> ServiceProcess:
        """A child ``leafe`` process logging to ``logs/<name>.log``."""
        proc = ServiceProcess(name, argv, self.run_dir / "logs" / f"{name}.log", env)
        self.services[name] = proc
        return proc
