"""Whether a turn ended on a tool call, from the engine's own output token ids.

``finish_reason == "tool_calls"`` exists only in vLLM's API server, after its tool parser read
the text; the connector sees the engine request, whose output token ids are all it has. But a
model that calls tools opens (or closes) each call with a marker its tokenizer holds as one
token: ``<tool_call>`` (Qwen, Hermes, GLM), ``[TOOL_CALLS]`` (Mistral), ``<|python_tag|>`` and
``<|eom_id|>`` (Llama 3.x), ``<|python_start|>`` (Llama 4), ``<|call|>`` (gpt-oss's harmony
format ends every tool call with it), ``<｜tool▁calls▁begin｜>`` (DeepSeek), and the families in
``FAMILIES``. ``find_markers`` finds the ones the model uses: a family's marker counts when the
vocabulary holds it as a single token and the chat template names it (a template that never
writes a marker never taught the model to emit it; without a template the vocabulary alone
decides). A deployment may name its markers itself (``configured``): each must be one token of
the vocabulary, and an empty list turns detection off. A model with none says so
(``ToolCallMarkers.describe``), and its word is always None: not known.

The word (``ToolCallMarkers.word``):

- True: a marker is among the output ids. A tool call cut off by ``max_tokens`` after its opening
  marker counts as started: the model chose to call a tool, and an agent that gets a truncated
  call comes back all the same, retrying the turn or reporting the error, with the same context,
  so keeping it through the pause pays as it does for a complete call. A family whose only marker
  closes the call (gpt-oss's ``<|call|>``, Llama 3.1's ``<|eom_id|>``) cannot see a call cut off
  before its end: that turn reads as False.
- False: no marker, and the output was free to write one.
- None: the model has no markers, or the output was constrained by structured output (a forced
  named tool or ``tool_choice: "required"`` makes the server constrain the output to the tool's
  JSON arguments, with no marker in it, and so does a JSON response format): no marker there
  says nothing. A marker seen even so is still True.

Llama 3.x's JSON tool calls (custom tools) start with plain ``{`` and carry no marker: only its
built-in tools' ``<|python_tag|>`` / ``<|eom_id|>`` are seen. Nothing here knows vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str
    opening: tuple[str, ...]  # markers that open a tool call
    closing: tuple[str, ...] = ()  # markers that only end one (a cut-off call lacks them)


FAMILIES: tuple[Family, ...] = (
    Family("qwen/hermes/glm", ("<tool_call>",)),
    Family("mistral", ("[TOOL_CALLS]",)),
    Family("llama3", ("<|python_tag|>",), ("<|eom_id|>",)),
    Family("llama4", ("<|python_start|>",)),
    Family("gpt-oss", (), ("<|call|>",)),
    Family("deepseek", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                        "<｜tool_calls_begin｜>", "<｜tool_call_begin｜>")),
    Family("kimi-k2", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")),
    Family("granite", ("<|tool_call|>",)),
    Family("internlm2", ("<|action_start|>",)),
    Family("jamba", ("<tool_calls>",)),
    Family("minimax", ("<minimax:tool_call>",)),
    Family("longcat", ("<longcat_tool_call>",)),
    Family("functiongemma", ("<start_function_call>",)),
    Family("lfm2", ("<|tool_call_start|>",)),
)


@dataclass(frozen=True)
class ToolCallMarkers:
    """The tool-call marker tokens of one model; ``source`` says where they came from."""

    source: str  # "vocabulary" (found), "config" (named by the deployment), or "none"
    families: tuple[str, ...]  # the families whose markers were found
    names: tuple[str, ...]  # the marker strings, in FAMILIES' order
    token_ids: frozenset[int]
    reason: str = ""  # why there are none, when there are none

    @property
    def found(self) -> bool:
        return bool(self.token_ids)

    def detect(self, output_token_ids: Iterable[int]) -> bool:
        """Whether a marker is among ``output_token_ids`` (an opening one alone counts)."""
        return not self.token_ids.isdisjoint(output_token_ids)

    def word(self, output_token_ids: Iterable[int], *, constrained: bool = False) -> bool | None:
        """The engine's word on the turn's end (module docstring): True, False or None."""
        if not self.token_ids:
            return None
        if self.detect(output_token_ids):
            return True
        return None if constrained else False

    def describe(self) -> str:
        """The line the connector logs at start."""
        if not self.token_ids:
            return f"tool-call detection off: {self.reason}"
        marks = ", ".join(f"{n}" for n in self.names)
        where = ("named in kv_connector_extra_config" if self.source == "config"
                 else f"found in the tokenizer ({', '.join(self.families)})")
        return (f"tool-call detection on: markers {marks} ({len(self.token_ids)} token ids) "
                f"{where}; a turn whose output holds one is a tool-call turn")


def find_markers(vocab: Mapping[str, int], chat_template: str | None = None, *,
                 configured: Sequence[str] | None = None) -> ToolCallMarkers:
    """The model's tool-call markers: ``configured`` when given (ValueError for a string that is
    not one token of ``vocab``), else the families' markers the vocabulary holds and the chat
    template names (module docstring)."""
    if configured is not None:
        return _configured(vocab, configured)
    families: list[str] = []
    names: list[str] = []
    for family in FAMILIES:
        found = [m for m in (*family.opening, *family.closing)
                 if m in vocab and (chat_template is None or m in chat_template)]
        if found:
            families.append(family.name)
            names.extend(found)
    if not names:
        why = ("no known tool-call marker is a token of this tokenizer" if chat_template is None
               else "no known tool-call marker is both a token of this tokenizer and named in "
               "its chat template")
        return ToolCallMarkers("none", (), (), frozenset(), reason=why)
    return ToolCallMarkers("vocabulary", tuple(families), tuple(names),
                           frozenset(vocab[n] for n in names))


def _configured(vocab: Mapping[str, int], configured: Sequence[str]) -> ToolCallMarkers:
    if isinstance(configured, str):
        raise TypeError("tool-call markers must be a list of strings, not one string")
    missing = [m for m in configured if m not in vocab]
    if missing:
        raise ValueError(
            f"tool-call markers {missing} are not single tokens of this model's tokenizer: a "
            "marker must be one token (its special or added tokens)")
    if not configured:
        return ToolCallMarkers("none", (), (), frozenset(),
                               reason="turned off in kv_connector_extra_config (no markers)")
    names = tuple(dict.fromkeys(configured))
    return ToolCallMarkers("config", (), names, frozenset(vocab[n] for n in names))
