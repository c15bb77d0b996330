#!/usr/bin/env python3
"""kvflow's chat-template engine against jinja2, byte for byte.

Every template in ../shared/datasets/chat_templates (the 18 real ones) is rendered for a set of
conversations (system prompts, several turns, tool definitions, assistant tool calls, tool results,
reasoning, non-ASCII text), with add_generation_prompt true and false and, where the template reads
it, with and without enable_thinking=false, by Python's jinja2 configured as transformers' apply_chat_template configures
it, and by `kvflow chat-template`. The outputs must be equal; where jinja2 fails (the template's
raise_exception, or an error the conversation provokes) kvflow must fail too, with the same message
for raise_exception.

  chat_template_reference.py --cli build/kvflow --dump-bin build/tests/kvflow_chat_template_dump
      [--templates DIR] [--only NAME]
Exits 77 (ctest: skipped) when the templates or jinja2 are absent.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

SKIP = 77

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"},
        "filters": {"type": "array", "items": {"type": "string"}}, "score": {"type": "number", "default": 0.5}},
        "required": ["query"]}}}


def call(i, name, args):
    return {"id": f"call_{i:09d}", "type": "function", "function": {"name": name, "arguments": args}}


# name: (messages, tools). Tool-call arguments are objects, as the server hands them to templates
# (a JSON string in a request is parsed first, as vLLM does).
CONVERSATIONS = {
    "user": ([{"role": "user", "content": "Hello!"}], None),
    "system_user": ([{"role": "system", "content": "You are a helpful assistant."},
                     {"role": "user", "content": "What is 2+2?"}], None),
    "multi_turn": ([{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello! How can I help?"},
                    {"role": "user", "content": "Tell me a joke.\nMake it short."}], None),
    "no_system_turns": ([{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"},
                         {"role": "user", "content": "Three"}], None),
    "unicode": ([{"role": "user", "content": "Ünïcödé ✓ 日本語 \"quotes\" 'single' \\ back\ttab"}], None),
    "tools": ([{"role": "system", "content": "You can call tools."},
               {"role": "user", "content": "Weather in Paris?"}], [WEATHER, SEARCH]),
    "tools_no_system": ([{"role": "user", "content": "Weather in Paris?"}], [WEATHER]),
    "tool_call_and_result": ([{"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call(1, "get_weather", {"city": "Paris", "unit": "celsius"})]},
        {"role": "tool", "tool_call_id": "call_000000001", "name": "get_weather", "content": "{\"temperature\": 21.5}"},
        {"role": "assistant", "content": "It is 21.5 °C in Paris."},
        {"role": "user", "content": "Thanks"}], [WEATHER]),
    "parallel_tool_calls": ([{"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [call(1, "get_weather", {"city": "Paris"}),
                                                              call(2, "get_weather", {"city": "Rome", "days": 3})]},
        {"role": "tool", "tool_call_id": "call_000000001", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_000000002", "name": "get_weather", "content": "rainy"}], [WEATHER, SEARCH]),
    "nine_char_ids": ([{"role": "system", "content": "Use tools when needed."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [dict(call(4, "get_weather", {"city": "Oslo", "days": 2}), id="a1B2c3D4e")]},
        {"role": "tool", "tool_call_id": "a1B2c3D4e", "name": "get_weather", "content": "-3 and snow"},
        {"role": "assistant", "content": "Cold: -3 °C with snow."},
        {"role": "user", "content": "And tomorrow?"}], [WEATHER]),
    "reasoning": ([{"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "<think>\nCheck divisors 2..2.\n</think>\n\nYes, 7 is prime."},
        {"role": "user", "content": "And 9?"}], None),
    "float_and_nested_arguments": ([{"role": "user", "content": "Search"},
        {"role": "assistant", "content": "", "tool_calls": [call(5, "search", {"query": "a\nb", "score": 1e-05,
                                                                               "filters": ["x", {"deep": [True, None, 2.5]}]})]},
        {"role": "tool", "tool_call_id": "call_000000005", "name": "search", "content": "[]"}], [SEARCH]),
}


def as_templates_see_them(messages):
    """The messages as kvflow (like vLLM) hands them to a template: an assistant's null content is ""."""
    out = json.loads(json.dumps(messages))
    for m in out:
        if m.get("role") == "assistant" and m.get("content") is None:
            m["content"] = ""
    return out


def jinja_env():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # transformers 4.46's _compile_jinja_template (its AssistantTracker only marks {% generation %}).
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env, jinja2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--dump-bin", required=True, help="kvflow_chat_template_dump (every case in one process)")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--templates", default=os.path.join(here, "..", "..", "..", "shared", "datasets", "chat_templates"))
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    if not os.path.isdir(args.templates):
        print(f"SKIP: no chat templates at {args.templates}")
        return SKIP
    try:
        env, jinja2 = jinja_env()
    except ImportError:
        print("SKIP: jinja2 is not installed (tools/install-deps --python)")
        return SKIP
    names = sorted(n for n in os.listdir(args.templates) if n.endswith(".jinja") and args.only in n)
    cases = []  # (label, case for the dump tool, expected text or None, raised, failed)
    for name in names:
        path = os.path.join(args.templates, name)
        source = open(path, encoding="utf-8").read()
        compiled = env.from_string(source)
        for conv, (messages, tools) in CONVERSATIONS.items():
            # enable_thinking only where the template reads it (it changes nothing elsewhere).
            kwarg_sets = ({}, {"enable_thinking": False}) if "enable_thinking" in source else ({},)
            for add_generation_prompt in (True, False):
                for kwargs in kwarg_sets:
                    if "firefunction" in name:  # its template reads the tools as `functions`
                        kwargs = dict(kwargs, functions=json.dumps([t["function"] for t in tools or []], indent=2))
                    ctx = dict(messages=as_templates_see_them(messages), tools=tools,
                               add_generation_prompt=add_generation_prompt,
                               bos_token="<s>", eos_token="</s>", **kwargs)
                    expected = raised = failed = None
                    try:
                        expected = compiled.render(**ctx)
                    except jinja2.exceptions.UndefinedError as e:
                        failed = str(e)
                    except jinja2.exceptions.TemplateError as e:
                        raised = str(e)
                    except Exception as e:  # a Python error the conversation provokes in the template
                        failed = f"{type(e).__name__}: {e}"
                    case = {"template": path, "messages": messages, "tools": tools, "kwargs": kwargs,
                            "add_generation_prompt": add_generation_prompt, "bos_token": "<s>", "eos_token": "</s>"}
                    label = f"{name} / {conv} / add_generation_prompt={add_generation_prompt} {kwargs}"
                    cases.append((label, case, expected, raised, failed))

    lines = "".join(json.dumps(c[1], ensure_ascii=False) + "\n" for c in cases)
    out = subprocess.run([args.dump_bin], input=lines.encode("utf-8"), capture_output=True)
    if out.returncode != 0:
        print(f"FAIL: {args.dump_bin} exited {out.returncode}: {out.stderr.decode('utf-8', 'replace')[-800:]}")
        return 1
    results = [json.loads(line) for line in out.stdout.decode("utf-8").splitlines()]
    if len(results) != len(cases):
        print(f"FAIL: {len(cases)} cases, {len(results)} results")
        return 1

    mismatches = rendered = 0
    for (label, _, expected, raised, failed), got in zip(cases, results):
        if raised is not None:
            ok = not got["ok"] and raised in got["error"]
            what = f"raise_exception({raised!r})"
        elif failed is not None:
            ok = not got["ok"]
            what = f"jinja2 failed: {failed}"
        else:
            ok = got["ok"] and got["text"] == expected
            rendered += ok
            what = expected
        if not ok:
            mismatches += 1
            if mismatches <= 5:
                print(f"MISMATCH {label}")
                print(f"  jinja2: {what[:800]!r}\n  kvflow: {got.get('text', '')[:800]!r} {got.get('error', '')[-400:]!r}")

    # `kvflow chat-template` renders as the dump tool does: the first case of each template and every
    # refused case of the first template that refuses, through the CLI.
    cli_checked = 0
    with tempfile.TemporaryDirectory() as tmp:
        first_of_each = {}
        for i, (label, case, *_ ) in enumerate(cases):
            first_of_each.setdefault(case["template"], i)
        refused = [i for i, r in enumerate(results) if not r["ok"]][:3]
        for i in sorted(set(first_of_each.values()) | set(refused)):
            label, case = cases[i][0], cases[i][1]
            files = {}
            for key in ("messages", "tools", "kwargs"):
                files[key] = os.path.join(tmp, key + ".json")
                with open(files[key], "w", encoding="utf-8") as f:
                    json.dump(case[key], f, ensure_ascii=False)
            cmd = [args.cli, "chat-template", "--template", case["template"], "--messages", "@" + files["messages"],
                   "--kwargs", "@" + files["kwargs"], "--bos-token", "<s>", "--eos-token", "</s>"]
            if case["tools"] is not None:
                cmd += ["--tools", "@" + files["tools"]]
            if not case["add_generation_prompt"]:
                cmd.append("--no-generation-prompt")
            cli = subprocess.run(cmd, capture_output=True)
            cli_checked += 1
            want = results[i]
            if want["ok"]:
                same = cli.returncode == 0 and cli.stdout.decode("utf-8", "replace") == want["text"]
            else:
                same = cli.returncode != 0 and want["error"] in cli.stderr.decode("utf-8", "replace")
            if not same:
                mismatches += 1
                print(f"CLI DIFFERS from the dump tool: {label}: rc {cli.returncode}, "
                      f"{cli.stderr.decode('utf-8', 'replace')[-400:]!r}")
    total = len(cases)
    print(f"{total - mismatches}/{total} cases agree over {len(names)} templates "
          f"({rendered} rendered byte for byte, the rest refused by both); "
          f"kvflow chat-template agrees on {cli_checked} of them")
    return 1 if mismatches or not names else 0


if __name__ == "__main__":
    sys.exit(main())
