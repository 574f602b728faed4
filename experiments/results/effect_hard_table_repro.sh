#!/usr/bin/env bash
# Rebuild every training set of the paper table `effect-hard` from its committed logs, retrain every row
# with the settings the run used, and evaluate it (docs/experiments.md). Run from the repository root.
set -euo pipefail
LOGS=${LOGS:-experiments/results/paper_logs}
OUT=${OUT:-runs/paper-repro/effect-hard}
MODEL=${MODEL:-smollm2-135m-instruct}
leafe() { python -m leafe.services.cli "$@"; }

# sft-6x6-l8-w0-n128: sft over demos-6x6-l8-w0, from base; 660 samples {'sft': 660}
mkdir -p $OUT/sft-6x6-l8-w0-n128/train
cat > $OUT/sft-6x6-l8-w0-n128/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/effect/demos-6x6-l8-w0.leafelog.gz --materializer sft --model $MODEL --out $OUT/sft-6x6-l8-w0-n128/dataset --config $OUT/sft-6x6-l8-w0-n128/replay.toml --no-progress
python -c "from pathlib import Path; from experiments.paper.children import filter_samples; print(filter_samples(Path('$OUT/sft-6x6-l8-w0-n128/dataset'), Path('$OUT/sft-6x6-l8-w0-n128/dataset-filtered'), kinds=[], task_ids=[f'sokoban/train/{i}' for i in range(0, 128)]))"
cat > $OUT/sft-6x6-l8-w0-n128/train/train.toml <<'EOF'
[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 42
retain_versions = 2

[trainer.batch]
bucketing = "pack"
global_batch = 16

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/sft-6x6-l8-w0-n128/dataset-filtered --model $MODEL --out $OUT/sft-6x6-l8-w0-n128/train --preset cpu --config $OUT/sft-6x6-l8-w0-n128/train/train.toml --lr 5e-05 --epochs 1 --threads 2

# sft-6x6-l8-w2-n128: sft over demos-6x6-l8-w2, from base; 660 samples {'sft': 660}
mkdir -p $OUT/sft-6x6-l8-w2-n128/train
cat > $OUT/sft-6x6-l8-w2-n128/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/effect/demos-6x6-l8-w2.leafelog.gz --materializer sft --model $MODEL --out $OUT/sft-6x6-l8-w2-n128/dataset --config $OUT/sft-6x6-l8-w2-n128/replay.toml --no-progress
python -c "from pathlib import Path; from experiments.paper.children import filter_samples; print(filter_samples(Path('$OUT/sft-6x6-l8-w2-n128/dataset'), Path('$OUT/sft-6x6-l8-w2-n128/dataset-filtered'), kinds=[], task_ids=[f'sokoban/train/{i}' for i in range(0, 128)]))"
cat > $OUT/sft-6x6-l8-w2-n128/train/train.toml <<'EOF'
[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 42
retain_versions = 2

[trainer.batch]
bucketing = "pack"
global_batch = 16

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/sft-6x6-l8-w2-n128/dataset-filtered --model $MODEL --out $OUT/sft-6x6-l8-w2-n128/train --preset cpu --config $OUT/sft-6x6-l8-w2-n128/train/train.toml --lr 5e-05 --epochs 1 --threads 2

# warm-train: sft over demos:chosen, from base; 1649 samples {'sft': 1649}
mkdir -p $OUT/warm-train/train
cat > $OUT/warm-train/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/effect/demos-6x6-l8-w2.leafelog.gz --materializer sft --model $MODEL --out $OUT/warm-train/dataset --config $OUT/warm-train/replay.toml --no-progress
python -c "from pathlib import Path; from experiments.paper.children import filter_samples; print(filter_samples(Path('$OUT/warm-train/dataset'), Path('$OUT/warm-train/dataset-filtered'), kinds=[], task_ids=[f'sokoban/train/{i}' for i in range(0, 128)]))"
cat > $OUT/warm-train/replay-mix0.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/effect/labels.leafelog.gz --materializer reflect --model $MODEL --out $OUT/warm-train/dataset-mix0 --config $OUT/warm-train/replay-mix0.toml --no-progress
cat > $OUT/warm-train/replay-mix1.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/effect/labels.leafelog.gz --materializer follow --model $MODEL --out $OUT/warm-train/dataset-mix1 --config $OUT/warm-train/replay-mix1.toml --no-progress
python -c "from pathlib import Path; from experiments.paper.children import combine; print(combine([Path(p) for p in ['$OUT/warm-train/dataset-filtered', '$OUT/warm-train/dataset-mix0', '$OUT/warm-train/dataset-mix1']], Path('$OUT/warm-train/dataset-mixed')))"
cat > $OUT/warm-train/train/train.toml <<'EOF'
[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 104
retain_versions = 3

[trainer.batch]
bucketing = "pack"
global_batch = 16

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/warm-train/dataset-mixed --model $MODEL --out $OUT/warm-train/train --preset cpu --config $OUT/warm-train/train/train.toml --lr 5e-05 --epochs 2 --threads 2

# train-leafe: leafe over explore-model, from warm; 1143 samples {'reh': 888, 'cf': 255}
mkdir -p $OUT/train-leafe/train
cat > $OUT/train-leafe/replay.toml <<'EOF'
[options]
rehearsal_fraction = 0.2
rehearsal_seed = 0
rehearsal_unit = "path"
EOF
leafe replay --from $LOGS/effect-hard/explore-model.leafelog.gz --materializer leafe --model $MODEL --out $OUT/train-leafe/dataset --config $OUT/train-leafe/replay.toml --no-progress
cat > $OUT/train-leafe/train/train.toml <<'EOF'
max_steps = 60

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 16

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-leafe/dataset --model $OUT/warm-train/train/final --out $OUT/train-leafe/train --preset cpu --config $OUT/train-leafe/train/train.toml --lr 3e-05 --epochs 1 --beta 1.0 --threads 2

# train-reh: leafe over explore-model, from warm; 888 samples {'reh': 888}
mkdir -p $OUT/train-reh/train
cat > $OUT/train-reh/replay.toml <<'EOF'
[options]
rehearsal_fraction = 0.2
rehearsal_seed = 0
rehearsal_unit = "path"
EOF
leafe replay --from $LOGS/effect-hard/explore-model.leafelog.gz --materializer leafe --model $MODEL --out $OUT/train-reh/dataset --config $OUT/train-reh/replay.toml --no-progress
python -c "from pathlib import Path; from experiments.paper.children import filter_samples; print(filter_samples(Path('$OUT/train-reh/dataset'), Path('$OUT/train-reh/dataset-filtered'), kinds=['reh'], task_ids=[]))"
cat > $OUT/train-reh/train/train.toml <<'EOF'
max_steps = 60

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 16

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-reh/dataset-filtered --model $OUT/warm-train/train/final --out $OUT/train-reh/train --preset cpu --config $OUT/train-reh/train/train.toml --lr 3e-05 --epochs 2 --threads 2

# train-leafe-oracle: leafe over explore-oracle, from warm; 1746 samples {'reh': 1241, 'cf': 505}
mkdir -p $OUT/train-leafe-oracle/train
cat > $OUT/train-leafe-oracle/replay.toml <<'EOF'
[options]
rehearsal_fraction = 0.2
rehearsal_seed = 0
rehearsal_unit = "path"
EOF
leafe replay --from $LOGS/effect-hard/explore-oracle.leafelog.gz --materializer leafe --model $MODEL --out $OUT/train-leafe-oracle/dataset --config $OUT/train-leafe-oracle/replay.toml --no-progress
cat > $OUT/train-leafe-oracle/train/train.toml <<'EOF'
max_steps = 60

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 16

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-leafe-oracle/dataset --model $OUT/warm-train/train/final --out $OUT/train-leafe-oracle/train --preset cpu --config $OUT/train-leafe-oracle/train/train.toml --lr 3e-05 --epochs 1 --beta 1.0 --threads 2

# train-reh-oracle: leafe over explore-oracle, from warm; 1241 samples {'reh': 1241}
mkdir -p $OUT/train-reh-oracle/train
cat > $OUT/train-reh-oracle/replay.toml <<'EOF'
[options]
rehearsal_fraction = 0.2
rehearsal_seed = 0
rehearsal_unit = "path"
EOF
leafe replay --from $LOGS/effect-hard/explore-oracle.leafelog.gz --materializer leafe --model $MODEL --out $OUT/train-reh-oracle/dataset --config $OUT/train-reh-oracle/replay.toml --no-progress
python -c "from pathlib import Path; from experiments.paper.children import filter_samples; print(filter_samples(Path('$OUT/train-reh-oracle/dataset'), Path('$OUT/train-reh-oracle/dataset-filtered'), kinds=['reh'], task_ids=[]))"
cat > $OUT/train-reh-oracle/train/train.toml <<'EOF'
max_steps = 60

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 16

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-reh-oracle/dataset-filtered --model $OUT/warm-train/train/final --out $OUT/train-reh-oracle/train --preset cpu --config $OUT/train-reh-oracle/train/train.toml --lr 3e-05 --epochs 1 --threads 2

# grpo-r1-train-lr0: grpo over grpo-r1-collect, from warm; 23880 samples {'grpo': 23880}
mkdir -p $OUT/grpo-r1-train-lr0/train
cat > $OUT/grpo-r1-train-lr0/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/effect-hard/grpo-r1-collect.leafelog.gz --materializer grpo --model $MODEL --out $OUT/grpo-r1-train-lr0/dataset --config $OUT/grpo-r1-train-lr0/replay.toml --no-progress
cat > $OUT/grpo-r1-train-lr0/train/train.toml <<'EOF'
[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 100
keep_checkpoints = 1
push_every = 0

[trainer.batch]
bucketing = "pack"
share_prefix = true
global_batch = 16

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/grpo-r1-train-lr0/dataset --model $OUT/warm-train/train/final --out $OUT/grpo-r1-train-lr0/train --preset cpu --config $OUT/grpo-r1-train-lr0/train/train.toml --lr 1e-05 --epochs 1 --threads 2

# grpo-r2-train: grpo over grpo-r2-collect, from grpo-r1; 23478 samples {'grpo': 23478}
mkdir -p $OUT/grpo-r2-train/train
cat > $OUT/grpo-r2-train/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/effect-hard/grpo-r2-collect.leafelog.gz --materializer grpo --model $MODEL --out $OUT/grpo-r2-train/dataset --config $OUT/grpo-r2-train/replay.toml --no-progress
cat > $OUT/grpo-r2-train/train/train.toml <<'EOF'
[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 100
keep_checkpoints = 1
push_every = 0

[trainer.batch]
bucketing = "pack"
share_prefix = true
global_batch = 16

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/grpo-r2-train/dataset --model $OUT/grpo-r1-train-lr0/train/final --out $OUT/grpo-r2-train/train --preset cpu --config $OUT/grpo-r2-train/train/train.toml --lr 1e-05 --epochs 1 --threads 2

# evaluations (validation slice and test rows)
leafe eval --model $OUT/sft-6x6-l8-w0-n128/train/final --label val-sft-6x6-l8-w0-n128-e1 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option min_solution_len=3 --env-option max_solution_len=8 --env-option max_steps=20 --rollout-option horizon=20 --rollout-option history_window=0 --split train --tasks 24 --task-offset 2000 --samples 16 --k 1,2,4,8,16 --seed 777 --out $OUT/val-sft-6x6-l8-w0-n128-e1
leafe eval --model $OUT/sft-6x6-l8-w2-n128/train/final --label val-sft-6x6-l8-w2-n128-e1 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option min_solution_len=3 --env-option max_solution_len=8 --env-option max_steps=20 --rollout-option horizon=20 --rollout-option history_window=2 --split train --tasks 24 --task-offset 2000 --samples 16 --k 1,2,4,8,16 --seed 777 --out $OUT/val-sft-6x6-l8-w2-n128-e1
leafe eval --model $OUT/warm-train/train/weights/v000104 --label val-warm-e1 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option min_solution_len=3 --env-option max_solution_len=8 --env-option max_steps=20 --rollout-option horizon=20 --rollout-option history_window=2 --split train --tasks 24 --task-offset 2000 --samples 16 --k 1,2,4,8,16 --seed 777 --out $OUT/val-warm-e1
leafe eval --model $OUT/warm-train/train/final --label val-warm-e2 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option min_solution_len=3 --env-option max_solution_len=8 --env-option max_steps=20 --rollout-option horizon=20 --rollout-option history_window=2 --split train --tasks 24 --task-offset 2000 --samples 16 --k 1,2,4,8,16 --seed 777 --out $OUT/val-warm-e2
leafe eval --model $OUT/warm-train/train/final --label val-rooms-6x6-l14-w2 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option min_solution_len=8 --env-option max_solution_len=14 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split train --tasks 24 --task-offset 2000 --samples 16 --k 1,2,4,8,16 --seed 777 --out $OUT/val-rooms-6x6-l14-w2
leafe eval --model $OUT/warm-train/train/final --label val-rooms-7x7-l12-w2 --env sokoban --env-option height=7 --env-option width=7 --env-option num_boxes=1 --env-option min_solution_len=5 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split train --tasks 24 --task-offset 2000 --samples 16 --k 1,2,4,8,16 --seed 777 --out $OUT/val-rooms-7x7-l12-w2
leafe eval --model $OUT/warm-train/train/final --label val-rooms-6x6-b2-w2 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=2 --env-option min_solution_len=4 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split train --tasks 24 --task-offset 2000 --samples 16 --k 1,2,4,8,16 --seed 777 --out $OUT/val-rooms-6x6-b2-w2
leafe eval --model $OUT/warm-train/train/final --label eval-warm --env sokoban --env-option height=7 --env-option width=7 --env-option num_boxes=1 --env-option min_solution_len=5 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split test --tasks 128 --task-offset 0 --samples 16 --k 1,2,4,8,16 --seed 12345 --out $OUT/eval-warm
leafe eval --model $OUT/train-leafe/train/final --label eval-leafe --env sokoban --env-option height=7 --env-option width=7 --env-option num_boxes=1 --env-option min_solution_len=5 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split test --tasks 128 --task-offset 0 --samples 16 --k 1,2,4,8,16 --seed 12345 --out $OUT/eval-leafe
leafe eval --model $OUT/train-reh/train/final --label eval-reh --env sokoban --env-option height=7 --env-option width=7 --env-option num_boxes=1 --env-option min_solution_len=5 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split test --tasks 128 --task-offset 0 --samples 16 --k 1,2,4,8,16 --seed 12345 --out $OUT/eval-reh
leafe eval --model $OUT/train-leafe-oracle/train/final --label eval-leafe-oracle --env sokoban --env-option height=7 --env-option width=7 --env-option num_boxes=1 --env-option min_solution_len=5 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split test --tasks 128 --task-offset 0 --samples 16 --k 1,2,4,8,16 --seed 12345 --out $OUT/eval-leafe-oracle
leafe eval --model $OUT/train-reh-oracle/train/final --label eval-reh-oracle --env sokoban --env-option height=7 --env-option width=7 --env-option num_boxes=1 --env-option min_solution_len=5 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split test --tasks 128 --task-offset 0 --samples 16 --k 1,2,4,8,16 --seed 12345 --out $OUT/eval-reh-oracle
leafe eval --model $OUT/grpo-r1-train-lr0/train/final --label grpo-r1-val-lr0 --env sokoban --env-option height=7 --env-option width=7 --env-option num_boxes=1 --env-option min_solution_len=5 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split train --tasks 24 --task-offset 2000 --samples 16 --k 1,2,4,8,16 --seed 777 --out $OUT/grpo-r1-val-lr0
leafe eval --model $OUT/grpo-r2-train/train/final --label grpo-r2-val --env sokoban --env-option height=7 --env-option width=7 --env-option num_boxes=1 --env-option min_solution_len=5 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split train --tasks 24 --task-offset 2000 --samples 16 --k 1,2,4,8,16 --seed 777 --out $OUT/grpo-r2-val
leafe eval --model $OUT/grpo-r2-train/train/final --label eval-grpo --env sokoban --env-option height=7 --env-option width=7 --env-option num_boxes=1 --env-option min_solution_len=5 --env-option max_solution_len=12 --env-option max_steps=30 --rollout-option horizon=30 --rollout-option history_window=2 --split test --tasks 128 --task-offset 0 --samples 16 --k 1,2,4,8,16 --seed 12345 --out $OUT/eval-grpo
