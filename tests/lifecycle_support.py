"""What the lifecycle test and its node script share: prompts and the in-place weight update."""

from __future__ import annotations

import random
from typing import Any

from engine import BLOCK_SIZE

_rng = random.Random(41)


def _tokens(n: int) -> list[int]:
    return [_rng.randrange(2, 1000) for _ in range(n)]


PROMPTS = {"acme": _tokens(5 * BLOCK_SIZE + 7), "globex": _tokens(4 * BLOCK_SIZE + 3),
           "node_b": _tokens(4 * BLOCK_SIZE + 9)}


def update_weights_in_place(worker: Any) -> None:
    """Through `collective_rpc`, as an RL trainer's weight sync would: scale the first layer's
    input norm, which changes every K and V it computes. (The CPU backend may repack projection
    weights at load, so editing those in place would change nothing.)"""
    import torch

    model = worker.model_runner.model
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(3.0)
