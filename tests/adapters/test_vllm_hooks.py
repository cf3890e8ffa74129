"""Every vLLM function the adapter wraps or relies on, checked against the installed vLLM: a
signature or call-order change in vLLM fails here first (docs/architecture.md lists them)."""

from __future__ import annotations

import inspect
import logging

import pytest

pytestmark = pytest.mark.vllm


def params(fn: object) -> list[str]:
    return list(inspect.signature(fn).parameters)  # type: ignore[arg-type]


def test_wrapped_functions_keep_their_signatures() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.triton_utils import dispatcher
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert params(EngineArgs.create_engine_config)[:3] == ["self", "usage_context", "headless"]
    assert callable(dispatcher._rebind_kernels)
    assert params(BlockPool.cache_full_blocks)[:5] == [
        "self",
        "request",
        "blocks",
        "num_cached_blocks",
        "num_full_blocks",
    ]
    assert params(GPUModelRunner._prepare_inputs)[0] == "self"  # driver-only fault hook
    for name in ("_maybe_evict_cached_block", "get_cached_block"):  # the stale_prefix_hit plant
        assert name in BlockPool.__dict__, name
    assert params(BlockPool.get_cached_block)[:3] == ["self", "block_hash", "kv_cache_group_ids"]


def test_engine_dead_error_still_carries_its_message_in_args() -> None:
    """The plugin prefixes the violation to `args[0]`; clients see `str(exc)`."""
    import os

    from vllm.v1.engine.exceptions import EngineDeadError

    from kvcanary.adapters.vllm.plugin import STOP_NOTE_ENV, apply_patches, write_stop_note

    assert params(EngineDeadError.__init__)[:2] == ["self", "args"]
    apply_patches(shortcut=False)
    path = os.environ[STOP_NOTE_ENV]
    assert "EngineCore encountered an issue" in str(EngineDeadError())
    assert not str(EngineDeadError()).startswith("kv-canary")  # no note: vLLM's message alone
    try:
        write_stop_note("kv_canary violation: launch_tag=TAIL_V_FULL slot_idx=7\nmore")
        text = str(EngineDeadError())
        assert text.startswith(
            "kv-canary: raise mode stopped vLLM: kv_canary violation: "
            "launch_tag=TAIL_V_FULL slot_idx=7 (EngineCore encountered"
        )
    finally:
        os.unlink(path)


def test_the_connector_api_the_adapter_implements() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.sched.output import SchedulerOutput

    from kvcanary.adapters.vllm.connector import KVCanaryConnector

    base = KVConnectorBase_V1
    for name in ("register_kv_caches", "start_load_kv", "wait_for_save", "bind_gpu_block_pool",
                 "build_connector_meta", "build_connector_worker_meta", "get_kv_connector_stats",
                 "build_prom_metrics", "get_block_ids_with_load_errors",
                 "update_connector_output", "build_kv_connector_stats"):  # fmt: skip
        theirs = params(getattr(base, name))
        assert params(getattr(KVCanaryConnector, name))[: len(theirs)] == theirs, name
    assert not inspect.isabstract(KVCanaryConnector)
    assert "has_sync_kv_loads" in SchedulerOutput.__dataclass_fields__


def test_vllm_calls_start_load_kv_before_the_forward_on_sync_load_steps() -> None:
    from vllm.v1.worker import kv_connector_model_runner_mixin as mixin

    src = inspect.getsource(mixin.KVConnectorModelRunnerMixin._get_kv_connector_output)
    head, _, tail = src.partition("yield output")
    assert "start_after_forward = not scheduler_output.has_sync_kv_loads" in head
    assert "if not start_after_forward:" in head and "start_load_kv(" in head
    assert "wait_for_save()" in tail


def test_register_kv_caches_is_called_by_the_runner_that_owns_the_batch() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner.initialize_kv_cache)
    assert "register_kv_caches(kv_caches)" in src  # the connector finds `self` one frame up


def test_the_shortcut_composes_with_a_users_connector() -> None:
    from vllm.config import KVTransferConfig

    from kvcanary.adapters.vllm.plugin import canary_transfer_config

    ours = canary_transfer_config(None)
    assert ours.kv_connector == "KVCanaryConnector"
    assert ours.kv_connector_module_path == "kvcanary.adapters.vllm"
    assert canary_transfer_config(ours) is ours
    user = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                            kv_connector_extra_config={"shared_storage_path": "/tmp/x"})  # fmt: skip
    multi = canary_transfer_config(user)
    assert multi.kv_connector == "MultiConnector"
    children = multi.kv_connector_extra_config["connectors"]
    assert [c["kv_connector"] for c in children] == ["ExampleConnector", "KVCanaryConnector"]
    assert children[0]["kv_connector_extra_config"] == {"shared_storage_path": "/tmp/x"}
    assert canary_transfer_config(multi).kv_connector_extra_config["connectors"] == children


def test_the_shortcut_keeps_the_users_top_level_settings() -> None:
    # vLLM reads the load-failure policy (and ports, engine id) from the top-level config: a
    # MultiConnector built around the user's connector must not reset them to the defaults
    from vllm.config import KVTransferConfig

    from kvcanary.adapters.vllm.plugin import canary_transfer_config

    user = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_consumer",
                            kv_load_failure_policy="recompute", kv_port=14999,
                            kv_connector_extra_config={"shared_storage_path": "/tmp/x"})  # fmt: skip
    multi = canary_transfer_config(user)
    assert multi.kv_connector == "MultiConnector" and multi.kv_connector_module_path is None
    assert (multi.kv_load_failure_policy, multi.kv_port, multi.kv_role, multi.engine_id) == (
        "recompute",
        14999,
        "kv_consumer",
        user.engine_id,
    )


def test_connector_config_rejects_unknown_keys_and_takes_recover() -> None:
    from kvcanary.adapters.vllm.install import config_from

    cfg = config_from({}, {})
    assert cfg.mode.value == "log" and cfg.real_data.value == "partial"
    assert cfg.sweep_interval == 4 and cfg.enable_verify_token_assert
    assert config_from({"KVCANARY_MODE": "raise"}, {"sweep_interval": 2}).sweep_interval == 2
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key 'bogus'"):
        config_from({}, {"bogus": 1})
    recover = config_from({}, {"mode": "recover"})
    assert recover.recover and recover.enable_verify_token_assert
    assert config_from({}, {}).verify_stride == 1
    assert config_from({"KVCANARY_VERIFY_STRIDE": "2"}, {"verify_stride": 8}).verify_stride == 8
    with pytest.raises(ValueError, match="KVCANARY_VERIFY_STRIDE=4 cannot be used with kv_canary"):
        config_from({}, {"mode": "recover", "verify_stride": 4})


def test_the_scheduler_recover_path_the_adapter_wraps() -> None:
    """Mode `recover` (kvcanary.adapters.vllm.recover): vLLM reads the invalid blocks in the same
    `update_from_output` that applies the step's tokens, before the token loop, and skips the
    requests `_handle_invalid_blocks` returns; the adapter wraps both on the scheduler instance,
    preempts through `_preempt_request`, evicts through `KVCacheManager.evict_blocks` and ends a
    request through the per-step error set `encoder_cache_mismatch_reqs`."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker import kv_connector_model_runner_mixin as mixin

    assert params(Scheduler.update_from_output) == ["self", "scheduler_output",
                                                    "model_runner_output"]  # fmt: skip
    assert params(Scheduler._handle_invalid_blocks) == ["self", "invalid_block_ids",
                                                        "num_scheduled_tokens"]  # fmt: skip
    assert params(Scheduler._preempt_request)[:4] == ["self", "request", "timestamp",
                                                      "drop_stale_output"]  # fmt: skip
    assert params(KVCacheManager.evict_blocks) == ["self", "block_ids"]
    update = inspect.getsource(Scheduler.update_from_output)
    handled = update.index("self._handle_invalid_blocks(")
    loop = update.index("for req_id, num_tokens_scheduled in num_scheduled_tokens.items()")
    skip = update.index("if failed_kv_load_req_ids and req_id in failed_kv_load_req_ids")
    drained = update.index("error_req_ids.update(self.encoder_cache_mismatch_reqs)")
    connector = update.index("self._update_from_kv_xfer_finished(")
    assert handled < loop < skip < drained < connector
    assert "self.connector.bind_kv_cache_manager(self.kv_cache_manager)" in inspect.getsource(
        Scheduler.__init__
    )  # the connector finds the scheduler up the stack
    worker = inspect.getsource(mixin.KVConnectorModelRunnerMixin._get_kv_connector_output)
    _, _, tail = worker.partition("yield output")
    saved = tail.index("wait_for_save()")
    errors = tail.index("get_block_ids_with_load_errors()")
    meta = tail.index("build_connector_worker_meta()")
    assert saved < errors < meta  # TAIL ran before the blocks are read; damage rides the meta


def test_recover_mode_builds_the_recompute_policy() -> None:
    from kvcanary.adapters.vllm.plugin import canary_transfer_config, recover_policy

    assert recover_policy({"KVCANARY_MODE": " Recover "}) == {"kv_load_failure_policy": "recompute"}
    assert recover_policy({"KVCANARY_MODE": "log"}) == {}
    assert canary_transfer_config(None).kv_load_failure_policy in ("fail", "recompute")


def test_a_multiconnector_rebuilds_the_canarys_stats_by_name() -> None:
    # What vLLM's stats logger does in the API-server process with the engine core's dict.
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvcanary.adapters.vllm.connector import KVCanaryConnector, KVCanaryStats
    from kvcanary.adapters.vllm.plugin import register_connector_name

    register_connector_name()
    register_connector_name()  # idempotent: vLLM raises on a second registration
    stats = KVCanaryStats()
    stats.data.update({"forwards": 3, "checks": 40})
    rebuilt = MultiConnector.build_kv_connector_stats(data={"KVCanaryConnector": stats.data})
    assert isinstance(rebuilt.data["KVCanaryConnector"], KVCanaryStats)
    assert rebuilt.data["KVCanaryConnector"].data == stats.data
    assert KVCanaryConnector.__name__ == "KVCanaryConnector"  # the name vLLM keys children by


_AMX_PROBE = """
import ctypes, torch
from kvcanary.adapters.vllm.plugin import enable_amx_tiles
libc = ctypes.CDLL(None, use_errno=True)
def permitted():  # arch_prctl(ARCH_GET_XCOMP_PERM): the XSAVE features this process may use
    mask = ctypes.c_uint64(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(mask)) == 0, ctypes.get_errno()
    return bool(mask.value & (1 << 18))  # XFEATURE_XTILEDATA
before = permitted()
print(torch.cpu._is_amx_tile_supported(), before, enable_amx_tiles(), permitted())
"""


def test_the_plugin_holds_amx_tile_state_where_the_cpu_has_amx() -> None:
    """Detected, not assumed: on an AMX CPU a fresh process lacks the tile permission until the
    plugin asks (vLLM's amx attention would die of SIGILL); elsewhere the plugin asks nothing."""
    import platform
    import subprocess
    import sys

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("arch_prctl XCOMP permissions are Linux x86-64 only")
    done = subprocess.run([sys.executable, "-c", _AMX_PROBE], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    has_amx, before, granted, after = done.stdout.split()[-4:]
    if has_amx == "True":
        assert (before, granted, after) == ("False", "True", "True")
    else:
        assert (granted, after) == ("False", before)


_SWEEP_LINES_PROBE = """
import logging, sys
from kvcanary.adapters.vllm.plugin import register_from_env
if sys.argv[1] == "user-set":
    logging.getLogger("kvcanary.sweep").setLevel(logging.INFO)
register_from_env({"KVCANARY_MODE": "log"})
print(logging.getLogger("kvcanary").getEffectiveLevel(),
      logging.getLogger("kvcanary.sweep").getEffectiveLevel())
"""


@pytest.mark.parametrize(("case", "sweep_level"), [("default", logging.WARNING),
                                                    ("user-set", logging.INFO)])  # fmt: skip
def test_the_plugin_quiets_the_per_sweep_line_unless_its_level_was_set(
    case: str, sweep_level: int
) -> None:
    """In a fresh vLLM process (the plugin's entry point, as vLLM loads it) the canary's other
    INFO lines print but the line per sweep does not, unless the user set its logger's level."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SWEEP_LINES_PROBE, case], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    canary_level, sweeps = map(int, done.stdout.split()[-2:])
    assert canary_level == logging.INFO
    assert sweeps == sweep_level
