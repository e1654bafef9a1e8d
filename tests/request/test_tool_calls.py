"""Tool-call marker detection per model family, on vocabularies built here (no downloads)."""

from __future__ import annotations

import pytest

from kvci_plugin.request.tool_calls import FAMILIES, ToolCallMarkers, find_markers

# Plain text tokens every vocabulary below shares.
TEXT = {"Hello": 0, " world": 1, "{": 2, '"name"': 3, ":": 4, '"get_weather"': 5, "}": 6}
ANSWER = [0, 1]  # "Hello world": no tool call
ARGS = [2, 3, 4, 5, 6]  # a tool's JSON, as a forced named tool writes it (no marker)


def vocab(*specials: str) -> dict[str, int]:
    words = dict(TEXT)
    for special in specials:
        words[special] = 1000 + len(words)
    return words


# family, its special tokens, a chat template naming them, the marker a call opens (or ends) with,
# whether that marker opens the call (False: it only ends it)
CASES = [
    ("qwen/hermes/glm", ("<tool_call>", "</tool_call>", "<|im_end|>"),
     "{% if tools %}<tool_call>\n{{ tool_call }}\n</tool_call>{% endif %}", "<tool_call>", True),
    ("mistral", ("[TOOL_CALLS]", "[INST]", "[/INST]"),
     "[INST]{{ m }}[/INST]{% for t in tool_calls %}[TOOL_CALLS]{{ t }}{% endfor %}",
     "[TOOL_CALLS]", True),
    ("llama3", ("<|python_tag|>", "<|eom_id|>", "<|eot_id|>"),
     "{{'<|python_tag|>' + call}}{{ '<|eom_id|>' if builtin else '<|eot_id|>' }}",
     "<|python_tag|>", True),
    ("llama4", ("<|python_start|>", "<|python_end|>", "<|eot|>"),
     "<|python_start|>{{ call }}<|python_end|>", "<|python_start|>", True),
    ("gpt-oss", ("<|channel|>", "<|message|>", "<|call|>", "<|end|>"),
     "<|channel|>commentary to=functions.{{n}}<|message|>{{a}}<|call|>", "<|call|>", False),
    ("deepseek", ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"),
     "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>",
     "<｜tool▁calls▁begin｜>", True),
    ("kimi-k2", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|im_end|>"),
     "<|tool_calls_section_begin|><|tool_call_begin|>{{ id }}", "<|tool_calls_section_begin|>",
     True),
    ("granite", ("<|tool_call|>", "<|end_of_text|>"), "<|tool_call|>{{ calls }}",
     "<|tool_call|>", True),
]


def markers_of(case: tuple) -> tuple[ToolCallMarkers, dict[str, int], str, bool]:
    _, specials, template, marker, opens = case
    words = vocab(*specials)
    return find_markers(words, template), words, marker, opens


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_family_is_found_from_vocabulary_and_template(case: tuple) -> None:
    markers, words, marker, _ = markers_of(case)
    assert markers.found and markers.source == "vocabulary"
    assert markers.families == (case[0],)
    assert words[marker] in markers.token_ids
    # Only markers: text and the template's other special tokens are not tool calls.
    family = next(f for f in FAMILIES if f.name == case[0])
    others = {words[s] for s in case[1] if s not in (*family.opening, *family.closing)}
    assert others and not markers.token_ids & (others | {words["Hello"]})
    assert "tool-call detection on" in markers.describe() and marker in markers.describe()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_marker_present_is_a_tool_call_and_its_absence_is_not(case: tuple) -> None:
    markers, words, marker, opens = markers_of(case)
    call = [*ANSWER, words[marker], *ARGS] if opens else [*ANSWER, *ARGS, words[marker]]
    assert markers.detect(call) and markers.word(call) is True
    assert not markers.detect(ANSWER) and markers.word(ANSWER) is False
    assert markers.word([]) is False  # an empty output holds no call either


@pytest.mark.parametrize("case", [c for c in CASES if c[4]], ids=[c[0] for c in CASES if c[4]])
def test_a_call_cut_off_by_max_tokens_after_its_opening_marker_counts(case: tuple) -> None:
    markers, words, marker, _ = markers_of(case)
    cut = [*ANSWER, words[marker], 2, 3]  # the call opened, its arguments cut off mid-way
    assert markers.word(cut) is True


def test_a_closing_only_family_cannot_see_a_call_cut_off_before_its_end() -> None:
    gpt_oss = next(c for c in CASES if c[0] == "gpt-oss")
    markers, words, _, _ = markers_of(gpt_oss)
    cut = [words["<|channel|>"], *ARGS[:3]]  # the call's start, then max_tokens
    assert markers.word(cut) is False


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_forced_named_tool_writes_no_marker_and_its_word_is_unknown(case: tuple) -> None:
    markers, words, marker, _ = markers_of(case)
    # tool_choice naming a tool: the server constrains the output to the tool's JSON arguments.
    assert markers.word(ARGS, constrained=True) is None
    assert markers.word(ARGS, constrained=False) is False
    assert markers.word([*ARGS, words[marker]], constrained=True) is True


def test_a_marker_the_template_never_names_does_not_count() -> None:
    # A base model's tokenizer with Qwen's added tokens but a template without tools.
    words = vocab("<tool_call>", "<|im_start|>", "<|im_end|>")
    markers = find_markers(words, "<|im_start|>{{ role }}\n{{ content }}<|im_end|>")
    assert not markers.found and markers.source == "none"
    assert markers.word([words["<tool_call>"]]) is None
    assert "detection off" in markers.describe() and "chat template" in markers.describe()
    # Without a template the vocabulary alone decides.
    assert find_markers(words, None).token_ids == {words["<tool_call>"]}


def test_a_model_with_no_marker_says_so_and_never_gives_a_word() -> None:
    markers = find_markers(vocab("<s>", "</s>"), "{{ bos_token }}{{ m }}")
    assert not markers.found
    assert markers.word([0, 1, 2]) is None and not markers.detect([0, 1, 2])
    assert markers.describe().startswith("tool-call detection off")


def test_a_marker_spelled_as_text_tokens_is_not_a_marker() -> None:
    # "<tool_call>" split into ordinary pieces is not one token: nothing is found.
    words = {**TEXT, "<tool": 50, "_call>": 51}
    assert not find_markers(words, "<tool_call>").found


def test_configured_markers_override_the_families() -> None:
    words = vocab("<tool_call>", "<|my_call|>")
    template = "<tool_call>"
    markers = find_markers(words, template, configured=["<|my_call|>"])
    assert markers.source == "config" and markers.token_ids == {words["<|my_call|>"]}
    assert markers.word([words["<tool_call>"]]) is False  # the family's marker no longer counts
    assert markers.word([words["<|my_call|>"]]) is True
    assert "kv_connector_extra_config" in markers.describe()


def test_an_empty_configured_list_turns_detection_off() -> None:
    words = vocab("<tool_call>")
    markers = find_markers(words, "<tool_call>", configured=[])
    assert not markers.found and "turned off" in markers.describe()
    assert markers.word([words["<tool_call>"]]) is None


def test_a_configured_marker_that_is_not_one_token_is_refused() -> None:
    with pytest.raises(ValueError, match="not single tokens"):
        find_markers(vocab("<tool_call>"), None, configured=["<tool_call>", "<call>"])
    with pytest.raises(TypeError, match="list of strings"):
        find_markers(vocab("<tool_call>"), None, configured="<tool_call>")


def test_a_model_with_two_families_markers_counts_both() -> None:
    words = vocab("<tool_call>", "<|python_tag|>")
    markers = find_markers(words, "<tool_call><|python_tag|>")
    assert markers.families == ("qwen/hermes/glm", "llama3")
    assert markers.token_ids == {words["<tool_call>"], words["<|python_tag|>"]}


def test_every_family_names_at_least_one_marker() -> None:
    assert all(family.opening or family.closing for family in FAMILIES)
    names = [m for f in FAMILIES for m in (*f.opening, *f.closing)]
    assert len(names) == len(set(names))
