"""What the stages of ``leafe run`` share: the config, the run directory, the services, the
results."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from nats.js import JetStreamContext
from rich.console import Console

from leafe.actors.evaluate import EvalResult
from leafe.services.bus import NatsOptions
from leafe.services.bus.nats_server import EmbeddedNats, free_port
from leafe.services.learner.control import LearnerControl, write_control
from leafe.services.metrics import RunMetrics
from leafe.services.run.plan import RunPlan, plan_stages
from leafe.services.run.presets import RunConfig
from leafe.services.run.progress import RunProgress
from leafe.services.run.supervisor import ServiceProcess
from leafe.services.threads import ThreadPlan

__all__ = ["RunContext"]

_IDENTITY_VARIABLES = (
    "LEAFE_NATS_CREDS",
    "LEAFE_NATS_NKEY",
    "LEAFE_NATS_USER",
    "LEAFE_NATS_PASSWORD_FILE",
    "LEAFE_NATS_TLS_CA",
    "LEAFE_NATS_TLS_CERT",
    "LEAFE_NATS_TLS_KEY",
)


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
    """The supervisor's NATS options: the embedded server's admin, or the environment's identity."""
    nats_server: EmbeddedNats | None = None
    role_nats: dict[str, NatsOptions] = field(default_factory=dict)
    """Each role's options on the embedded server (its own nkey seed file); empty with an external
    one."""
    engine_urls: list[str] = field(default_factory=list)
    """Every inference server (weight sync and the drain talk to each)."""
    router_url: str = ""
    """The sglang router in front of them (``services.router``); '' without one."""
    js: JetStreamContext | None = None
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    progress: RunProgress | None = None
    stage: str = "starting"
    evals: dict[str, EvalResult] = field(default_factory=dict)
    explore_keys: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    engine_key_file: str = ""
    """The API key file of the inference server the run started ('' for external engines: then the
    clients use ``$LEAFE_ENGINE_API_KEY_FILE``); children get it in their environment."""
    engine_admin_key_file: str = ""
    """The admin key file of the run's inference servers (the weight routes, ``/set_threads``):
    only weight sync gets it (``$LEAFE_ENGINE_ADMIN_KEY_FILE``), never an actor. '' for external
    engines: then weight sync alone inherits the supervisor's ``$LEAFE_ENGINE_ADMIN_KEY_FILE``."""
    router_key_file: str = ""
    """The router's control-plane key file (``POST/DELETE /workers``, ``/workers``, ``/get_loads``):
    the supervisor's alone."""
    engine_services: list[str] = field(default_factory=list)
    """Names of the run's own CPU inference servers in ``services`` (``inference``, ``inference-1``,
    ...)."""
    metrics_urls: dict[str, str] = field(default_factory=dict)
    """Each service's Prometheus /metrics URL (the supervisor reads the learner's progress
    there)."""
    started: float = 0.0
    """``time.monotonic()`` when the run started (the learning curve's time axis)."""
    rounds: list[Any] = field(default_factory=list)
    """``leafe.services.run.rounds.RoundRecord`` of each explore round so far."""
    curve: list[Any] = field(default_factory=list)
    """``leafe.services.run.rounds.CurvePoint`` of each validation evaluation so far (the learning
    curve)."""
    run_metrics: RunMetrics = field(default_factory=RunMetrics)
    """The supervisor's own /metrics (``metrics_urls["run"]``): the learning curve's last point."""
    learner_threads: int = 1
    """The learner's ``OMP_NUM_THREADS`` while the engines work too (from the plan unless fixed)."""
    learner_alone: int = 1
    """The learner's threads while the engines idle (the warm start, a phased run's training)."""
    learner_control: LearnerControl = field(default_factory=LearnerControl)
    """What the learner was last told through ``control_file`` (``services/learner/control.py``)."""
    cuts: list[str] = field(default_factory=list)
    """What the wall-clock budget cut, one phrase each (``round 0: 3 of 8 tasks finished``)."""
    released_samples: int = 0
    """Trainable samples counted when the learner was last released (a phased run's plan)."""
    plan: RunPlan = field(init=False)
    """The work the config plans and the time left (``services/run/plan.py``), followed by
    :meth:`enter`."""
    threads: ThreadPlan | None = None
    """How the free cores are split between the CPU inference server and the learner (None with
    external engines or fixed ``inference_threads``: then nobody resizes the engine)."""
    thread_plan: str = ""
    """The plan in words, with the cores it divides and why (the report's ``threads``)."""

    def __post_init__(self) -> None:
        self.run_dir = Path(self.config.runs_dir) / self.config.run_id
        self.plan = RunPlan(plan_stages(self.config))

    def enter(self, stage: str) -> None:
        """Start ``stage``: shown on every progress line, and where the plan counts the work."""
        self.stage = stage
        if self.progress is not None:
            self.plan.enter(stage, self.progress)

    @property
    def jetstream(self) -> JetStreamContext:
        """The supervisor's JetStream context (raises if asked for before the run started)."""
        if self.js is None:
            raise RuntimeError("the run has no NATS connection yet")
        return self.js

    @property
    def client_urls(self) -> list[str]:
        """Where actors and evaluations send requests: the router when there is one, else every
        server."""
        return [self.router_url] if self.router_url else self.engine_urls

    @property
    def tensorboard_dir(self) -> Path:
        """Where the learner and the evaluations write TensorBoard scalars (one sub-directory
        each)."""
        return self.run_dir / "tensorboard"

    @property
    def control_file(self) -> Path:
        """The learner's control file (threads; a phased run's released samples)."""
        return self.run_dir / "learner-control.json"

    def tell_learner(self, **changes: Any) -> None:
        """Change fields of the learner's control (``threads``, ``release_seq``) and write the
        file."""
        self.learner_control = msgspec.structs.replace(self.learner_control, **changes)
        write_control(self.control_file, self.learner_control)

    def nats_args(self, role: str) -> list[str]:
        """``--nats``, the role's own identity on the embedded server (``role``: a role, or
        ``actor.<id>`` for one actor; none with an external server: the services inherit the
        ``LEAFE_NATS_*`` variables) and ``--run``."""
        args = ["--nats", self.nats.url, "--run", self.config.run_id]
        if self.role_nats:
            args += ["--nats-nkey", self.role_nats[role].nkey]
        return args

    def service(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        *,
        engine_admin: bool = False,
    ) -> ServiceProcess:
        """A child ``leafe`` process logging to ``logs/<name>.log``, serving /metrics on a free
        local port (kept across restarts: the port is part of its arguments). With the embedded
        server, identities in the ``LEAFE_NATS_*`` variables are not passed on: each child gets
        exactly its role's. Only an ``engine_admin`` child (weight sync) gets the engines' admin
        key file; every other one gets an empty ``LEAFE_ENGINE_ADMIN_KEY_FILE``, whatever this
        process's environment holds."""
        port = free_port()
        self.metrics_urls[name] = f"http://127.0.0.1:{port}/metrics"
        argv = [*argv, "--metrics-port", str(port), "--metrics-host", "127.0.0.1"]
        admin = ""
        if engine_admin:
            admin = self.engine_admin_key_file or os.environ.get("LEAFE_ENGINE_ADMIN_KEY_FILE", "")
        env = {"LEAFE_ENGINE_ADMIN_KEY_FILE": admin, **(env or {})}
        if self.engine_key_file:
            env = {"LEAFE_ENGINE_API_KEY_FILE": self.engine_key_file, **env}
        if self.role_nats:
            env = {**dict.fromkeys(_IDENTITY_VARIABLES, ""), **(env or {})}
        proc = ServiceProcess(
            name, argv, self.run_dir / "logs" / f"{name}.log", env, run_dir=self.run_dir
        )
        self.services[name] = proc
        return proc
