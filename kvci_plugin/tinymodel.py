"""A tiny random-weight Llama model, generated locally and deterministically.

With ``sliding_window`` its layers attend within that many tokens (Mistral-style sliding-window
attention through Llama's ``layer_types``), all of them or all but every ``full_attention_every``-th
one: the shapes of the hybrid models vLLM serves with one KV cache group per kind of layer.

Nothing is downloaded: the weights are seeded random tensors written with safetensors, the
tokenizer is a byte-level BPE trained here with ``tokenizers`` on a seeded synthetic corpus.
Used by the demo, the benchmarks and the test suite so that a real vLLM engine can run anywhere.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

# Bumped whenever the generated files change, so a cached model of an older recipe is rebuilt.
RECIPE_VERSION = 1

_WORDS = [
    "agent",
    "tool",
    "call",
    "retrieval",
    "context",
    "cache",
    "prefix",
    "block",
    "token",
    "layer",
    "tensor",
    "memory",
    "host",
    "disk",
    "policy",
    "tenant",
    "session",
    "credential",
    "checkpoint",
    "worth",
    "score",
    "signal",
    "evidence",
    "claim",
    "source",
    "label",
    "region",
    "retention",
    "marking",
    "scope",
    "gate",
    "decision",
    "explain",
    "promote",
    "recommend",
    "advisory",
    "plan",
    "phase",
    "graph",
    "node",
    "edge",
    "query",
    "answer",
    "report",
    "summary",
    "paper",
    "section",
    "figure",
    "table",
    "value",
    "result",
    "error",
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "be",
    "are",
    "was",
    "or",
    "an",
    "not",
    "have",
]


TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")
# A Hermes-style template: the tools listed in a system turn, calls written as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call one or more functions. "
    "<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools> For each call, "
    "return <tool_call>{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{\"name\": "
    "\"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments }}}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the generated model; the defaults start fast and fit the CPU attention kernels."""

    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    vocab_size: int = 1024
    max_position_embeddings: int = 8192
    dtype: str = "bfloat16"
    seed: int = 0
    sliding_window: int = 0  # 0: every layer attends to the whole context
    full_attention_every: int = 0  # with a window: every n-th layer attends to all (0: none does)
    # Tool calls: `<tool_call>` / `</tool_call>` as special tokens and a Hermes-style chat template
    # that names them (vLLM's `hermes` tool parser reads them; kvci's marker detection finds them).
    tool_calls: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "intermediate_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_size < 300:
            raise ValueError("vocab_size must be >= 300 (256 byte tokens + merges + specials)")
        if self.sliding_window < 0 or self.full_attention_every < 0:
            raise ValueError("sliding_window and full_attention_every must be >= 0")
        if self.full_attention_every and not self.sliding_window:
            raise ValueError("full_attention_every needs a sliding_window")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, not {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def layer_types(self) -> list[str] | None:
        if not self.sliding_window:
            return None
        every = self.full_attention_every
        return ["full_attention" if every and (n + 1) % every == 0 else "sliding_attention"
                for n in range(self.num_layers)]

    def slug(self) -> str:
        window = ""
        if self.sliding_window:
            window = f"-sw{self.sliding_window}" + (
                f"f{self.full_attention_every}" if self.full_attention_every else "")
        return (f"llama-l{self.num_layers}-h{self.hidden_size}-a{self.num_heads}"
                f"-kv{self.num_kv_heads}-v{self.vocab_size}-{self.dtype}-s{self.seed}{window}"
                f"{'-tc' if self.tool_calls else ''}-r{RECIPE_VERSION}")


def default_cache_dir() -> Path:
    """Where generated models live unless a caller says otherwise."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvci" / "models"


def corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """A seeded synthetic corpus: the tokenizer's training data and a source of prompts."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 24))) for _ in range(n_lines)]


def _train_tokenizer(spec: TinyModelSpec, out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(spec.seed), trainer=trainer)
    if spec.tool_calls:
        tok.add_special_tokens(list(TOOL_CALL_TOKENS))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": spec.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
    } | ({"chat_template": TOOL_CHAT_TEMPLATE} if spec.tool_calls else {}), indent=2))
    return tok.get_vocab_size()


def _weights(spec: TinyModelSpec) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    h, i, v, d = spec.hidden_size, spec.intermediate_size, spec.vocab_size, spec.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.05).to(dtype)

    w = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": torch.ones(h, dtype=dtype),
         "lm_head.weight": rand(v, h)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        w[p + "self_attn.q_proj.weight"] = rand(spec.num_heads * d, h)
        w[p + "self_attn.k_proj.weight"] = rand(spec.num_kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = rand(spec.num_kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, spec.num_heads * d)
        w[p + "mlp.gate_proj.weight"] = rand(i, h)
        w[p + "mlp.up_proj.weight"] = rand(i, h)
        w[p + "mlp.down_proj.weight"] = rand(h, i)
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    return w


def _spec_fields(spec: TinyModelSpec) -> dict:
    """The spec as config.json records it (``tool_calls`` only when set: the default model's files
    stay as they were before the option existed)."""
    fields = asdict(spec)
    if not spec.tool_calls:
        del fields["tool_calls"]
    return fields


def _config(spec: TinyModelSpec) -> dict:
    window = {} if not spec.sliding_window else {
        "sliding_window": spec.sliding_window, "layer_types": spec.layer_types}
    return window | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": spec.dtype,
        "kvci_tiny_model": _spec_fields(spec) | {"recipe_version": RECIPE_VERSION},
    }


def make_tiny_model(spec: TinyModelSpec | None = None, cache_dir: Path | None = None) -> Path:
    """Return the folder of the model for ``spec``, generating it on first use (atomically)."""
    spec = spec or TinyModelSpec()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / spec.slug()
    if (final / "config.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        trained = _train_tokenizer(spec, tmp)
        if trained > spec.vocab_size:
            raise ValueError(
                f"tokenizer has {trained} tokens, more than vocab_size {spec.vocab_size}"
            )
        save_file(_weights(spec), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(_config(spec), indent=2))
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 0, "eos_token_id": 1})
        )
        try:
            tmp.rename(final)
        except OSError:
            if not (final / "config.json").exists():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Generate the tiny random-weight Llama model.")
    for field, default in asdict(TinyModelSpec()).items():
        if isinstance(default, bool):
            ap.add_argument("--" + field.replace("_", "-"), action="store_true")
            continue
        ap.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    ap.add_argument("--cache-dir", type=Path, default=None)
    args = vars(ap.parse_args(argv))
    cache_dir = args.pop("cache_dir")
    print(make_tiny_model(TinyModelSpec(**args), cache_dir))


if __name__ == "__main__":
    main()
