"""The model's tool-call markers, read once at start from vLLM's tokenizer (the engine's word on a
turn's end: `kvci_plugin.request.tool_calls`).

A tokenizer that cannot be read (``skip_tokenizer_init``, or any failure) turns detection off with
a line in the log: kvci is an optimization, and without markers every turn reads "not known", as
when a client says nothing. Markers named in the config that are not single tokens are a
configuration error and stop the start, with the reason.
"""

from __future__ import annotations

import logging
from typing import Any

from kvci_plugin.request.tool_calls import ToolCallMarkers, find_markers

logger = logging.getLogger(__name__)


def tool_call_markers(vllm_config: Any, configured: list[str] | None) -> ToolCallMarkers:
    """The markers of the engine's model (``configured`` when the config names them)."""
    try:
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    except Exception as exc:  # noqa: BLE001 - no tokenizer: detection off, the engine serves
        tokenizer, why = None, f"the tokenizer could not be read ({type(exc).__name__}: {exc})"
    else:
        why = "the engine runs without a tokenizer (skip_tokenizer_init)"
    if tokenizer is None:
        markers = ToolCallMarkers("none", (), (), frozenset(), reason=why)
    else:
        markers = find_markers(tokenizer.get_vocab(), _template(tokenizer), configured=configured)
    logger.info("kvci: %s", markers.describe())
    return markers


def _template(tokenizer: Any) -> str | None:
    """The chat template's text (every named template of a dict); None without one."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else None
