"""Your own vLLM script with the kvcanary plugin (needs the `[vllm]` extra; not a test).

`KVCANARY_MODE=log` is all it takes: vLLM loads the plugin through its `vllm.general_plugins`
entry point, which adds `KVCanaryConnector` as the KV connector (the same as passing
`kv_transfer_config={"kv_connector": "KVCanaryConnector", "kv_connector_module_path":
"kvcanary.adapters.vllm", "kv_role": "kv_both"}`). vLLM's default process layout is kept (the
engine core in a child process); the canary's figures come back on vLLM's own Prometheus
counters (`kvcanary_*`, the same series `vllm serve` shows on /metrics).

    python examples/vllm_smoke.py [--requests 20] [--kv-blocks 48] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import random
import sys


def kvcanary_totals() -> dict[str, float]:
    """`kvcanary_*_total` counters of this process's Prometheus registry."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.name.startswith("kvcanary_"):
            out[family.name] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--kv-blocks", type=int, default=48, help="num_gpu_blocks_override")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.environ.setdefault("KVCANARY_MODE", "log")
    from kvcanary.app.vllm.model import ensure_tiny_llama

    model = ensure_tiny_llama()
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype=args.dtype, block_size=32,
              enable_prefix_caching=True, max_model_len=512, max_num_seqs=6,
              max_num_batched_tokens=128, num_gpu_blocks_override=args.kv_blocks,
              enforce_eager=True, gpu_memory_utilization=0.3, seed=args.seed,
              disable_log_stats=False)  # fmt: skip
    rng = random.Random(args.seed)
    shared = [[rng.randrange(1, 512) for _ in range(n)] for n in (70, 100, 40)]
    prompts = [
        {"prompt_token_ids": shared[i % 3] + [rng.randrange(1, 512) for _ in range(20)]}
        for i in range(args.requests)
    ]
    sp = SamplingParams(max_tokens=24, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    totals = kvcanary_totals()
    print(f"requests {len(outs)}, prefix-cache hit tokens "
          f"{sum(o.num_cached_tokens or 0 for o in outs)}")  # fmt: skip
    print(", ".join(f"{k} {int(v)}" for k, v in sorted(totals.items())))
    return 1 if totals.get("kvcanary_violations", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
