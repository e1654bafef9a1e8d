"""How many bytes of KV cache one token costs, from a named model shape."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

PositiveInt = Annotated[int, Field(gt=0)]


class ModelShape(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    name: Annotated[str, Field(min_length=1)]
    layers: PositiveInt
    kv_heads: PositiveInt
    head_size: PositiveInt
    dtype_bytes: PositiveInt

    @property
    def bytes_per_token(self) -> int:
        # K and V for every layer and KV head.
        return self.layers * self.kv_heads * self.head_size * 2 * self.dtype_bytes


# Shapes from the models' published configs (num_hidden_layers, num_key_value_heads, head_dim).
MODEL_SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape(name="llama-3-8b-bf16", layers=32, kv_heads=8, head_size=128, dtype_bytes=2),
        ModelShape(name="llama-3-70b-bf16", layers=80, kv_heads=8, head_size=128, dtype_bytes=2),
        ModelShape(name="qwen2.5-7b-bf16", layers=28, kv_heads=4, head_size=128, dtype_bytes=2),
    )
}


def model_shape(name: str) -> ModelShape:
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ValueError(
            f"unknown model shape {name!r} (known: {', '.join(sorted(MODEL_SHAPES))})"
        ) from None
