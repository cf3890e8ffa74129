"""Your own vLLM script with the kvcanary plugin (needs the `[vllm]` extra; not a test).

The plugin is loaded by vLLM itself through the `vllm.general_plugins` entry point when
`KVCANARY_MODE` is `log` or `raise`; nothing here calls into kvcanary before `LLM(...)` except
to write the tiny model. The engine core runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the canary sweeps vLLM's prefix cache and can be read
back afterwards.

    python examples/vllm_smoke.py [--requests 20] [--kv-blocks 48]
"""

from __future__ import annotations

import argparse
import os
import random
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--kv-blocks", type=int, default=48, help="num_gpu_blocks_override")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0", KVCANARY_MODE="log", KVCANARY_REAL_DATA="all",
        KVCANARY_SWEEP_INTERVAL="4", KVCANARY_ENABLE_VERIFY_TOKEN_ASSERT="1",
    )  # fmt: skip
    from kvcanary.app.vllm.model import ensure_tiny_llama

    model = ensure_tiny_llama()
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", block_size=32,
              enable_prefix_caching=True, max_model_len=512, max_num_seqs=6,
              max_num_batched_tokens=128, num_gpu_blocks_override=args.kv_blocks,
              enforce_eager=True, gpu_memory_utilization=0.3, seed=args.seed)  # fmt: skip
    rng = random.Random(args.seed)
    shared = [[rng.randrange(1, 512) for _ in range(n)] for n in (70, 100, 40)]
    prompts = [
        {"prompt_token_ids": shared[i % 3] + [rng.randrange(1, 512) for _ in range(20)]}
        for i in range(args.requests)
    ]
    sp = SamplingParams(max_tokens=24, temperature=0.0, detokenize=False, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)

    from kvcanary.adapters.vllm.plugin import canaries
    from kvcanary.adapters.vllm.state import STATE

    canary = canaries()[0]
    print(
        f"requests {len(outs)}, prefix-cache hit tokens {sum(o.num_cached_tokens or 0 for o in outs)}"
    )
    print(f"forwards {STATE.counters.forwards}, slot checks {sum(canary.slot_run_counter.values())}, "
          f"sweeps {canary.sweep_passes}, violations {canary.total_violations}")  # fmt: skip
    for v in canary.drain_violations()[:3]:
        print(v.message.splitlines()[0])
    return 1 if canary.total_violations else 0


if __name__ == "__main__":
    sys.exit(main())
