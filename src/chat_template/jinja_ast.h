// The parsed form of a Jinja template: expressions and statements, as jinja2's parser builds them
// for the subset chat templates use. Internal to src/chat_template.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "chat_template/jinja_value.h"

namespace kvflow::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // value
    kName,      // name
    kList,      // items
    kTuple,     // items
    kDict,      // items as key, value pairs
    kGetAttr,   // items[0] . name
    kGetItem,   // items[0] [ items[1] ]
    kSlice,     // items[0] [ items[1] : items[2] : items[3] ] (null where omitted)
    kCall,      // items[0] ( items[1..] , keywords )
    kFilter,    // items[0] | name ( items[1..] , keywords ); items[0] null in a filter block
    kTest,      // items[0] is [not] name ( items[1..] )
    kUnary,     // op items[0]: "not", "-", "+"
    kBinary,    // items[0] op items[1]: + - * / // % ** ~ and or in "not in"
    kCompare,   // items[0] ops[0] items[1] ops[1] items[2] ...
    kCondition, // items[1] if items[0] else items[2] (items[2] null: undefined)
  };
  Kind kind;
  int line = 0;
  Value value;
  std::string name;  // name, attribute, filter, test, operator
  bool negated = false;
  std::vector<ExprPtr> items;
  std::vector<std::pair<std::string, ExprPtr>> keywords;
  std::vector<std::string> ops;
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct MacroParam {
  std::string name;
  ExprPtr default_value;  // null: required
};

struct Stmt {
  enum class Kind {
    kText,        // text
    kOutput,      // {{ expr }}
    kIf,          // branches: (condition, body)..., else_body
    kFor,         // targets in expr [if filter] body [else else_body]
    kSet,         // targets (or target_object.attribute) = expr
    kSetBlock,    // {% set name %}body{% endset %}, through filter when given
    kMacro,       // name(params) body
    kFilterBlock, // {% filter f %}body{% endfilter %}: filter is a kFilter expression
    kBreak,
    kContinue,
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr filter;
  std::vector<std::string> targets;
  std::string attribute;  // kSet on a namespace: targets[0].attribute
  std::vector<std::pair<ExprPtr, Body>> branches;
  Body body;
  Body else_body;
  std::vector<MacroParam> params;
};

}  // namespace kvflow::jinja

#include "chat_template/jinja.h"

namespace kvflow::jinja {

struct Template::Parsed {
  Body body;
};

// The statements of `source`; throws Error with the line on a syntax error or an unsupported tag.
Body ParseTemplate(const std::string& source);

}  // namespace kvflow::jinja
