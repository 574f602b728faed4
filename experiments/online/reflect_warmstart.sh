#!/bin/bash
# The reflection warm start (#24 item 2) on 2 cores, after the online comparison:
#  1 Stage 1 trees (model reflections + oracle labels) from the online LEAFE run's final weights W
#  2 SFT of W on the oracle-labelled reflections of its own failed branches (reflect materializer)
#  3 the same trees (same tasks, same seeds) from the warm-started weights; audits side by side
set -euo pipefail
cd /work/main
export LEAFE_CACHE=$PWD/.cache/leafe HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
W=$PWD/$(ls -d runs/online-paper-leafe/weights/v0* | sort | tail -1)
echo "start weights $W"; date
(echo "model = \"$W\""; cat experiments/online/reflect_labels.toml) > runs/reflect-before.toml
.venv/bin/leafe run --preset explore-only --config runs/reflect-before.toml --run-id reflect-before --fresh --no-live > runs/reflect-before.log 2>&1
date
.venv/bin/leafe replay --from runs/reflect-before/events.leafelog --materializer reflect --model smollm2-135m-instruct --out runs/reflect-data > runs/reflect-replay.log 2>&1
.venv/bin/leafe train --data runs/reflect-data --model "$W" --out runs/reflect-warm --preset cpu --lr 5e-5 --epochs 2 --global-batch 16 --export-dtype fp32 --no-resume > runs/reflect-train.log 2>&1
date
F=$PWD/runs/reflect-warm/final
(echo "model = \"$F\""; cat experiments/online/reflect_labels.toml) > runs/reflect-after.toml
.venv/bin/leafe run --preset explore-only --config runs/reflect-after.toml --run-id reflect-after --fresh --no-live > runs/reflect-after.log 2>&1
date
PYTHONPATH=$PWD .venv/bin/python -m experiments.paper.reflect_audit runs/reflect-before/events.leafelog --out experiments/results/reflect_audit_before.json > runs/reflect-audit-before.txt
PYTHONPATH=$PWD .venv/bin/python -m experiments.paper.reflect_audit runs/reflect-after/events.leafelog --out experiments/results/reflect_audit_after.json > runs/reflect-audit-after.txt
echo done; date
