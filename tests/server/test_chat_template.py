"""The model's own chat template, executed: /apply-template (llama.cpp's shape) and the prompt the chat
endpoint and /tokenize build agree with jinja2 rendering the same template as transformers does;
tools, tool calls, tool results, add_generation_prompt false and chat_template_kwargs reach the
template; --chat-template takes a Jinja file or a tokenizer_config.json; a template's own
raise_exception() is a 400 carrying its message; a template that does not parse stops the server
at start-up with the reason."""

import datetime
import json
import subprocess

import pytest

from conftest import REPO, TINY, start_server, stop_server
from test_http_errors import assert_error

TEMPLATES = REPO.parent / "shared" / "datasets" / "chat_templates"
GGUF = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CONVERSATION = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def jinja_render(source, **ctx):
    """jinja2 configured as transformers' apply_chat_template configures it."""
    jinja2 = pytest.importorskip("jinja2")
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source).render(**ctx)


def with_dict_arguments(messages):
    """The messages as templates see them: tool-call arguments parsed into objects (as vLLM does)."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def apply_template(srv, **body):
    r = srv.post("/apply-template", body)
    assert r.status == 200, r
    return r.json()["prompt"]


def test_smollm2_template_renders_as_jinja2(smollm2_server):
    gguf = pytest.importorskip("gguf")
    field = gguf.GGUFReader(str(GGUF)).fields["tokenizer.chat_template"]
    source = bytes(field.parts[field.data[0]]).decode()
    for messages in ([{"role": "user", "content": "Hi"}],
                     [{"role": "system", "content": "Terse."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye ✓"}]):
        for agp in (True, False):
            expected = jinja_render(source, messages=messages, tools=None, add_generation_prompt=agp,
                                    bos_token="<|im_start|>", eos_token="<|im_end|>")
            assert apply_template(smollm2_server, messages=messages, add_generation_prompt=agp) == expected


def test_apply_template_tokenize_and_chat_agree(smollm2_server):
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = apply_template(smollm2_server, messages=messages)
    # SmolLM2's template adds its default system turn when there is none.
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = smollm2_server.post("/tokenize", {"messages": messages}).json()["tokens"]
    assert smollm2_server.post("/detokenize", {"tokens": ids}).json()["prompt"] == prompt
    r = smollm2_server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0})
    assert r.status == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
    no_gen = smollm2_server.post("/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_gen["count"] < len(ids)


@pytest.fixture(scope="module")
def qwen_server(server_bin):
    path = TEMPLATES / "Qwen-Qwen3-0.6B.jinja"
    if not path.exists():
        pytest.skip(f"no chat templates at {TEMPLATES}")
    srv = start_server(server_bin, ["--model", TINY, "--max-model-len", "2048", "--chat-template", str(path)],
                       name="tiny-random with Qwen3's template")
    yield srv, path.read_text()
    stop_server(srv)


def test_tools_tool_calls_and_kwargs_reach_the_template(qwen_server):
    srv, source = qwen_server
    for kwargs in ({}, {"enable_thinking": False}):
        for agp in (True, False):
            got = apply_template(srv, messages=TOOL_CONVERSATION, tools=[WEATHER], add_generation_prompt=agp,
                                 chat_template_kwargs=kwargs)
            expected = jinja_render(source, messages=with_dict_arguments(TOOL_CONVERSATION), tools=[WEATHER],
                                    add_generation_prompt=agp, bos_token="", eos_token="", **kwargs)
            assert got == expected
    assert "<tool_call>" in got and '"name": "get_weather"' in got and "<tool_response>" in got


def test_cli_prints_what_the_server_renders(qwen_server, cli_bin, tmp_path):
    srv, _ = qwen_server
    (tmp_path / "m.json").write_text(json.dumps(TOOL_CONVERSATION))
    (tmp_path / "t.json").write_text(json.dumps([WEATHER]))
    r = subprocess.run([cli_bin, "chat-template", "--template", str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja"),
                        "--messages", "@" + str(tmp_path / "m.json"), "--tools", "@" + str(tmp_path / "t.json"),
                        "--kwargs", '{"enable_thinking": false}'], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == apply_template(srv, messages=TOOL_CONVERSATION, tools=[WEATHER],
                                      chat_template_kwargs={"enable_thinking": False})


def test_template_raise_exception_is_a_400(make_server):
    path = TEMPLATES / "google-gemma-2-2b-it.jinja"
    if not path.exists():
        pytest.skip(f"no chat templates at {TEMPLATES}")
    srv = make_server("--chat-template", str(path))
    system = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert_error(srv.post("/v1/chat/completions", {"messages": system, "max_tokens": 2}), 400,
                 message_contains="System role not supported")
    assert_error(srv.post("/apply-template", {"messages": system}), 400, message_contains="System role not supported")
    ok = srv.post("/v1/chat/completions", {"messages": system[1:], "max_tokens": 2})
    assert ok.status == 200, ok


def test_tokenizer_config_json_is_a_template_source(make_server, tmp_path):
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                                                   "{% if add_generation_prompt %}[assistant] {% endif %}"}))
    srv = make_server("--chat-template", str(config))
    assert apply_template(srv, messages=[{"role": "user", "content": "x"}]) == "[user] x\n[assistant] "


@pytest.mark.parametrize("text, reason", [
    ("{% if messages %}", "missing {% endif %}"),
    ("{% include 'other.jinja' %}", "the tag 'include' is not supported"),
])
def test_unparseable_template_stops_the_server(server_bin, tmp_path, text, reason):
    path = tmp_path / "bad.jinja"
    path.write_text(text)
    r = subprocess.run([server_bin, "--model", TINY, "--chat-template", str(path), "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert reason in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("body, message", [
    ({}, "'messages' is required"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"name": "f"}}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}}, "cannot set 'messages'"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "arguments is not valid JSON"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 0}, "Unrecognized request argument supplied"),
])
def test_bad_apply_template_400(server, body, message):
    assert_error(server.post("/apply-template", body), 400, message_contains=message)


def test_reasoning_content_split_out_whole_and_streamed(qwen_server):
    """Qwen3's template: the server reads <think>...</think> as reasoning_content. A grammar makes
    random weights write a thinking block, so the split is exercised end to end."""
    srv, _ = qwen_server
    body = {"messages": [{"role": "user", "content": "Think first."}], "max_tokens": 60, "temperature": 0,
            "guided_grammar": 'root ::= "<think>" [a-z]{3,12} "</think>" [a-z]{3,12}'}
    r = srv.post("/v1/chat/completions", body)
    if r.status == 400 and "xgrammar" in r.body.decode():
        pytest.skip("kvflow was built without xgrammar")
    assert r.status == 200, r
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["reasoning_content"].isalpha()
    assert message["content"].isalpha() and "<think>" not in message["content"]
    chunks = [json.loads(line[6:]) for line in srv.post("/v1/chat/completions", dict(body, stream=True)).body.decode()
              .splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    none = srv.post("/v1/chat/completions", dict(body, chat_template_kwargs={"enable_thinking": False}))
    assert none.status == 200
