"""A new weight version for the weight-sync tests: the model's weights, scaled, exported as the
learner exports them, and the announcement the learner would publish."""

from __future__ import annotations

import time
from pathlib import Path

from leafe.learner.model_io import export_weights, load_model
from leafe.protocol import WeightsPublished

__all__ = ["scaled_export"]


def scaled_export(model: Path, out: Path, version: str, run_id: str = "r1") -> WeightsPublished:
    """``model``'s weights times 1.01 exported to ``out`` as ``version`` (manifest included), and
    its ``WeightsPublished`` for ``run_id``."""
    state = {k: v * 1.01 for k, v in load_model(model).state_dict().items()}
    digest = export_weights(state, out, config_dir=model, version=version)
    return WeightsPublished(
        event_id=f"weights.{run_id}.{version}",
        run_id=run_id,
        version=version,
        uri=str(out),
        manifest_sha256=digest,
        learner_step=1,
        base_model="tiny",
        ts=time.time(),
    )
