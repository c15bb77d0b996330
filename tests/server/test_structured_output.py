"""Structured output through the official openai client: json_schema outputs parse and validate
against their schema (jsonschema) for schemas covering nested objects, arrays, enums, required and
optional fields, bounded numbers, patterned strings and anyOf; json_object, regex, choice and GBNF
grammars by the names vLLM's and llama.cpp's users send them; streaming; n > 1 and batches that mix
constrained and free requests; n-gram speculative decoding giving the same greedy output; and every
invalid or conflicting constraint a 400 naming what is wrong. Skipped where kvflow was built without
xgrammar."""

import concurrent.futures
import json
import re

import pytest

from conftest import SMOLLM2, TINY, start_server, stop_server
from test_http_errors import assert_error
from test_openai_client import make_client

jsonschema = pytest.importorskip("jsonschema")

SCHEMAS = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"], "additionalProperties": False},
        },
        "required": ["name", "address"], "additionalProperties": False},
    "array_of_enums": {
        "type": "object",
        "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                   "minItems": 1, "maxItems": 4}},
        "required": ["colours"], "additionalProperties": False},
    "bounded_numbers_and_optional": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "score": {"type": "number", "minimum": 0, "maximum": 1},
                       "nickname": {"type": "string", "maxLength": 10}},
        "required": ["age", "score"], "additionalProperties": False},
    "any_of": {
        "type": "object",
        "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                           {"type": "string", "maxLength": 8}, {"type": "boolean"}]}},
        "required": ["value"], "additionalProperties": False},
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                   "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def srv(server_bin):
    s = start_server(server_bin, ["--model", TINY, "--max-model-len", "1024", "--max-num-seqs", "16"],
                     name="tiny-random for structured output")
    probe = s.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                            "response_format": {"type": "json_object"}})
    if probe.status == 400 and "xgrammar" in probe.body.decode():
        stop_server(s)
        pytest.skip("kvflow was built without xgrammar")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(srv):
    return make_client(srv)


def ask(client, schema, **kw):
    kw.setdefault("max_tokens", 400)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
        **kw)


@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_outputs_validate(client, name, temperature):
    r = ask(client, SCHEMAS[name], temperature=temperature, seed=7)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_json_schema_streamed(client):
    schema = SCHEMAS["nested_object"]
    whole = ask(client, schema).choices[0].message.content
    stream = ask(client, schema, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole
    jsonschema.validate(json.loads(text), schema)


def test_parallel_samples_and_mixed_batches(client, srv):
    schema = SCHEMAS["array_of_enums"]
    r = ask(client, schema, n=3, temperature=1.0, seed=3)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), schema)
    free = dict(model=TINY, messages=[{"role": "user", "content": "Say anything."}], max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    alone = client.chat.completions.create(**free).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        constrained = [pool.submit(ask, client, SCHEMAS[n]) for n in SCHEMAS]
        frees = [pool.submit(client.chat.completions.create, **free) for _ in range(3)]
        for f, n in zip(constrained, SCHEMAS):
            jsonschema.validate(json.loads(f.result().choices[0].message.content), SCHEMAS[n])
        for f in frees:
            assert f.result().choices[0].message.content == alone


@pytest.mark.parametrize("body, check", [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), (dict, list))),
    ({"guided_regex": "[a-c]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                      "required": ["n"], "additionalProperties": False}},
     lambda t: isinstance(json.loads(t)["n"], int)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda t: t in ("left", "right")),
    ({"json_schema": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
     lambda t: len(json.loads(t)) == 2),
    ({"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'}, lambda t: re.fullmatch(r"\([0-9]+(\+[0-9]+)*\)", t)),
    ({"guided_grammar": 'root ::= ("ab" | "cd") "!"'}, lambda t: t in ("ab!", "cd!")),
])
def test_constraint_fields_by_each_servers_name(srv, body, check):
    # JSON may take any whitespace between tokens, which random weights spend tokens on.
    r = srv.post("/v1/chat/completions", dict(messages=[{"role": "user", "content": "go"}], max_tokens=400,
                                              temperature=0, **body))
    assert r.status == 200, r
    text = r.json()["choices"][0]["message"]["content"]
    assert check(text), text
    # The completions endpoint reads the same fields.
    if "response_format" not in body:
        r = srv.post("/v1/completions", dict(prompt="go", max_tokens=400, temperature=0, **body))
        assert r.status == 200, r
        assert check(r.json()["choices"][0]["text"])


def test_length_inside_a_value_says_length(client):
    r = ask(client, SCHEMAS["nested_object"], max_tokens=3)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, "objekt"),
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "missing_rule"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "give one structured-output constraint"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "takes one of"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "xgrammar"),
])
def test_bad_constraints_400(srv, body, message):
    r = srv.post("/v1/chat/completions", dict(messages=[{"role": "user", "content": "go"}], max_tokens=8, **body))
    assert_error(r, 400, message_contains=message)
    assert srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}).status == 200


def test_speculative_decoding_keeps_constrained_output(make_server, srv):
    spec = make_server("--max-model-len", "1024", "--speculative-method", "ngram", "--num-speculative-tokens", "4")
    body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 300, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS["array_of_objects"]}}}
    plain = srv.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    fast = spec.post("/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert fast == plain
    jsonschema.validate(json.loads(fast), SCHEMAS["array_of_objects"])


def test_smollm2_json_schema(smollm2_server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                               "country": {"type": "string", "maxLength": 30},
                                               "population_millions": {"type": "number", "minimum": 0}},
              "required": ["city", "country", "population_millions"], "additionalProperties": False}
    client = make_client(smollm2_server)
    r = client.chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Give the capital of France as JSON."}], max_tokens=120,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    out = json.loads(r.choices[0].message.content)
    jsonschema.validate(out, schema)
