// A small Jinja interpreter for chat templates: the subset real templates use (statements,
// expressions, macros, namespaces, loop variables, slicing, the filters and tests they call,
// raise_exception, strftime_now, tojson), configured as Hugging Face transformers configures
// jinja2 (trim_blocks, lstrip_blocks, loop controls, no autoescape). Anything outside the subset
// is refused at parse time or when reached, with the line it is on; nothing is guessed.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "kvflow/status.h"

namespace kvflow::jinja {

struct Stmt;

struct RenderLimits {
  size_t max_output_bytes = 64u << 20;
  int max_call_depth = 200;
  int64_t max_steps = 50'000'000;  // statements and expressions evaluated
};

class Template {
 public:
  // Parses `source`; a syntax error, or a construct the interpreter does not have, is an
  // InvalidArgument naming the line.
  static Result<Template> Parse(const std::string& source);

  // Renders with the variables of `context` (a JSON object). A raise_exception() in the template
  // is an InvalidArgument carrying its message; other failures name what failed and where.
  Result<std::string> Render(const nlohmann::ordered_json& context, const RenderLimits& limits = {}) const;

  Template(Template&&) noexcept;
  Template& operator=(Template&&) noexcept;
  ~Template();

 private:
  Template();
  struct Parsed;
  std::unique_ptr<Parsed> parsed_;
};

}  // namespace kvflow::jinja
