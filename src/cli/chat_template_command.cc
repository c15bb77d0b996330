#include "cli/chat_template_command.h"

#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "chat_template/chat_template.h"
#include "kvflow/models.h"
#include "model/tensor_source.h"

namespace kvflow {
namespace {

using Json = nlohmann::ordered_json;

// Inline JSON, or @path to a file holding it.
Result<Json> ReadJsonArgument(const std::string& flag, const std::string& text) {
  std::string body = text;
  if (!text.empty() && text[0] == '@') {
    std::ifstream file(text.substr(1), std::ios::binary);
    if (!file) return Status::NotFound(flag + ": cannot read '" + text.substr(1) + "'");
    std::stringstream ss;
    ss << file.rdbuf();
    body = ss.str();
  }
  Json json = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (json.is_discarded()) return Status::InvalidArgument(flag + ": not valid JSON");
  return json;
}

}  // namespace

CLI::App* AddChatTemplateCommand(CLI::App& app, ChatTemplateCommandOptions* o) {
  CLI::App* cmd = app.add_subcommand(
      "chat-template", "Print the prompt a chat template renders for a conversation (no weights loaded)");
  cmd->add_option("-m,--model", o->model, "Model path or short name: its template and BOS/EOS texts");
  cmd->add_option("--template", o->template_path,
                  "chatml, llama3, a Jinja file or a tokenizer_config.json (default: the model's own)");
  cmd->add_option("--messages", o->messages, "OpenAI messages as JSON, or @file")->required();
  cmd->add_option("--tools", o->tools, "OpenAI tools as JSON, or @file");
  cmd->add_option("--kwargs", o->kwargs, "Extra template variables as a JSON object, e.g. {\"enable_thinking\": false}");
  cmd->add_flag("--no-generation-prompt", o->no_generation_prompt, "Do not open the assistant's turn");
  cmd->add_option("--bos-token", o->bos_token, "The BOS text, with --template alone");
  cmd->add_option("--eos-token", o->eos_token, "The EOS text, with --template alone");
  return cmd;
}

int RunChatTemplateCommand(const ChatTemplateCommandOptions& o) {
  auto fail = [](const Status& s) {
    spdlog::error("{}", s.ToString());
    return 1;
  };
  if (o.model.empty() && o.template_path.empty()) return fail(Status::InvalidArgument("give --model, --template or both"));
  std::string source, bos = o.bos_token, eos = o.eos_token;
  if (!o.model.empty()) {
    auto path = ResolveModel(o.model);
    if (!path.ok()) return fail(path.status());
    auto files = OpenModelFiles(path.value());
    if (!files.ok()) return fail(files.status());
    if (!files->tokenizer) return fail(Status::NotFound("the model '" + o.model + "' has no tokenizer"));
    const Tokenizer& tok = *files->tokenizer;
    if (tok.bos_id() >= 0 && bos.empty()) bos = tok.TokenBytes(tok.bos_id(), /*skip_special=*/false);
    if (tok.eos_id() >= 0 && eos.empty()) eos = tok.TokenBytes(tok.eos_id(), /*skip_special=*/false);
    source = tok.chat_template();
  }
  if (!o.template_path.empty()) {
    auto read = ChatTemplate::ReadSource(o.template_path);
    if (!read.ok()) return fail(read.status());
    source = read.value();
  }
  if (source.empty()) return fail(Status::NotFound("the model has no chat template; give one with --template"));
  auto chat_template = ChatTemplate::Create(source, bos, eos);
  if (!chat_template.ok()) return fail(chat_template.status());

  ChatTemplateInput input;
  auto messages = ReadJsonArgument("--messages", o.messages);
  if (!messages.ok()) return fail(messages.status());
  input.messages = std::move(messages.value());
  Status normalized = NormalizeChatMessages(&input.messages);
  if (!normalized.ok()) return fail(normalized);
  if (!o.tools.empty()) {
    auto tools = ReadJsonArgument("--tools", o.tools);
    if (!tools.ok()) return fail(tools.status());
    if (!tools.value().is_array() && !tools.value().is_null()) return fail(Status::InvalidArgument("--tools: an array"));
    input.tools = std::move(tools.value());
  }
  if (!o.kwargs.empty()) {
    auto kwargs = ReadJsonArgument("--kwargs", o.kwargs);
    if (!kwargs.ok()) return fail(kwargs.status());
    input.kwargs = std::move(kwargs.value());
  }
  input.add_generation_prompt = !o.no_generation_prompt;
  auto prompt = chat_template->Render(input);
  if (!prompt.ok()) return fail(prompt.status());
  std::fwrite(prompt->data(), 1, prompt->size(), stdout);
  return 0;
}

}  // namespace kvflow
