"""The learner's peak resident memory before and after the memory work of
``learner/linear_logprobs.py`` and ``learner/memory.py``, with the loss-equality check; a part of
``bench/learner.py``.

| variant      | what trains                                                                       |
|--------------|-----------------------------------------------------------------------------------|
| before       | the previous loss path: full-vocabulary logits at the target positions,           |
|              | every activation kept for the backward, autocast's bf16 weight cache,             |
|              | glibc's default (rising) mmap threshold                                           |
| glibc        | chunked LM head, glibc's default allocator (``reuse_freed_memory = false``):      |
|              | the default until freed blocks were kept for reuse                                |
| after        | the trainer as configured by default:                                             |
|              | chunked LM head, freed blocks reused (no ``mmap``)                                |
| lean         | ``after`` with ``release_freed_memory = true``                                    |
|              | (pinned mmap threshold: less RSS, slower)                                         |
| checkpointed | ``lean`` with ``activation_checkpointing = true`` (and no autocast weight cache)  |
| ckpt_reuse   | ``after`` with ``activation_checkpointing = true``: freed blocks reused           |
| mlp          | ``after`` with ``recompute = "mlp"``: each layer's MLP recomputed in the backward |
| attn         | ``after`` with ``recompute = "self_attn"``: each attention block recomputed       |

Each variant is its own process (peak RSS: its own ``VmHWM``, not ``ru_maxrss``, which an exec'd
child inherits from its parent; minor page faults a step) training the same two global batches from
the same weights with the ``cpu`` preset's trainer (what ``leafe run``'s learner uses: global batch
16, packed 2048-token rows, precision ``auto``), one torch thread. The losses of both steps must
agree to 1e-5 (the second step runs on weights the first updated). Step times are also given
against ``after``, today's default (``step_seconds_X_over_after``).

    .venv/bin/python -m bench.learner_memory --child after \\
        --model smollm2-135m-instruct   # one variant
    .venv/bin/python -m bench.learner_memory --variants before,after,mlp   # some, JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from bench.host import host_record, peak_rss_kib

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("before", "glibc", "after", "lean", "checkpointed", "ckpt_reuse", "mlp", "attn")
DEFAULT_VARIANTS = ("before", "glibc", "after", "lean", "checkpointed", "mlp")
"""What ``bench/learner.py`` runs (``--variants`` picks others)."""
KEYS = ("loss", "loss_cf", "loss_reh", "grad_norm")
"""Step figures compared between the variants."""
TOLERANCE = 1e-5


def _child(variant: str, model: str, samples: int, prompt: tuple[int, int]) -> dict[str, Any]:
    import torch

    from bench.learner_samples import agent_samples
    from leafe.learner import trainer as trainer_module
    from leafe.learner.config import cpu_preset
    from leafe.learner.distributed import init_distributed
    from leafe.learner.linear_logprobs import full_logits_sample_logprobs
    from leafe.learner.model_io import resolve_model

    class FullLogitsTrainer(trainer_module.Trainer):
        def _logp(self, model: torch.nn.Module, mb: Any) -> torch.Tensor:
            return full_logits_sample_logprobs(model, mb)

    torch.set_num_threads(1)
    env = init_distributed("gloo")
    model_dir = resolve_model(model)
    cfg = cpu_preset().trainer
    if variant in ("before", "glibc"):
        cfg = msgspec.structs.replace(cfg, reuse_freed_memory=False)
    if variant == "before":
        cfg = msgspec.structs.replace(cfg, activation_checkpointing=False)
        trainer: trainer_module.Trainer = FullLogitsTrainer(cfg, model_dir, env)
    else:
        if variant in ("lean", "checkpointed"):
            cfg = msgspec.structs.replace(cfg, release_freed_memory=True)
        if variant in ("checkpointed", "ckpt_reuse"):
            cfg = msgspec.structs.replace(cfg, activation_checkpointing=True)
        if variant in ("mlp", "attn"):
            cfg = msgspec.structs.replace(cfg, recompute="mlp" if variant == "mlp" else "self_attn")
        trainer = trainer_module.Trainer(cfg, model_dir, env)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    batch = cfg.batch.global_batch
    data = agent_samples(2 * batch, vocab, prompt=prompt)[: 2 * min(batch, samples)]
    half = len(data) // 2
    steps = []
    for b in (data[:half], data[half:]):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        steps.append(msgspec.to_builtins(trainer.train_step(b)))
        steps[-1]["minor_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {
        "variant": variant,
        "peak_rss_gb": peak_rss_kib() / 1e6,  # KiB; GB as the earlier records counted them
        "precision": trainer.precision,
        "micro_batch_tokens": cfg.batch.micro_batch_tokens,
        "steps": [
            {k: s[k] for k in (*KEYS, "seconds", "real_tokens", "micro_batches", "minor_faults")}
            for s in steps
        ],
    }


def memory_part(
    model: str, samples: int, prompt: tuple[int, int], variants: tuple[str, ...] = DEFAULT_VARIANTS
) -> dict[str, Any]:
    """The variants (``after`` always among them), each in a fresh process, one after another; peak
    RSS, ratios and the loss check against the first, ``before`` where it is among them (the
    reference's figures are named ``..._over_<reference>``)."""
    host = host_record()
    others = tuple(v for v in variants if v not in ("before", "after"))
    variants = (*(("before",) if "before" in variants else ()), "after", *others)
    rows = {}
    for variant in variants:
        cmd = [sys.executable, "-m", "bench.learner_memory", "--child", variant, "--model", model]
        cmd += ["--samples", str(samples), "--prompt", f"{prompt[0]},{prompt[1]}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            raise RuntimeError(
                f"learner memory child {variant} exited {run.returncode}:\n{run.stderr[-3000:]}"
            )
        rows[variant] = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"  {variant:<7} peak RSS {rows[variant]['peak_rss_gb']:.2f} GB", flush=True)
    ref = variants[0]
    before = rows[ref]
    out: dict[str, Any] = {"host": host, "model": model, "variants": rows, "tolerance": TOLERANCE}
    out["reference"] = ref
    out[f"peak_rss_gb_{ref}"] = before["peak_rss_gb"]
    equal = True
    for name in variants[1:]:
        row = rows[name]
        pairs = list(zip(before["steps"], row["steps"], strict=True))
        diff = max(
            abs((a[k] or 0.0) - (b[k] or 0.0)) for a, b in pairs for k in KEYS if k != "grad_norm"
        )
        grad = max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] for a, b in pairs)
        seconds = sum(s["seconds"] for s in row["steps"]) / sum(
            s["seconds"] for s in before["steps"]
        )
        ratio = row["peak_rss_gb"] / before["peak_rss_gb"]
        print(
            f"  {name}/{ref} peak RSS {ratio:.2f}, step time {seconds:.2f}, loss |diff| {diff:.1e}"
        )
        out[f"peak_rss_gb_{name}"] = row["peak_rss_gb"]
        out[f"peak_rss_{name}_over_{ref}"] = ratio
        out[f"step_seconds_{name}_over_{ref}"] = seconds
        out[f"step_seconds_{name}_over_after"] = sum(s["seconds"] for s in row["steps"]) / sum(
            s["seconds"] for s in rows["after"]["steps"]
        )
        out[f"max_loss_abs_diff_{name}"] = diff
        out[f"max_grad_norm_rel_diff_{name}"] = grad
        equal = equal and diff <= TOLERANCE
    out["losses_equal"] = equal
    if "glibc" not in rows:
        return out
    glibc, after = (
        rows["glibc"]["steps"][-1],
        rows["after"]["steps"][-1],
    )  # the first step faults in both
    out["second_step_seconds_after_over_glibc"] = after["seconds"] / glibc["seconds"]
    out["second_step_faults_glibc"], out["second_step_faults_after"] = (
        glibc["minor_faults"],
        after["minor_faults"],
    )
    print(
        f"  after/glibc second step {out['second_step_seconds_after_over_glibc']:.2f}x the time, "
        f"page faults {after['minor_faults']:,} against {glibc['minor_faults']:,}"
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--child", choices=VARIANTS, help="train one variant, print its JSON")
    p.add_argument(
        "--variants", default=None, help="comma-separated: these variants, each in a process"
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument(
        "--samples", type=int, default=16, help="samples per step (at most the global batch)"
    )
    p.add_argument("--prompt", default="150,600", help="prompt length range, tokens")
    a = p.parse_args()
    lo, hi = (int(x) for x in a.prompt.split(","))
    if a.variants:
        wanted = tuple(a.variants.split(","))
        if unknown := set(wanted) - set(VARIANTS):
            p.error(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
        print(json.dumps(memory_part(a.model, a.samples, (lo, hi), wanted)))
        return 0
    if a.child is None:
        p.error("--child VARIANT or --variants A,B,...")
    print(json.dumps(_child(a.child, a.model, a.samples, (lo, hi))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
