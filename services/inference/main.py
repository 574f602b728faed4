"""``leafe inference``: the CPU inference server with SGLang's native HTTP API, until SIGTERM.

    leafe inference --model tiny|smollm2-135m-instruct|DIR --port 30000 --max-batch 16 [--config inference.toml]

The server itself is ``services/inference/server.py``; torch loads only after the flags are read, so
``--help`` is instant.
"""

from __future__ import annotations

import argparse
import asyncio

from services.config import load_config
from services.inference.config import InferenceConfig
from services.logsetup import configure_logging

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="leafe inference", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--config", default=None, help="TOML file with InferenceConfig fields (flags override)")
    p.add_argument("--model", default=None, help="smollm2-135m-instruct | tiny | HF model directory")
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=None, help="0 = pick a free port (printed at start)")
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--batch-wait-ms", type=float, default=None)
    p.add_argument("--max-prefill-tokens", type=int, default=None)
    p.add_argument("--prefix-cache-tokens", type=int, default=None, help="0 = no prefix cache")
    p.add_argument("--threads", type=int, default=None, help="torch threads (0 = one per core)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--weight-version", default=None)
    p.add_argument("--log-level", default="info")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``leafe inference``."""
    p = _parser()
    a = p.parse_args(argv)
    configure_logging(json=True, level=a.log_level)
    flags = {k: v for k, v in vars(a).items() if k not in ("config", "log_level")}
    try:
        config = load_config(InferenceConfig, files=[a.config], overrides=flags)
    except ValueError as e:
        p.error(str(e))
    from services.inference.server import serve  # torch: only once the flags are good

    asyncio.run(serve(config, on_ready=lambda url: print(f"leafe inference: serving on {url}", flush=True)))
    return 0
