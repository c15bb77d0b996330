"""Tool calling through the official openai client: tool_choice required, a named function and
auto; tool_calls in responses and as streamed deltas that add up to the same calls; arguments that
parse and validate against the tool's parameters; tool results sent back in the conversation. On
tiny-random and SmolLM2, whose templates render no tools (llama.cpp's generic format: a system
message and a JSON grammar), and with Qwen3's template (its own <tool_call> format, constrained
by an xgrammar structural tag). Skipped where kvflow was built without xgrammar."""

import json

import pytest

from conftest import REPO, SMOLLM2, TINY, start_server, stop_server
from test_http_errors import assert_error
from test_openai_client import make_client

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Za-z/_]{1,20}$"}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
QWEN3 = REPO.parent / "shared" / "datasets" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"


def start(server_bin, *args, model=TINY):
    s = start_server(server_bin, ["--model", model, "--max-model-len", "2048", *args], name=f"tools {' '.join(args)}")
    probe = s.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "tools": TOOLS,
                                            "tool_choice": "required"})
    if probe.status == 400 and "xgrammar" in probe.body.decode():
        stop_server(s)
        pytest.skip("kvflow was built without xgrammar")
    return s


@pytest.fixture(scope="module", params=["generic", "hermes"])
def srv(request, server_bin):
    if request.param == "hermes":
        if not QWEN3.exists():
            pytest.skip(f"no chat templates at {QWEN3.parent}")
        s = start(server_bin, "--chat-template", str(QWEN3))
    else:
        s = start(server_bin)
    yield s
    stop_server(s)


def check_calls(calls, names=("get_weather", "get_time")):
    assert calls, "no tool calls"
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def create(client, **kw):
    kw.setdefault("max_tokens", 300)
    kw.setdefault("temperature", 0)
    # Qwen3's template: no thinking block, which random weights would never close (others ignore it).
    kw.setdefault("extra_body", {"chat_template_kwargs": {"enable_thinking": False}})
    return client.chat.completions.create(model=TINY, messages=MESSAGES, tools=TOOLS, **kw)


def test_required_always_calls(srv):
    client = make_client(srv)
    for seed in range(3):
        r = create(client, tool_choice="required", temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        check_calls(c.message.tool_calls)


def test_named_function_is_the_one_called(srv):
    r = create(make_client(srv), tool_choice={"type": "function", "function": {"name": "get_time"}})
    check_calls(r.choices[0].message.tool_calls, names=("get_time",))
    assert len(r.choices[0].message.tool_calls) == 1


def test_not_parallel_means_one_call(srv):
    r = create(make_client(srv), tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=5)
    assert len(r.choices[0].message.tool_calls) == 1


def test_auto_gives_calls_or_content(srv):
    c = create(make_client(srv), tool_choice="auto").choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls)
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content is not None


def test_streamed_deltas_add_up_to_the_same_calls(srv):
    client = make_client(srv)
    whole = create(client, tool_choice="required").choices[0].message
    calls, finish = {}, None
    for chunk in create(client, tool_choice="required", stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": "", "pieces": 0})
            if tc.id:
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
                entry["pieces"] += 1
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls]
    assert all(c["id"] for c in calls.values())
    # Arguments stream as they are generated: a call's arguments come in many chunks, not whole
    # when its block closes (each holds at least a key and a string value of a token or more).
    for c in calls.values():
        assert c["pieces"] >= 3, c


def test_tool_results_continue_the_conversation(srv):
    client = make_client(srv)
    call = create(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump() for tc in call.tool_calls]},
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=TINY, messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=16, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content is not None


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in 'tools'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_tool_requests_400(server, body, message):
    assert_error(server.post("/v1/chat/completions", dict(messages=MESSAGES, max_tokens=4, **body)), 400,
                 message_contains=message)


def test_smollm2_calls_a_tool(smollm2_server):
    client = make_client(smollm2_server)
    # One call: left free to call in parallel, a 135M model repeats the same call until max_tokens.
    r = client.chat.completions.create(model=SMOLLM2, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, temperature=0)
    check_calls(r.choices[0].message.tool_calls)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
