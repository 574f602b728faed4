#!/usr/bin/env bash
# Rebuild every training set of the paper table `small` from its committed logs, retrain every row
# with the settings the run used, and evaluate it (docs/experiments.md). Run from the repository root.
set -euo pipefail
LOGS=${LOGS:-experiments/results/paper_logs/small}
OUT=${OUT:-runs/paper-repro/small}
MODEL=${MODEL:-smollm2-135m-instruct}
leafe() { python -m leafe.services.cli "$@"; }

# sft-5x5-l3-n8: sft over demos-5x5-l3, from base; 12 samples {'sft': 12}
mkdir -p $OUT/sft-5x5-l3-n8/train
cat > $OUT/sft-5x5-l3-n8/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/demos-5x5-l3.leafelog.gz --materializer sft --model $MODEL --out $OUT/sft-5x5-l3-n8/dataset --config $OUT/sft-5x5-l3-n8/replay.toml --no-progress
python -c "from pathlib import Path; from experiments.paper.children import filter_samples; print(filter_samples(Path('$OUT/sft-5x5-l3-n8/dataset'), Path('$OUT/sft-5x5-l3-n8/dataset-filtered'), kinds=[], task_ids=[f'sokoban/train/{i}' for i in range(0, 8)]))"
cat > $OUT/sft-5x5-l3-n8/train/train.toml <<'EOF'
[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 2
retain_versions = 3

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/sft-5x5-l3-n8/dataset-filtered --model $MODEL --out $OUT/sft-5x5-l3-n8/train --preset cpu --config $OUT/sft-5x5-l3-n8/train/train.toml --lr 0.0001 --epochs 2

# sft-6x6-l5-n8: sft over demos-6x6-l5, from base; 27 samples {'sft': 27}
mkdir -p $OUT/sft-6x6-l5-n8/train
cat > $OUT/sft-6x6-l5-n8/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/demos-6x6-l5.leafelog.gz --materializer sft --model $MODEL --out $OUT/sft-6x6-l5-n8/dataset --config $OUT/sft-6x6-l5-n8/replay.toml --no-progress
python -c "from pathlib import Path; from experiments.paper.children import filter_samples; print(filter_samples(Path('$OUT/sft-6x6-l5-n8/dataset'), Path('$OUT/sft-6x6-l5-n8/dataset-filtered'), kinds=[], task_ids=[f'sokoban/train/{i}' for i in range(0, 8)]))"
cat > $OUT/sft-6x6-l5-n8/train/train.toml <<'EOF'
[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 4
retain_versions = 3

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/sft-6x6-l5-n8/dataset-filtered --model $MODEL --out $OUT/sft-6x6-l5-n8/train --preset cpu --config $OUT/sft-6x6-l5-n8/train/train.toml --lr 0.0001 --epochs 2

# grpo-r1-train-lr0: grpo over grpo-r1-collect, from sft; 118 samples {'grpo': 118}
mkdir -p $OUT/grpo-r1-train-lr0/train
cat > $OUT/grpo-r1-train-lr0/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/grpo-r1-collect.leafelog.gz --materializer grpo --model $MODEL --out $OUT/grpo-r1-train-lr0/dataset --config $OUT/grpo-r1-train-lr0/replay.toml --no-progress
cat > $OUT/grpo-r1-train-lr0/train/train.toml <<'EOF'
max_steps = 2

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/grpo-r1-train-lr0/dataset --model $OUT/sft-6x6-l5-n8/train/weights/v000004 --out $OUT/grpo-r1-train-lr0/train --preset cpu --config $OUT/grpo-r1-train-lr0/train/train.toml --lr 0.0001 --epochs 1

# grpo-r2-train: grpo over grpo-r2-collect, from grpo-r1; 37 samples {'grpo': 37}
mkdir -p $OUT/grpo-r2-train/train
cat > $OUT/grpo-r2-train/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/grpo-r2-collect.leafelog.gz --materializer grpo --model $MODEL --out $OUT/grpo-r2-train/dataset --config $OUT/grpo-r2-train/replay.toml --no-progress
cat > $OUT/grpo-r2-train/train/train.toml <<'EOF'
max_steps = 2

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/grpo-r2-train/dataset --model $OUT/grpo-r1-train-lr0/train/final --out $OUT/grpo-r2-train/train --preset cpu --config $OUT/grpo-r2-train/train/train.toml --lr 0.0001 --epochs 1

# train-leafe: leafe over explore-grpo, from grpo; 7 samples {'cf': 2, 'reh': 5}
mkdir -p $OUT/train-leafe/train
cat > $OUT/train-leafe/replay.toml <<'EOF'
[options]
rehearsal_fraction = 0.2
rehearsal_seed = 0
EOF
leafe replay --from $LOGS/explore-grpo.leafelog.gz --materializer leafe --model $MODEL --out $OUT/train-leafe/dataset --config $OUT/train-leafe/replay.toml --no-progress
cat > $OUT/train-leafe/train/train.toml <<'EOF'
max_steps = 2

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-leafe/dataset --model $OUT/grpo-r1-train-lr0/train/final --out $OUT/train-leafe/train --preset cpu --config $OUT/train-leafe/train/train.toml --lr 0.0001 --epochs 2 --beta 1.0

# train-iwm: iwm over early-collect, from base; 57 samples {'sft': 27, 'iwm': 30}
mkdir -p $OUT/train-iwm/train
cat > $OUT/train-iwm/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/early-collect.leafelog.gz --materializer iwm --model $MODEL --out $OUT/train-iwm/dataset --config $OUT/train-iwm/replay.toml --no-progress
cat > $OUT/train-iwm/train/train.toml <<'EOF'
max_steps = 2

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-iwm/dataset --model $MODEL --out $OUT/train-iwm/train --preset cpu --config $OUT/train-iwm/train/train.toml --lr 0.0001 --epochs 1

# train-sr: sr over early-collect, from base; 57 samples {'sft': 27, 'sr': 30}
mkdir -p $OUT/train-sr/train
cat > $OUT/train-sr/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/early-collect.leafelog.gz --materializer sr --model $MODEL --out $OUT/train-sr/dataset --config $OUT/train-sr/replay.toml --no-progress
cat > $OUT/train-sr/train/train.toml <<'EOF'
max_steps = 2

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-sr/dataset --model $MODEL --out $OUT/train-sr/train --preset cpu --config $OUT/train-sr/train/train.toml --lr 0.0001 --epochs 1

# train-rft: rft over grpo-r1-collect, from sft; 9 samples {'rft': 9}
mkdir -p $OUT/train-rft/train
cat > $OUT/train-rft/replay.toml <<'EOF'
[options]
EOF
leafe replay --from $LOGS/grpo-r1-collect.leafelog.gz --materializer rft --model $MODEL --out $OUT/train-rft/dataset --config $OUT/train-rft/replay.toml --no-progress
cat > $OUT/train-rft/train/train.toml <<'EOF'
max_steps = 2

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-rft/dataset --model $OUT/sft-6x6-l5-n8/train/weights/v000004 --out $OUT/train-rft/train --preset cpu --config $OUT/train-rft/train/train.toml --lr 0.0001 --epochs 2

# train-leafe-oracle: leafe over explore-grpo-oracle, from grpo; 4 samples {'reh': 3, 'cf': 1}
mkdir -p $OUT/train-leafe-oracle/train
cat > $OUT/train-leafe-oracle/replay.toml <<'EOF'
[options]
rehearsal_fraction = 0.2
rehearsal_seed = 0
EOF
leafe replay --from $LOGS/explore-grpo-oracle.leafelog.gz --materializer leafe --model $MODEL --out $OUT/train-leafe-oracle/dataset --config $OUT/train-leafe-oracle/replay.toml --no-progress
cat > $OUT/train-leafe-oracle/train/train.toml <<'EOF'
max_steps = 2

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-leafe-oracle/dataset --model $OUT/grpo-r1-train-lr0/train/final --out $OUT/train-leafe-oracle/train --preset cpu --config $OUT/train-leafe-oracle/train/train.toml --lr 0.0001 --epochs 2 --beta 1.0

# train-reh: leafe over explore-grpo, from grpo; 5 samples {'reh': 5}
mkdir -p $OUT/train-reh/train
cat > $OUT/train-reh/replay.toml <<'EOF'
[options]
rehearsal_fraction = 0.2
rehearsal_seed = 0
EOF
leafe replay --from $LOGS/explore-grpo.leafelog.gz --materializer leafe --model $MODEL --out $OUT/train-reh/dataset --config $OUT/train-reh/replay.toml --no-progress
python -c "from pathlib import Path; from experiments.paper.children import filter_samples; print(filter_samples(Path('$OUT/train-reh/dataset'), Path('$OUT/train-reh/dataset-filtered'), kinds=['reh'], task_ids=[]))"
cat > $OUT/train-reh/train/train.toml <<'EOF'
max_steps = 2

[trainer]
precision = "bf16"
export_dtype = "fp32"
checkpoint_every = 0
push_every = 0

[trainer.batch]
bucketing = "pack"
global_batch = 8

[trainer.loss]
dual_clip = 0.0
EOF
leafe train --data $OUT/train-reh/dataset-filtered --model $OUT/grpo-r1-train-lr0/train/final --out $OUT/train-reh/train --preset cpu --config $OUT/train-reh/train/train.toml --lr 0.0001 --epochs 2

# evaluations (validation slice and test rows)
leafe eval --model $OUT/sft-5x5-l3-n8/train/weights/v000002 --label val-sft-5x5-l3-n8-e1 --env sokoban --env-option height=5 --env-option width=5 --env-option num_boxes=1 --env-option max_solution_len=3 --env-option max_steps=8 --rollout-option horizon=12 --rollout-option history_window=2 --split train --tasks 4 --task-offset 2000 --samples 2 --k 1,2 --seed 777 --out $OUT/val-sft-5x5-l3-n8-e1
leafe eval --model $OUT/sft-5x5-l3-n8/train/final --label val-sft-5x5-l3-n8-e2 --env sokoban --env-option height=5 --env-option width=5 --env-option num_boxes=1 --env-option max_solution_len=3 --env-option max_steps=8 --rollout-option horizon=12 --rollout-option history_window=2 --split train --tasks 4 --task-offset 2000 --samples 2 --k 1,2 --seed 777 --out $OUT/val-sft-5x5-l3-n8-e2
leafe eval --model $OUT/sft-6x6-l5-n8/train/weights/v000004 --label val-sft-6x6-l5-n8-e1 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split train --tasks 4 --task-offset 2000 --samples 2 --k 1,2 --seed 777 --out $OUT/val-sft-6x6-l5-n8-e1
leafe eval --model $OUT/sft-6x6-l5-n8/train/final --label val-sft-6x6-l5-n8-e2 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split train --tasks 4 --task-offset 2000 --samples 2 --k 1,2 --seed 777 --out $OUT/val-sft-6x6-l5-n8-e2
leafe eval --model $MODEL --label eval-base --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 12345 --out $OUT/eval-base
leafe eval --model $OUT/sft-6x6-l5-n8/train/weights/v000004 --label eval-sft --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 12345 --out $OUT/eval-sft
leafe eval --model $OUT/grpo-r1-train-lr0/train/final --label grpo-r1-val-lr0 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split train --tasks 4 --task-offset 2000 --samples 2 --k 1,2 --seed 777 --out $OUT/grpo-r1-val-lr0
leafe eval --model $OUT/grpo-r2-train/train/final --label grpo-r2-val --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split train --tasks 4 --task-offset 2000 --samples 2 --k 1,2 --seed 777 --out $OUT/grpo-r2-val
leafe eval --model $OUT/grpo-r1-train-lr0/train/final --label eval-grpo --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 12345 --out $OUT/eval-grpo
leafe eval --model $OUT/train-leafe/train/final --label eval-leafe --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 12345 --out $OUT/eval-leafe
leafe eval --model $OUT/train-iwm/train/final --label eval-iwm --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 12345 --out $OUT/eval-iwm
leafe eval --model $OUT/train-sr/train/final --label eval-sr --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --rollout-option 'response_prefix="<think>"' --rollout-option max_new_tokens=128 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 12345 --out $OUT/eval-sr
leafe eval --model $OUT/train-rft/train/final --label eval-rft --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 12345 --out $OUT/eval-rft
leafe eval --model $OUT/train-leafe-oracle/train/final --label eval-leafe-oracle --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 12345 --out $OUT/eval-leafe-oracle
leafe eval --model $OUT/train-reh/train/final --label eval-reh --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 12345 --out $OUT/eval-reh
leafe eval --model $OUT/sft-6x6-l5-n8/train/weights/v000004 --label eval-sft-reseed --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split test --tasks 4 --task-offset 0 --samples 4 --k 1,2,4 --seed 1012345 --out $OUT/eval-sft-reseed
leafe eval --model $MODEL --label val-base-5x5-l3 --env sokoban --env-option height=5 --env-option width=5 --env-option num_boxes=1 --env-option max_solution_len=3 --env-option max_steps=8 --rollout-option horizon=12 --rollout-option history_window=2 --split train --tasks 4 --task-offset 2000 --samples 2 --k 1,2 --seed 777 --out $OUT/val-base-5x5-l3
leafe eval --model $MODEL --label val-base-6x6-l5 --env sokoban --env-option height=6 --env-option width=6 --env-option num_boxes=1 --env-option max_solution_len=5 --env-option max_steps=12 --rollout-option horizon=12 --rollout-option history_window=2 --split train --tasks 4 --task-offset 2000 --samples 2 --k 1,2 --seed 777 --out $OUT/val-base-6x6-l5
