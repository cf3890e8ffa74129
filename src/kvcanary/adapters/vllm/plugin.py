"""The `vllm.general_plugins` entry point: the `KVCANARY_MODE` shortcut and one compatibility
fix. vLLM loads general plugins in every process (API server, engine core, workers).

In every process the entry point also registers `KVCanaryConnector` by name with vLLM's
`KVConnectorFactory.register_connector` (public API, no patch). Without it a `MultiConnector` that
holds the canary (the shortcut beside a user's connector, or a user's own composition) kills the
server at its first stats: the API-server process rebuilds each child's `KVConnectorStats` from
the engine core's dict by class name (`MultiConnector.build_kv_connector_stats` ->
`get_connector_class_by_name`), which raises "Connector 'KVCanaryConnector' is not registered".

Monkeypatches (each named in docs/architecture.md, each with a signature test in
tests/adapters/test_vllm_hooks.py):

- `EngineArgs.create_engine_config` (vllm/engine/arg_utils.py), only with
  `KVCANARY_MODE=log|raise|recover` (recover: with `kv_load_failure_policy=recompute`):
  before vLLM builds its config, add the `KVCanaryConnector` kv-transfer config (or wrap a user's
  own connector and the canary in a `MultiConnector`). vLLM has no hook for a plugin to add a
  connector.
- `vllm.v1.engine.exceptions.EngineDeadError.__init__` (vllm/v1/engine/exceptions.py), always:
  vLLM answers every in-flight request of a dead engine core with one fixed message ("EngineCore
  encountered an issue. See stack trace (above) ..."), in the API-server process, apart from the
  worker where raise mode stopped it. The wrapper puts the violation's first line (the worker
  writes it to the `STOP_NOTE_ENV` file, a name the first vLLM process picks and its children
  inherit) in front of that message, so clients see which kv-canary violation stopped vLLM.
- Not a patch: on a CPU with AMX the entry point asks the kernel for AMX tile state in every
  process (`torch.cpu._init_amx`, Linux `arch_prctl(ARCH_REQ_XCOMP_PERM)`). vLLM 0.32's CPU
  attention picks its `amx` kernel for bf16 without asking; when that kernel is the first AMX code
  a worker runs (a decode engine whose first forward reads KV a connector landed, seen with
  ExampleConnector, no canary installed) the worker dies of SIGILL ("Illegal instruction"). A
  first forward without cached context goes through torch's oneDNN path, which asks, so single
  engines never showed it.
- `vllm.triton_utils.dispatcher._rebind_kernels`, always: `kvcanary.canary` imports numba
  (llvmlite); vLLM 0.32's `register_triton_kernel_overrides` (run in `init_worker`) scans every
  module namespace and crashes on llvmlite's `ffi.lib` (`AttributeError: '_lib_fn_wrapper' object
  has no attribute 'get'`). The wrapper hides `ffi.lib` during that pure-Python scan.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = [
    "CONNECTOR_CONFIG",
    "STOP_NOTE_ENV",
    "apply_patches",
    "canary_transfer_config",
    "enable_amx_tiles",
    "recover_policy",
    "register_connector_name",
    "register_from_env",
    "write_stop_note",
]

#: the file raise mode writes its violation's first line to (set once, inherited by children)
STOP_NOTE_ENV = "KVCANARY_VLLM_STOP_NOTE"

logger = logging.getLogger("kvcanary")

#: the kv-transfer config that enables the canary
CONNECTOR_CONFIG: dict[str, Any] = {
    "kv_connector": "KVCanaryConnector",
    "kv_connector_module_path": "kvcanary.adapters.vllm",
    "kv_role": "kv_both",
}


def canary_transfer_config(existing: Any) -> Any:
    """The `KVTransferConfig` with the canary: ours alone, `existing` unchanged when it already
    names the canary, or a `MultiConnector` of `existing`'s connector(s) followed by the canary
    (last, so its HEAD runs after a real connector's synchronous loads). Every other field of
    `existing` (its `kv_load_failure_policy` included) is kept as the user set it."""
    from vllm.config import KVTransferConfig

    if existing is None or existing.kv_connector is None:
        return KVTransferConfig(**CONNECTOR_CONFIG, **recover_policy())
    if existing.kv_connector == CONNECTOR_CONFIG["kv_connector"]:
        return existing
    extra = dict(existing.kv_connector_extra_config or {})
    if existing.kv_connector == "MultiConnector":
        children = list(extra.get("connectors", []))
        if any(c.get("kv_connector") == CONNECTOR_CONFIG["kv_connector"] for c in children):
            return existing
        extra["connectors"] = [*children, dict(CONNECTOR_CONFIG)]
    else:
        user = {
            "kv_connector": existing.kv_connector, "kv_role": existing.kv_role,
            "kv_connector_extra_config": extra,
        }  # fmt: skip
        if existing.kv_connector_module_path:
            user["kv_connector_module_path"] = existing.kv_connector_module_path
        extra = {"connectors": [user, dict(CONNECTOR_CONFIG)]}
    # every other top-level field stays the user's (kv_load_failure_policy, ports, engine id)
    return dataclasses.replace(existing, kv_connector="MultiConnector",
                               kv_role=existing.kv_role or "kv_both",
                               kv_connector_module_path=None,
                               kv_connector_extra_config=extra)  # fmt: skip


def recover_policy(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`kv_load_failure_policy=recompute` when `KVCANARY_MODE=recover` and the canary's own
    kv-transfer config is built (vLLM's default `fail` would fail every damaged request; a user's
    own `--kv-transfer-config` keeps its policy)."""
    env = os.environ if environ is None else environ
    recover = env.get("KVCANARY_MODE", "").strip().lower() == "recover"
    return {"kv_load_failure_policy": "recompute"} if recover else {}


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    if getattr(original, "__kvcanary_wrapped__", False):
        return
    wrapped = make(original)
    wrapped.__kvcanary_wrapped__ = True  # type: ignore[attr-defined]
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapped)


@contextlib.contextmanager
def _llvmlite_lib_hidden() -> Iterator[None]:
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "__dict__", {}).pop("lib", None) if ffi is not None else None
    try:
        yield
    finally:
        if lib is not None:
            ffi.__dict__["lib"] = lib  # type: ignore[union-attr]


def _scan_safe_rebind(orig: Callable[..., Any]) -> Callable[..., Any]:
    def _rebind_kernels(*args: Any, **kw: Any) -> Any:
        with _llvmlite_lib_hidden():  # no llvmlite call can run during this pure-Python scan
            return orig(*args, **kw)

    return _rebind_kernels


def _add_connector(orig: Callable[..., Any]) -> Callable[..., Any]:
    def create_engine_config(self: Any, *args: Any, **kw: Any) -> Any:
        before = self.kv_transfer_config
        self.kv_transfer_config = canary_transfer_config(before)
        if self.kv_transfer_config is not before:
            logger.info("kv-canary: KVCANARY_MODE adds --kv-transfer-config %s",
                        json.dumps(self.kv_transfer_config.kv_connector))  # fmt: skip
        return orig(self, *args, **kw)

    return create_engine_config


def write_stop_note(line: str) -> None:
    """Raise mode, in the worker: leave the violation's first line for the API server."""
    path = os.environ.get(STOP_NOTE_ENV)
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(line.splitlines()[0] if line else "")


def _stop_note() -> str:
    path = os.environ.get(STOP_NOTE_ENV)
    if not path:
        return ""
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _name_the_violation(orig: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kw: Any) -> None:
        orig(self, *args, **kw)
        note = _stop_note()
        if note and self.args:
            self.args = (f"kv-canary: raise mode stopped vLLM: {note} ({self.args[0]})",
                         *self.args[1:])  # fmt: skip

    return __init__


def _pick_stop_note() -> None:
    """The first vLLM process names the note file; its children (engine core, workers) inherit
    the name. The file exists only once raise mode stopped vLLM; the namer removes it at exit."""
    if os.environ.get(STOP_NOTE_ENV):
        return
    path = os.path.join(tempfile.gettempdir(), f"kvcanary-vllm-stop-{os.getpid()}.txt")
    with contextlib.suppress(OSError):
        os.unlink(path)  # a stale note of an earlier process with this pid
    os.environ[STOP_NOTE_ENV] = path
    atexit.register(_remove, path)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def apply_patches(shortcut: bool) -> None:
    """The scan fix and the client-facing stop message always; the connector shortcut when
    `shortcut`."""
    from vllm.triton_utils import dispatcher
    from vllm.v1.engine import exceptions

    _wrap(dispatcher, "_rebind_kernels", _scan_safe_rebind)
    _pick_stop_note()
    _wrap(exceptions.EngineDeadError, "__init__", _name_the_violation)
    if shortcut:
        from vllm.engine.arg_utils import EngineArgs

        _wrap(EngineArgs, "create_engine_config", _add_connector)


def register_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Apply the patches; True when `KVCANARY_MODE` asks for the canary (log or raise)."""
    env = os.environ if environ is None else environ
    mode = env.get("KVCANARY_MODE", "none").strip().lower()
    if mode not in ("", "none", "off", "log", "raise", "recover"):
        raise ValueError(
            f"kv-canary: KVCANARY_MODE must be one of none/log/raise/recover, got {mode!r}"
        )
    shortcut = mode in ("log", "raise", "recover")
    _ensure_log_handler()
    quiet_sweep_lines()
    enable_amx_tiles()
    register_connector_name()
    apply_patches(shortcut)
    return shortcut


def enable_amx_tiles() -> bool:
    """Ask for AMX tile state in this process where the CPU has AMX (see the module docstring:
    vLLM's `amx` attention kernel otherwise dies of SIGILL when it is the first AMX code to run).
    True when the permission is held; False on a CPU without AMX or where the kernel refuses."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return False
    granted = bool(torch.cpu._init_amx())
    if not granted:
        logger.warning("kv-canary: this CPU has AMX but the kernel refused AMX tile state; "
                       "vLLM's amx attention may stop with SIGILL")  # fmt: skip
    return granted


def register_connector_name() -> None:
    """Register `KVCanaryConnector` with vLLM's connector factory under its class name, once per
    process (vLLM raises on a second registration of a name)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = CONNECTOR_CONFIG["kv_connector"]
    if name not in KVConnectorFactory._registry:  # no public "is registered" query in 0.32
        KVConnectorFactory.register_connector(
            name, CONNECTOR_CONFIG["kv_connector_module_path"], name
        )


def _ensure_log_handler() -> None:
    """Give the `kvcanary` logger a stderr handler when nothing would print its lines (vLLM
    configures only its own `vllm` logger; an engine-core child has no root handler)."""
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def quiet_sweep_lines() -> None:
    """Keep the canary's per-sweep INFO line (logger `kvcanary.sweep`) at WARNING in vLLM's
    processes unless that logger's level was set (a logging config, vLLM's
    `VLLM_LOGGING_CONFIG_PATH`): with a sweep every 4 steps it is dozens of lines a second under
    load, each costing its step ~90 us to write (docs/performance.md). Sweeps are counted on
    `/metrics` (`kvcanary_sweeps_total`); `logging.getLogger("kvcanary.sweep").setLevel("INFO")`
    prints each one again."""
    sweeps = logging.getLogger("kvcanary.sweep")
    if sweeps.level == logging.NOTSET:
        sweeps.setLevel(logging.WARNING)


def canaries() -> list[Any]:
    """The canaries installed in this process (one per live worker-side connector)."""
    from kvcanary.adapters.vllm.state import STATE

    return [c.worker.canary for c in STATE.live_connectors() if c.worker is not None]
