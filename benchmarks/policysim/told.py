"""What kvci's default policy saves when clients say the run will be back, and when what they say
is noise.

An agent knows when its turn ends on a tool call: the run will be back with the same prefix. It
says so in ``kvci.observation`` (``tool_call_pending: true``), and kvci's ``ValuePolicy`` classes
each context by what was said of it, learning how often each class comes back, as it learns
everything else (evidence, not an order). A trace records no such word, so:

- ``kvci-told``: the client says ``tool_call_pending: true`` exactly for the requests whose
  session continues later (read from the trace's future, as the ``oracle`` bound reads it) and
  says nothing otherwise: a bound on what the word buys a client that is always right, run
  through the product's whole path (advisor, cache gate, RAM index, policy).
- ``kvci-told-random``: the same number of ``true`` said of requests drawn at random: a word
  that carries no information, the control for what classing by it costs when it is noise.

The default ``kvci`` run says nothing (``tool_call_pending`` unset), as the trace does.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

NAME = "kvci-told"
RANDOM_NAME = "kvci-told-random"


def told_when_back(continued: Sequence[bool]) -> list[bool | None]:
    """``tool_call_pending`` per request: true when its session continues, not said otherwise."""
    return [True if later else None for later in continued]


def told_at_random(continued: Sequence[bool], *, seed: int) -> list[bool | None]:
    """As many ``true`` as ``told_when_back`` says, at requests drawn at random."""
    said = random.Random(seed).sample(range(len(continued)), sum(continued))
    told: list[bool | None] = [None] * len(continued)
    for index in said:
        told[index] = True
    return told
