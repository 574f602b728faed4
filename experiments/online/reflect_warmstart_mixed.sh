#!/bin/bash
# The reflection warm start, second try (#24 item 2): reflection-only SFT (reflect_warmstart.sh) taught
# the reflection format (tau agreement 9.7% -> 72.9%) but wiped the action format (98% of actions
# unparseable). Here the same oracle-labelled reflections are mixed with action samples of the same
# log (reh: the rehearsal samples the leafe materializer makes of the trees' successful trajectories),
# trained together, and the same trees rerun.
#  needs runs/reflect-before/ (step 1 of reflect_warmstart.sh: Stage 1 trees of the start weights W)
#  1 leafe replay the log twice: reflect (reflections of failed branches) and leafe (its reh samples)
#  2 one dataset of both (write_dataset: ids deduplicated, manifest with both parts), SFT of W on it
#  3 the same trees (same tasks, same seeds) from the result; the audit beside the earlier two
set -euo pipefail
cd "$(dirname "$0")/../.."
export LEAFE_CACHE=$PWD/.cache/leafe HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
W=$PWD/$(ls -d runs/online-paper-leafe/weights/v0* | sort | tail -1)
LOG=runs/reflect-before/events.leafelog
echo "start weights $W"; date
.venv/bin/leafe replay --from $LOG --materializer leafe --model smollm2-135m-instruct --out runs/reflect-leafe > runs/reflect-leafe-replay.log 2>&1
test -d runs/reflect-data || .venv/bin/leafe replay --from $LOG --materializer reflect --model smollm2-135m-instruct --out runs/reflect-data > runs/reflect-replay.log 2>&1
PYTHONPATH=$PWD .venv/bin/python - <<'PY'
from pathlib import Path
from leafe.learner.dataset import iter_samples, read_manifest, write_dataset
parts = [Path("runs/reflect-data"), Path("runs/reflect-leafe")]
samples = [s for p in parts for s in iter_samples(p) if s.kind in ("sft", "reh")]  # reflections, rehearsal
m = write_dataset(samples, Path("runs/reflect-mix"), materializer={
    "name": "mix", "kinds": ["sft (reflect)", "reh (leafe)"], "parts": [{"dir": str(p), "content_sha256": read_manifest(p).content_sha256} for p in parts]})
print("mixed", m.counts_by_kind)
PY
.venv/bin/leafe train --data runs/reflect-mix --model "$W" --out runs/reflect-warm-mix --preset cpu --lr 5e-5 --epochs 2 --global-batch 16 --export-dtype fp32 --no-resume > runs/reflect-train-mix.log 2>&1
date
F=$PWD/runs/reflect-warm-mix/final
(echo "model = \"$F\""; cat experiments/online/reflect_labels.toml) > runs/reflect-after-mix.toml
.venv/bin/leafe run --preset explore-only --config runs/reflect-after-mix.toml --run-id reflect-after-mix --fresh --no-live > runs/reflect-after-mix.log 2>&1
date
PYTHONPATH=$PWD .venv/bin/python -m experiments.paper.reflect_audit runs/reflect-after-mix/events.leafelog --out experiments/results/reflect_audit_after_mixed.json > runs/reflect-audit-after-mix.txt
echo done; date
