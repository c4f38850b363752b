"""Chat encoding: every rendered example of shared/reference/chat-encoding.md, byte for byte."""

import pytest

from cedlm.text.chat import (
    BOS,
    EOS,
    EFFORT_TEMPLATE,
    encode_chat,
    parse_assistant,
    parse_tool_calls,
    render_tool_calls,
    resolve_effort,
)

# name -> (settings, expected prompt), copied from the reference's Python reprs.
EXPECTED = {
    'chat_user': (
        {'thinking_mode': 'chat'},
        '<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>',
    ),
    'think_user_default': (
        {'thinking_mode': 'thinking'},
        '<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n<｜User｜>Hi<｜Assistant｜><think>',
    ),
    'think_sys_low': (
        {'thinking_mode': 'thinking', 'reasoning_effort': 'low'},
        '<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 50 (range 1-100, the higher the value, the more thorough the reasoning)\n\nSYS<｜User｜>Hi<｜Assistant｜><think>',
    ),
    'chat_sys': (
        {'thinking_mode': 'chat', 'reasoning_effort': 'max'},
        '<｜begin▁of▁sentence｜><｜System｜>SYS<｜User｜>Hi<｜Assistant｜></think>',
    ),
    'think_multiturn': (
        {'thinking_mode': 'thinking', 'reasoning_effort': 'max'},
        '<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 100 (range 1-100, the higher the value, the more thorough the reasoning)\n\n<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>',
    ),
    'think_multiturn_keep': (
        {'thinking_mode': 'thinking', 'reasoning_effort': 30, 'drop_thinking': False},
        '<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 30 (range 1-100, the higher the value, the more thorough the reasoning)\n\n<｜User｜>Q1<｜Assistant｜><think>R1</think>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><think>',
    ),
    'tool_roundtrip': (
        {'thinking_mode': 'thinking'},
        '<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\nS\n\n## Tools\n\nYou have access to a set of tools to help answer the user\'s question. You can invoke tools by writing a "<｜DSML｜ calls>" block like the following:\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="$TOOL_NAME">\n<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜ parameter>\n...\n</｜DSML｜ invoke>\n<｜DSML｜ invoke name="$TOOL_NAME2">\n...\n</｜DSML｜ invoke>\n</｜DSML｜ calls>\n\nString parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n{"name": "get_w", "parameters": {"type": "object"}}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n<｜User｜>W?<｜Assistant｜><think>need tool</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_w">\n<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n<｜DSML｜ parameter name="n" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>sunny</tool_result><｜Assistant｜><think>',
    ),
    'mid_system': (
        {'thinking_mode': 'chat'},
        '<｜begin▁of▁sentence｜><｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜System｜>NEW<｜Assistant｜></think>',
    ),
    'latest_reminder': (
        {'thinking_mode': 'chat'},
        '<｜begin▁of▁sentence｜><｜User｜>Q1<｜Assistant｜></think><｜latest_reminder｜>REM',
    ),
    'task_query': (
        {'thinking_mode': 'chat'},
        '<｜begin▁of▁sentence｜><｜User｜>Q1<｜query｜>',
    ),
    'task_action': (
        {'thinking_mode': 'thinking'},
        '<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)\n\n<｜User｜>Q1<｜Assistant｜><think><｜action｜>',
    ),
}

TOOLS = [{"type": "function", "function": {"name": "get_w", "parameters": {"type": "object"}}}]

MESSAGES = {
    "chat_user": [{"role": "user", "content": "Hi"}],
    "think_user_default": [{"role": "user", "content": "Hi"}],
    "think_sys_low": [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Hi"}],
    "chat_sys": [{"role": "system", "content": "SYS"}, {"role": "user", "content": "Hi"}],
    "think_multiturn": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
    ],
    "think_multiturn_keep": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
        {"role": "user", "content": "Q2"},
    ],
    "tool_roundtrip": [
        {"role": "system", "content": "S", "tools": TOOLS},
        {"role": "user", "content": "W?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "need tool",
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_w", "arguments": '{"city": "Paris", "n": 2}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ],
    "mid_system": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "system", "content": "NEW"},
    ],
    "latest_reminder": [{"role": "user", "content": "Q1"}, {"role": "latest_reminder", "content": "REM"}],
    "task_query": [{"role": "user", "content": "Q1", "task": "query"}],
    "task_action": [{"role": "user", "content": "Q1", "task": "action"}],
}


def test_every_reference_example_is_covered():
    assert set(MESSAGES) == set(EXPECTED) and len(EXPECTED) == 11


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_example(name):
    settings, expected = EXPECTED[name]
    assert encode_chat(MESSAGES[name], **settings) == expected


def test_tools_argument_attaches_to_system():
    msgs = [dict(m) for m in MESSAGES["tool_roundtrip"]]
    msgs[0] = {"role": "system", "content": "S"}
    assert encode_chat(msgs, thinking_mode="thinking", tools=TOOLS) == EXPECTED["tool_roundtrip"][1]


def test_tool_arguments_as_dict_and_results_merge_in_call_order():
    calls = [
        {"id": "a", "function": {"name": "f", "arguments": {"x": "1"}}},
        {"id": "b", "function": {"name": "g", "arguments": {"y": [1, 2], "z": True}}},
    ]
    msgs = [
        {"role": "system", "content": "S", "tools": TOOLS},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
    ]
    out = encode_chat(msgs, thinking_mode="chat")
    assert out.endswith("<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result><｜Assistant｜></think>")
    assert '<｜DSML｜ parameter name="y" string="false">[1, 2]</｜DSML｜ parameter>' in out
    assert '<｜DSML｜ parameter name="z" string="false">true</｜DSML｜ parameter>' in out


@pytest.mark.parametrize(
    "effort,n", [(None, 75), ("low", 50), ("high", 75), ("xhigh", 75), ("max", 100), (1, 1), (42, 42), (100, 100)]
)
def test_effort_mapping(effort, n):
    assert resolve_effort(effort) == n
    out = encode_chat([{"role": "user", "content": "Hi"}], thinking_mode="thinking", reasoning_effort=effort)
    assert out == BOS + "<｜System｜>" + EFFORT_TEMPLATE.format(n=n) + "<｜User｜>Hi<｜Assistant｜><think>"


def test_effort_none_switches_to_chat():
    out = encode_chat([{"role": "user", "content": "Hi"}], thinking_mode="thinking", reasoning_effort="none")
    assert out == EXPECTED["chat_user"][1]
    assert resolve_effort("none") is None


@pytest.mark.parametrize("bad", [0, 101, -5, "medium", "HIGH", 50.0, True, "", [75]])
def test_effort_errors(bad):
    with pytest.raises(ValueError, match="reasoning_effort") as e:
        encode_chat([{"role": "user", "content": "Hi"}], thinking_mode="thinking", reasoning_effort=bad)
    for allowed in ("'low'", "'high'", "'xhigh'", "'max'", "'none'", "1..100"):
        assert allowed in str(e.value)


def test_bad_thinking_mode_and_task():
    with pytest.raises(ValueError, match="thinking_mode"):
        encode_chat([{"role": "user", "content": "Hi"}], thinking_mode="deep")
    with pytest.raises(ValueError, match="task"):
        encode_chat([{"role": "user", "content": "Hi", "task": "bogus"}])


def test_chat_mode_drops_reasoning_of_history():
    msgs = MESSAGES["think_multiturn_keep"]
    out = encode_chat(msgs, thinking_mode="chat")
    assert out == BOS + "<｜User｜>Q1<｜Assistant｜></think>A1" + EOS + "<｜User｜>Q2<｜Assistant｜></think>"


def test_training_sample_with_final_assistant():
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}]
    out = encode_chat(msgs, thinking_mode="thinking", reasoning_effort="max")
    assert out.endswith("<｜User｜>Q<｜Assistant｜><think>R</think>A" + EOS)


def test_parse_assistant():
    assert parse_assistant("R1</think>A1") == ("R1", "A1")
    assert parse_assistant("<think>R</think>A" + EOS) == ("R", "A")
    assert parse_assistant("</think>answer") == ("", "answer")
    assert parse_assistant("just text") == ("", "just text")
    assert parse_assistant("unfinished reasoning", thinking=True) == ("unfinished reasoning", "")
    assert parse_assistant("a</think>b</think>c") == ("a", "b</think>c")


def test_parse_tool_calls_round_trip():
    calls = [{"function": {"name": "get_w", "arguments": {"city": "Paris", "n": 2}}}]
    text = "Let me check.\n\n" + render_tool_calls(calls)
    before, parsed = parse_tool_calls(text)
    assert before == "Let me check."
    assert parsed[0]["function"]["name"] == "get_w"
    import json

    assert json.loads(parsed[0]["function"]["arguments"]) == {"city": "Paris", "n": 2}
    assert parse_tool_calls("no calls") == ("no calls", [])
