// The server's pure layers: HTTP request heads and body framing, and OpenAI request parsing.
#include <gtest/gtest.h>

#include "server/http_server.h"
#include "server/openai_api.h"

namespace kvflow::server {
namespace {

TEST(HttpParse, RequestLineHeadersAndKeepAlive) {
  HttpRequest req;
  ASSERT_FALSE(ParseRequestHead("POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Type:  application/json \r\n"
                                "Content-Length: 5\r\n\r\n",
                                &req));
  EXPECT_EQ(req.method, "POST");
  EXPECT_EQ(req.path, "/v1/completions");
  EXPECT_EQ(req.target, "/v1/completions?x=1");
  ASSERT_NE(req.Header("content-type"), nullptr);
  EXPECT_EQ(*req.Header("content-type"), "application/json");
  EXPECT_TRUE(req.KeepAlive());
  BodyFraming f;
  ASSERT_FALSE(DecideBodyFraming(req, 100, &f));
  EXPECT_EQ(f.length, 5u);

  ASSERT_FALSE(ParseRequestHead("GET / HTTP/1.0\r\n\r\n", &req));
  EXPECT_FALSE(req.KeepAlive());
  ASSERT_FALSE(ParseRequestHead("GET / HTTP/1.1\r\nConnection: close\r\n\r\n", &req));
  EXPECT_FALSE(req.KeepAlive());
}

TEST(HttpParse, RefusesMalformedHeads) {
  HttpRequest req;
  for (const char* bad : {"GET\r\n\r\n", "GET / HTTP/1.1 extra\r\n\r\n", "GET nopath HTTP/1.1\r\n\r\n",
                          "G(T / HTTP/1.1\r\n\r\n", "GET / FTP/1.1\r\n\r\n", "GET / HTTP/1.1\r\nNoColon\r\n\r\n",
                          "GET / HTTP/1.1\r\n: empty\r\n\r\n", "GET / HTTP/1.1\r\nBad Name: x\r\n\r\n",
                          "GET / HTTP/1.1\r\nX: a\x01b\r\n\r\n", "GET / HTTP/1.1\r\nX: y\r\n"}) {
    auto error = ParseRequestHead(bad, &req);
    ASSERT_TRUE(error) << bad;
    EXPECT_EQ(error->status, 400) << bad;
  }
  auto v2 = ParseRequestHead("GET / HTTP/2.0\r\n\r\n", &req);
  ASSERT_TRUE(v2);
  EXPECT_EQ(v2->status, 505);
}

TEST(HttpParse, BodyFramingLimits) {
  HttpRequest req;
  BodyFraming f;
  ASSERT_FALSE(ParseRequestHead("POST / HTTP/1.1\r\nContent-Length: 4097\r\n\r\n", &req));
  EXPECT_EQ(DecideBodyFraming(req, 4096, &f)->status, 413);
  ASSERT_FALSE(ParseRequestHead("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", &req));
  EXPECT_EQ(DecideBodyFraming(req, 4096, &f)->status, 411);
  for (const char* bad : {"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                          "POST / HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n",
                          "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
                          "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"}) {
    ASSERT_FALSE(ParseRequestHead(bad, &req)) << bad;
    auto error = DecideBodyFraming(req, 4096, &f);
    ASSERT_TRUE(error) << bad;
    EXPECT_EQ(error->status, 400) << bad;
  }
  ASSERT_FALSE(ParseRequestHead("POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n", &req));
  ASSERT_FALSE(DecideBodyFraming(req, 4096, &f));
  EXPECT_TRUE(f.expect_continue);
}

TEST(OpenAiParse, CompletionFieldsMapToSamplingParams) {
  CompletionRequest r;
  auto error = ParseCompletionRequest(
      R"({"model":"m","prompt":["a",[1,2]],"max_tokens":7,"temperature":0.5,"top_p":0.9,"n":2,"best_of":3,)"
      R"("stop":"\n","seed":42,"presence_penalty":0.5,"frequency_penalty":-0.5,"logprobs":3,"top_k":-1,)"
      R"("min_p":0.05,"ignore_eos":true,"stop_token_ids":[7],"user":"u","logit_bias":{}})",
      &r);
  ASSERT_FALSE(error) << error->message;
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[0].text, "a");
  EXPECT_TRUE(r.prompts[1].is_tokens);
  EXPECT_EQ(r.prompts[1].tokens, (std::vector<int32_t>{1, 2}));
  const SamplingParams& p = r.sampling;
  EXPECT_EQ(p.max_tokens, 7);
  EXPECT_FLOAT_EQ(p.temperature, 0.5f);
  EXPECT_EQ(p.n, 2);
  EXPECT_EQ(p.best_of, 3);
  EXPECT_EQ(p.stop, std::vector<std::string>{"\n"});
  EXPECT_EQ(p.seed, 42u);
  EXPECT_EQ(p.logprobs, 3);
  EXPECT_EQ(p.top_k, 0);
  EXPECT_TRUE(p.ignore_eos);
  EXPECT_TRUE(r.logprobs_given);

  ASSERT_FALSE(ParseCompletionRequest(R"({"prompt":[5,6,7]})", &r));
  EXPECT_EQ(r.sampling.max_tokens, 16);  // OpenAI's default
  EXPECT_FALSE(r.max_tokens_given);
  EXPECT_FALSE(r.logprobs_given);
}

TEST(OpenAiParse, RefusesBadCompletionRequestsWithTheField) {
  struct Case {
    const char* body;
    const char* param;  // nullptr: no param
  };
  for (const Case& c : std::initializer_list<Case>{
           {"not json", nullptr},
           {"[1,2]", nullptr},
           {R"({"max_tokens":4})", "prompt"},
           {R"({"prompt":"a","max_tokens":"ten"})", "max_tokens"},
           {R"({"prompt":"a","max_tokens":0})", "max_tokens"},
           {R"({"prompt":"a","max_tokens":1.5})", "max_tokens"},
           {R"({"prompt":"a","temperature":"hot"})", "temperature"},
           {R"({"prompt":"a","stop":5})", "stop"},
           {R"({"prompt":3})", "prompt"},
           {R"({"prompt":""})", "prompt"},
           {R"({"prompt":[]})", "prompt"},
           {R"({"prompt":[1,"a"]})", "prompt"},
           {R"({"prompt":[1,99999999999]})", "prompt"},
           {R"({"prompt":"a","frobnicate":1})", "frobnicate"},
           {R"({"prompt":"a","n":3,"best_of":2})", "best_of"},
           {R"({"prompt":"a","logprobs":21})", "logprobs"},
           {R"({"prompt":"a","stream":true,"best_of":2})", "stream"},
           {R"({"prompt":"a","stream_options":{"include_usage":true}})", "stream_options"},
           {R"({"prompt":"a","logit_bias":{"5":150}})", "logit_bias"},
           {R"({"prompt":"a","logit_bias":{"five":1}})", "logit_bias"},
           {R"({"prompt":"a","logit_bias":{"5":"up"}})", "logit_bias"},
           {R"({"prompt":"a","logit_bias":[5]})", "logit_bias"},
           {R"({"prompt":"a","suffix":"z"})", "suffix"},
           {R"({"prompt":"a","prompt_logprobs":21})", "prompt_logprobs"},
           {R"({"prompt":"a","prompt_logprobs":-1})", "prompt_logprobs"},
           {R"({"prompt":"a","prompt_logprobs":true})", "prompt_logprobs"},
           {R"({"prompt":"a","prompt_logprobs":1.5})", "prompt_logprobs"},
           {R"({"prompt":"a","max_tokens":0,"logprobs":1})", "max_tokens"},
           {R"({"prompt":"a","max_tokens":-1,"echo":true})", "max_tokens"},
           {R"({"prompt":"a","max_tokens":0,"echo":true,"n":2})", "max_tokens"},
       }) {
    CompletionRequest r;
    auto error = ParseCompletionRequest(c.body, &r);
    ASSERT_TRUE(error) << c.body;
    EXPECT_EQ(error->status, 400) << c.body;
    EXPECT_FALSE(error->message.empty());
    if (c.param) {
      EXPECT_EQ(error->param.value_or(""), c.param) << c.body << ": " << error->message;
    }
    const Json json = Json::parse(error->ToJson());
    EXPECT_TRUE(json["error"].contains("message") && json["error"].contains("type") &&
                json["error"].contains("param") && json["error"].contains("code"));
  }
  CompletionRequest r;
  for (const char* bad : {R"({"prompt":"a","temperature":-1})", R"({"prompt":"a","top_p":0})"}) {
    auto error = ParseCompletionRequest(bad, &r);
    ASSERT_TRUE(error) << bad;
    const std::string field = std::string(bad).find("top_p") != std::string::npos ? "top_p" : "temperature";
    EXPECT_NE(error->message.find(field), std::string::npos) << error->message;
    EXPECT_EQ(error->param.value_or(""), field) << error->message;
  }
  // Hostile nesting is refused before the JSON parser recurses into it.
  std::string deep = R"({"prompt":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_TRUE(ParseCompletionRequest(deep, &r));
}

TEST(OpenAiParse, EchoLogprobsAndPromptLogprobs) {
  CompletionRequest r;
  // Echo with logprobs asks the engine for the prompt's logprobs with as many alternatives.
  ASSERT_FALSE(ParseCompletionRequest(R"({"prompt":"a","echo":true,"logprobs":3})", &r));
  EXPECT_EQ(r.sampling.prompt_logprobs, 3);
  EXPECT_FALSE(r.prompt_logprobs);
  // Both: the engine computes the larger number; the field keeps what was asked for.
  ASSERT_FALSE(ParseCompletionRequest(R"({"prompt":"a","echo":true,"logprobs":2,"prompt_logprobs":5})", &r));
  EXPECT_EQ(r.sampling.prompt_logprobs, 5);
  EXPECT_EQ(r.prompt_logprobs, 5);
  ASSERT_FALSE(ParseCompletionRequest(R"({"prompt":"a","prompt_logprobs":0})", &r));
  EXPECT_EQ(r.sampling.prompt_logprobs, 0);
  EXPECT_EQ(r.prompt_logprobs, 0);
  ASSERT_FALSE(ParseCompletionRequest(R"({"prompt":"a","prompt_logprobs":null})", &r));
  EXPECT_FALSE(r.sampling.prompt_logprobs);
  // Echo without logprobs needs no prompt logprobs, unless nothing is generated.
  ASSERT_FALSE(ParseCompletionRequest(R"({"prompt":"a","echo":true})", &r));
  EXPECT_FALSE(r.sampling.prompt_logprobs);
  ASSERT_FALSE(ParseCompletionRequest(R"({"prompt":"a","echo":true,"max_tokens":0})", &r));
  EXPECT_EQ(r.sampling.max_tokens, 0);
  EXPECT_EQ(r.sampling.prompt_logprobs, 0);
  ASSERT_FALSE(ParseCompletionRequest(R"({"prompt":"a","prompt_logprobs":1,"max_tokens":0,"stream":true})", &r));
  EXPECT_EQ(r.sampling.max_tokens, 0);

  auto zero = ParseCompletionRequest(R"({"prompt":"a","max_tokens":0})", &r);
  ASSERT_TRUE(zero);
  EXPECT_EQ(zero->param.value_or(""), "max_tokens");
  EXPECT_NE(zero->message.find("'echo' or 'prompt_logprobs'"), std::string::npos) << zero->message;

  ChatRequest c;
  ASSERT_FALSE(ParseChatRequest(R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":2})", &c));
  EXPECT_EQ(c.sampling.prompt_logprobs, 2);
  ASSERT_FALSE(
      ParseChatRequest(R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":0,"max_tokens":0})", &c));
  EXPECT_EQ(c.sampling.max_tokens, 0);
  auto chat_zero = ParseChatRequest(R"({"messages":[{"role":"user","content":"x"}],"max_tokens":0})", &c);
  ASSERT_TRUE(chat_zero);
  EXPECT_EQ(chat_zero->param.value_or(""), "max_tokens");
  auto chat_bad = ParseChatRequest(R"({"messages":[{"role":"user","content":"x"}],"prompt_logprobs":21})", &c);
  ASSERT_TRUE(chat_bad);
  EXPECT_EQ(chat_bad->param.value_or(""), "prompt_logprobs");
}

TEST(OpenAiParse, ChatMessagesAndOptions) {
  ChatRequest r;
  auto error = ParseChatRequest(
      R"({"model":"m","messages":[{"role":"developer","content":"be brief"},)"
      R"({"role":"user","content":[{"type":"text","text":"hi "},{"type":"text","text":"there"}],"name":"bob"},)"
      R"({"role":"assistant","content":null}],"logprobs":true,"top_logprobs":2,"max_completion_tokens":9,)"
      R"("stream":true,"stream_options":{"include_usage":true},"tool_choice":"none","response_format":{"type":"text"}})",
      &r);
  ASSERT_FALSE(error) << error->message;
  ASSERT_EQ(r.chat.messages.size(), 3u);
  EXPECT_EQ(r.chat.messages[0]["role"], "system");
  EXPECT_EQ(r.chat.messages[1]["content"], "hi \nthere");  // text parts joined with \n, as vLLM joins them
  EXPECT_EQ(r.chat.messages[1]["name"], "bob");
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.sampling.logprobs, 2);
  EXPECT_EQ(r.sampling.max_tokens, 9);
  EXPECT_TRUE(r.max_tokens_given);
  EXPECT_TRUE(r.include_usage);

  for (const char* bad : {R"({"messages":"hi"})", R"({"messages":[]})", R"({"messages":[{"role":"robot","content":"x"}]})",
                          R"({"messages":[{"role":"user"}]})", R"({"messages":[{"role":"user","content":"x","k":1}]})",
                          R"({"messages":[{"role":"user","content":[{"type":"image_url"}]}]})",
                          R"({"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]})",
                          R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})",
                          R"({"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema"}})",
                          R"({"messages":[{"role":"user","content":"x"}],"tool_choice":"required"})",
                          R"({"prompt":"x"})"}) {
    auto e = ParseChatRequest(bad, &r);
    ASSERT_TRUE(e) << bad;
    EXPECT_EQ(e->status, 400) << bad;
  }
}

TEST(OpenAiParse, InvalidUtf8IsReplacedNotThrown) {
  const std::string s = DumpJson(Json{{"text", std::string("a\xff\xfe" "b")}});
  EXPECT_NE(s.find("\xef\xbf\xbd"), std::string::npos);
}

}  // namespace
}  // namespace kvflow::server
