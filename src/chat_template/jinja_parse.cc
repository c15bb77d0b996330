// The lexer and parser: jinja2's grammar and whitespace control (trim_blocks, lstrip_blocks, the
// '-' and '+' modifiers) for the statements and expressions chat templates use.
#include <cctype>
#include <cstring>
#include <set>

#include "chat_template/jinja_ast.h"

namespace kvflow::jinja {
namespace {

struct Token {
  enum class Type { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };
  Type type;
  std::string text;
  int line = 1;
  Value number;
};

[[noreturn]] void Fail(int line, const std::string& message) {
  throw Error("chat template line " + std::to_string(line) + ": " + message);
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

class Lexer {
 public:
  explicit Lexer(const std::string& source) : src_(source) {}

  std::vector<Token> Run() {
    size_t pos = 0;
    bool strip_next = false;     // the previous tag ended with '-'
    bool trim_newline = false;   // the previous tag was a block or comment (trim_blocks)
    while (pos <= src_.size()) {
      size_t open = FindOpener(pos);
      size_t text_end = open == std::string::npos ? src_.size() : open;
      char kind = open == std::string::npos ? 0 : src_[open + 1];
      char modifier = open == std::string::npos || open + 2 >= src_.size() ? 0 : src_[open + 2];
      // The text before the tag, with the whitespace control of the tags on either side.
      size_t s = pos, e = text_end;
      if (strip_next) {
        while (s < e && IsSpace(src_[s])) ++s;
      } else if (trim_newline && s < e && src_[s] == '\n') {
        ++s;
      } else if (trim_newline && s + 1 < e && src_[s] == '\r' && src_[s + 1] == '\n') {
        s += 2;
      }
      if (open != std::string::npos) {
        if (modifier == '-') {
          while (e > s && IsSpace(src_[e - 1])) --e;
        } else if ((kind == '%' || kind == '#') && modifier != '+') {
          // lstrip_blocks: spaces and tabs from the start of the line up to a block or comment.
          size_t line_start = std::string::npos;
          for (size_t k = text_end; k > pos; --k) {
            if (src_[k - 1] == '\n') {
              line_start = k;
              break;
            }
          }
          if (line_start == std::string::npos && (pos == 0 || (trim_newline && s > pos))) line_start = pos;
          if (line_start != std::string::npos) {
            bool blank = true;
            for (size_t k = line_start; k < text_end; ++k) {
              if (src_[k] != ' ' && src_[k] != '\t') {
                blank = false;
                break;
              }
            }
            if (blank) e = std::max(s, line_start);
          }
        }
      }
      if (e > s) Push(Token::Type::kText, src_.substr(s, e - s), LineAt(s));
      if (open == std::string::npos) break;

      size_t inner = open + 2 + ((modifier == '-' || modifier == '+') ? 1 : 0);
      int line = LineAt(open);
      if (kind == '#') {
        size_t close = src_.find("#}", inner);
        if (close == std::string::npos) Fail(line, "unterminated comment");
        strip_next = close > inner && src_[close - 1] == '-';
        trim_newline = !strip_next && !(close > inner && src_[close - 1] == '+');
        pos = close + 2;
        continue;
      }
      Push(kind == '{' ? Token::Type::kVarBegin : Token::Type::kBlockBegin, "", line);
      size_t begin_index = tokens_.size();
      pos = LexTag(inner, kind == '{', &strip_next, &trim_newline);
      // {% raw %}: the text up to {% endraw %} is kept as it is.
      if (kind == '%' && tokens_.size() == begin_index + 2 && tokens_[begin_index].type == Token::Type::kName &&
          tokens_[begin_index].text == "raw") {
        tokens_.resize(begin_index - 1);
        pos = LexRaw(pos, line, &strip_next, &trim_newline);
      }
    }
    Push(Token::Type::kEof, "", LineAt(src_.size()));
    return std::move(tokens_);
  }

 private:
  size_t FindOpener(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }

  int LineAt(size_t offset) {
    // Offsets only grow, so lines are counted incrementally.
    while (line_offset_ < offset && line_offset_ < src_.size()) {
      if (src_[line_offset_] == '\n') ++line_;
      ++line_offset_;
    }
    return line_;
  }

  void Push(Token::Type type, std::string text, int line, Value number = Value()) {
    tokens_.push_back(Token{type, std::move(text), line, std::move(number)});
  }

  // Lexes an expression up to its closing delimiter; returns the offset after it.
  size_t LexTag(size_t pos, bool is_var, bool* strip_next, bool* trim_newline) {
    int depth = 0;
    while (true) {
      while (pos < src_.size() && IsSpace(src_[pos])) ++pos;
      int line = LineAt(pos);
      if (pos >= src_.size()) Fail(line, std::string("unterminated ") + (is_var ? "'{{'" : "'{%'"));
      const char* closer = is_var ? "}}" : "%}";
      auto at = [&](const char* s) { return src_.compare(pos, std::strlen(s), s) == 0; };
      if (depth == 0) {
        for (const char* prefix : {"-", "+", ""}) {
          std::string full = std::string(prefix) + closer;
          if (at(full.c_str()) && !(is_var && *prefix == '+')) {
            Push(is_var ? Token::Type::kVarEnd : Token::Type::kBlockEnd, "", line);
            *strip_next = *prefix == '-';
            *trim_newline = !is_var && *prefix != '+' && *prefix != '-';
            return pos + full.size();
          }
        }
      }
      char c = src_[pos];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t start = pos;
        while (pos < src_.size() && (std::isalnum(static_cast<unsigned char>(src_[pos])) || src_[pos] == '_')) ++pos;
        Push(Token::Type::kName, src_.substr(start, pos - start), line);
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t start = pos;
        while (pos < src_.size() && (std::isdigit(static_cast<unsigned char>(src_[pos])) || src_[pos] == '_')) ++pos;
        bool is_float = false;
        if (pos + 1 < src_.size() && src_[pos] == '.' && std::isdigit(static_cast<unsigned char>(src_[pos + 1]))) {
          is_float = true;
          ++pos;
          while (pos < src_.size() && std::isdigit(static_cast<unsigned char>(src_[pos]))) ++pos;
        }
        if (pos < src_.size() && (src_[pos] == 'e' || src_[pos] == 'E')) {
          size_t p = pos + 1;
          if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
          if (p < src_.size() && std::isdigit(static_cast<unsigned char>(src_[p]))) {
            is_float = true;
            pos = p;
            while (pos < src_.size() && std::isdigit(static_cast<unsigned char>(src_[pos]))) ++pos;
          }
        }
        std::string digits;
        for (size_t k = start; k < pos; ++k) {
          if (src_[k] != '_') digits += src_[k];
        }
        if (is_float) {
          Push(Token::Type::kFloat, digits, line, Value(std::stod(digits)));
        } else {
          if (digits.size() > 18) Fail(line, "integer literal too large: " + digits);
          Push(Token::Type::kInt, digits, line, Value(static_cast<int64_t>(std::stoll(digits))));
        }
      } else if (c == '\'' || c == '"') {
        pos = LexString(pos, line);
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                     "=", "(", ")", "[", "]", "{", "}", ",", ".", ":", "|"};
        bool found = false;
        for (const char* op : kOps) {
          if (at(op)) {
            if (*op == '(' || *op == '[' || *op == '{') ++depth;
            if ((*op == ')' || *op == ']' || *op == '}') && depth > 0) --depth;
            Push(Token::Type::kOp, op, line);
            pos += std::strlen(op);
            found = true;
            break;
          }
        }
        if (!found) Fail(line, std::string("unexpected character '") + c + "'");
      }
    }
  }

  // A Python string literal with its escapes.
  size_t LexString(size_t pos, int line) {
    char quote = src_[pos++];
    std::string out;
    while (true) {
      if (pos >= src_.size()) Fail(line, "unterminated string literal");
      char c = src_[pos];
      if (c == quote) break;
      if (c != '\\') {
        out += c;
        ++pos;
        continue;
      }
      if (pos + 1 >= src_.size()) Fail(line, "unterminated string literal");
      char esc = src_[pos + 1];
      pos += 2;
      switch (esc) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case '\\': out += '\\'; break;
        case '\'': out += '\''; break;
        case '"': out += '"'; break;
        case '0': out += '\0'; break;
        case 'a': out += '\a'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'v': out += '\v'; break;
        case '\n': break;  // a line continuation
        case 'x':
        case 'u':
        case 'U': {
          size_t digits = esc == 'x' ? 2 : esc == 'u' ? 4 : 8;
          if (pos + digits > src_.size()) Fail(line, "truncated \\" + std::string(1, esc) + " escape");
          char32_t cp = 0;
          for (size_t k = 0; k < digits; ++k) {
            char h = src_[pos + k];
            if (!std::isxdigit(static_cast<unsigned char>(h))) Fail(line, "bad \\" + std::string(1, esc) + " escape");
            cp = cp * 16 + (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
          }
          if (cp > 0x10FFFF) Fail(line, "escape out of range");
          out += EncodeUtf8(std::u32string(1, cp));
          pos += digits;
          break;
        }
        default:  // Python keeps an unknown escape as it is
          out += '\\';
          out += esc;
      }
    }
    Push(Token::Type::kString, out, line);
    return pos + 1;
  }

  size_t LexRaw(size_t pos, int line, bool* strip_next, bool* trim_newline) {
    size_t search = pos;
    while (true) {
      size_t open = src_.find("{%", search);
      if (open == std::string::npos) Fail(line, "missing {% endraw %}");
      size_t k = open + 2;
      bool strip_before = k < src_.size() && src_[k] == '-';
      if (k < src_.size() && (src_[k] == '-' || src_[k] == '+')) ++k;
      while (k < src_.size() && IsSpace(src_[k])) ++k;
      if (src_.compare(k, 6, "endraw") != 0) {
        search = open + 2;
        continue;
      }
      k += 6;
      while (k < src_.size() && IsSpace(src_[k])) ++k;
      bool strip_after = k < src_.size() && src_[k] == '-';
      if (k < src_.size() && (src_[k] == '-' || src_[k] == '+')) ++k;
      if (src_.compare(k, 2, "%}") != 0) Fail(line, "malformed {% endraw %}");
      size_t s = pos, e = open;
      if (*strip_next) {
        while (s < e && IsSpace(src_[s])) ++s;
      } else if (*trim_newline && s < e && src_[s] == '\n') {
        ++s;
      }
      if (strip_before) {
        while (e > s && IsSpace(src_[e - 1])) --e;
      }
      if (e > s) Push(Token::Type::kText, src_.substr(s, e - s), line);
      *strip_next = strip_after;
      *trim_newline = !strip_after;
      return k + 2;
    }
  }

  const std::string& src_;
  std::vector<Token> tokens_;
  size_t line_offset_ = 0;
  int line_ = 1;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body ParseAll() {
    std::string end;
    Body body = ParseBody({}, &end);
    return body;
  }

 private:
  const Token& Peek(size_t ahead = 0) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
  const Token& Next() {
    const Token& t = tokens_[pos_];
    if (pos_ + 1 < tokens_.size()) ++pos_;
    return t;
  }
  bool IsOp(const char* op, size_t ahead = 0) const {
    return Peek(ahead).type == Token::Type::kOp && Peek(ahead).text == op;
  }
  bool IsName(const char* name, size_t ahead = 0) const {
    return Peek(ahead).type == Token::Type::kName && Peek(ahead).text == name;
  }
  bool SkipOp(const char* op) {
    if (!IsOp(op)) return false;
    Next();
    return true;
  }
  bool SkipName(const char* name) {
    if (!IsName(name)) return false;
    Next();
    return true;
  }
  void ExpectOp(const char* op) {
    if (!SkipOp(op)) Fail(Peek().line, std::string("expected '") + op + "', found " + Describe(Peek()));
  }
  std::string ExpectName() {
    if (Peek().type != Token::Type::kName) Fail(Peek().line, "expected a name, found " + Describe(Peek()));
    return Next().text;
  }
  void ExpectBlockEnd() {
    if (Peek().type != Token::Type::kBlockEnd) Fail(Peek().line, "expected '%}', found " + Describe(Peek()));
    Next();
  }
  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Token::Type::kText: return "text";
      case Token::Type::kVarBegin: return "'{{'";
      case Token::Type::kVarEnd: return "'}}'";
      case Token::Type::kBlockBegin: return "'{%'";
      case Token::Type::kBlockEnd: return "'%}'";
      case Token::Type::kEof: return "the end of the template";
      case Token::Type::kString: return "a string";
      default: return "'" + t.text + "'";
    }
  }

  ExprPtr Make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // Statements up to one of `ends` ({% end... %} or {% else %} ...), whose name goes to *found
  // with the tag's '{%' and name consumed.
  Body ParseBody(const std::set<std::string>& ends, std::string* found) {
    Body body;
    while (true) {
      const Token& t = Peek();
      if (t.type == Token::Type::kEof) {
        if (!ends.empty()) Fail(t.line, "missing {% " + *ends.rbegin() + " %}");
        return body;
      }
      if (t.type == Token::Type::kText) {
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kText;
        s->line = t.line;
        s->text = t.text;
        Next();
        body.push_back(std::move(s));
        continue;
      }
      if (t.type == Token::Type::kVarBegin) {
        Next();
        auto s = std::make_unique<Stmt>();
        s->kind = Stmt::Kind::kOutput;
        s->line = t.line;
        s->expr = ParseTuple(true);
        if (Peek().type != Token::Type::kVarEnd) Fail(Peek().line, "expected '}}', found " + Describe(Peek()));
        Next();
        body.push_back(std::move(s));
        continue;
      }
      if (t.type != Token::Type::kBlockBegin) Fail(t.line, "unexpected " + Describe(t));
      int line = t.line;
      Next();
      std::string keyword = ExpectName();
      if (ends.count(keyword)) {
        *found = keyword;
        return body;
      }
      body.push_back(ParseStatement(keyword, line));
    }
  }

  StmtPtr ParseStatement(const std::string& keyword, int line) {
    auto s = std::make_unique<Stmt>();
    s->line = line;
    if (keyword == "if") {
      s->kind = Stmt::Kind::kIf;
      ExprPtr condition = ParseTuple(true);
      while (true) {
        ExpectBlockEnd();
        std::string end;
        Body branch = ParseBody({"elif", "else", "endif"}, &end);
        s->branches.emplace_back(std::move(condition), std::move(branch));
        if (end == "elif") {
          condition = ParseTuple(true);
          continue;
        }
        if (end == "else") {
          ExpectBlockEnd();
          s->else_body = ParseBody({"endif"}, &end);
        }
        ExpectBlockEnd();
        return s;
      }
    }
    if (keyword == "for") {
      s->kind = Stmt::Kind::kFor;
      bool parenthesized = SkipOp("(");
      do {
        s->targets.push_back(ExpectName());
      } while (SkipOp(","));
      if (parenthesized) ExpectOp(")");
      if (!SkipName("in")) Fail(Peek().line, "expected 'in' in a for loop");
      s->expr = ParseTuple(false);
      if (SkipName("if")) s->filter = ParseExpression(true);
      if (IsName("recursive")) Fail(Peek().line, "recursive for loops are not supported");
      ExpectBlockEnd();
      std::string end;
      ++loop_depth_;
      s->body = ParseBody({"else", "endfor"}, &end);
      --loop_depth_;
      if (end == "else") {
        ExpectBlockEnd();
        s->else_body = ParseBody({"endfor"}, &end);
      }
      ExpectBlockEnd();
      return s;
    }
    if (keyword == "set") {
      std::string first = ExpectName();
      if (SkipOp(".")) {
        s->kind = Stmt::Kind::kSet;
        s->targets.push_back(first);
        s->attribute = ExpectName();
        ExpectOp("=");
        s->expr = ParseTuple(true);
        ExpectBlockEnd();
        return s;
      }
      s->targets.push_back(first);
      while (SkipOp(",")) s->targets.push_back(ExpectName());
      if (SkipOp("=")) {
        s->kind = Stmt::Kind::kSet;
        s->expr = ParseTuple(true);
        ExpectBlockEnd();
        return s;
      }
      if (s->targets.size() != 1) Fail(line, "a block set takes one name");
      s->kind = Stmt::Kind::kSetBlock;
      if (IsOp("|")) s->filter = ParseFilterChain(nullptr);
      ExpectBlockEnd();
      std::string end;
      s->body = ParseBody({"endset"}, &end);
      ExpectBlockEnd();
      return s;
    }
    if (keyword == "macro") {
      s->kind = Stmt::Kind::kMacro;
      s->text = ExpectName();
      ExpectOp("(");
      bool seen_default = false;
      while (!IsOp(")")) {
        MacroParam param;
        param.name = ExpectName();
        if (SkipOp("=")) {
          param.default_value = ParseExpression(true);
          seen_default = true;
        } else if (seen_default) {
          Fail(Peek().line, "a macro parameter without a default follows one with a default");
        }
        s->params.push_back(std::move(param));
        if (!SkipOp(",")) break;
      }
      ExpectOp(")");
      ExpectBlockEnd();
      std::string end;
      int outer_loops = loop_depth_;
      loop_depth_ = 0;  // a loop around a macro's definition is not a loop inside its body
      s->body = ParseBody({"endmacro"}, &end);
      loop_depth_ = outer_loops;
      if (Peek().type == Token::Type::kName) Next();  // {% endmacro name %}
      ExpectBlockEnd();
      return s;
    }
    if (keyword == "filter") {
      s->kind = Stmt::Kind::kFilterBlock;
      s->filter = ParseFilterChain(nullptr, /*leading_pipe=*/false);
      ExpectBlockEnd();
      std::string end;
      s->body = ParseBody({"endfilter"}, &end);
      ExpectBlockEnd();
      return s;
    }
    if (keyword == "generation") {
      // transformers' AssistantTracker tag: renders its body as it is.
      s->kind = Stmt::Kind::kIf;
      ExpectBlockEnd();
      std::string end;
      Body body = ParseBody({"endgeneration"}, &end);
      ExpectBlockEnd();
      ExprPtr always = Make(Expr::Kind::kLiteral, line);
      always->value = Value(true);
      s->branches.emplace_back(std::move(always), std::move(body));
      return s;
    }
    if (keyword == "break" || keyword == "continue") {
      if (loop_depth_ == 0) Fail(line, "'" + keyword + "' outside a loop");
      s->kind = keyword == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      ExpectBlockEnd();
      return s;
    }
    Fail(line, "the tag '" + keyword + "' is not supported by kvflow's chat-template engine");
  }

  // expr [, expr ...]: a tuple when there is a comma.
  ExprPtr ParseTuple(bool with_condition) {
    int line = Peek().line;
    ExprPtr first = ParseExpression(with_condition);
    if (!IsOp(",")) return first;
    ExprPtr tuple = Make(Expr::Kind::kTuple, line);
    tuple->items.push_back(std::move(first));
    while (SkipOp(",")) {
      if (Peek().type == Token::Type::kBlockEnd || Peek().type == Token::Type::kVarEnd) break;
      tuple->items.push_back(ParseExpression(with_condition));
    }
    return tuple;
  }

  ExprPtr ParseExpression(bool with_condition) {
    ExprPtr expr = ParseOr();
    if (!with_condition) return expr;
    while (IsName("if")) {
      int line = Next().line;
      ExprPtr cond = Make(Expr::Kind::kCondition, line);
      cond->items.push_back(ParseOr());
      cond->items.push_back(std::move(expr));
      cond->items.push_back(SkipName("else") ? ParseExpression(true) : nullptr);
      expr = std::move(cond);
    }
    return expr;
  }

  ExprPtr Binary(const std::string& op, ExprPtr a, ExprPtr b, int line) {
    ExprPtr e = Make(Expr::Kind::kBinary, line);
    e->name = op;
    e->items.push_back(std::move(a));
    e->items.push_back(std::move(b));
    return e;
  }

  ExprPtr ParseOr() {
    ExprPtr left = ParseAnd();
    while (IsName("or")) {
      int line = Next().line;
      left = Binary("or", std::move(left), ParseAnd(), line);
    }
    return left;
  }

  ExprPtr ParseAnd() {
    ExprPtr left = ParseNot();
    while (IsName("and")) {
      int line = Next().line;
      left = Binary("and", std::move(left), ParseNot(), line);
    }
    return left;
  }

  ExprPtr ParseNot() {
    if (IsName("not")) {
      int line = Next().line;
      ExprPtr e = Make(Expr::Kind::kUnary, line);
      e->name = "not";
      e->items.push_back(ParseNot());
      return e;
    }
    return ParseCompare();
  }

  ExprPtr ParseCompare() {
    int line = Peek().line;
    ExprPtr first = ParseMath1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (Peek().type == Token::Type::kOp &&
          (Peek().text == "==" || Peek().text == "!=" || Peek().text == "<" || Peek().text == ">" ||
           Peek().text == "<=" || Peek().text == ">=")) {
        op = Next().text;
      } else if (IsName("in")) {
        Next();
        op = "in";
      } else if (IsName("not") && IsName("in", 1)) {
        Next();
        Next();
        op = "not in";
      } else {
        break;
      }
      if (!cmp) {
        cmp = Make(Expr::Kind::kCompare, line);
        cmp->items.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->items.push_back(ParseMath1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }

  ExprPtr ParseMath1() {
    ExprPtr left = ParseConcat();
    while (IsOp("+") || IsOp("-")) {
      const Token& t = Next();
      left = Binary(t.text, std::move(left), ParseConcat(), t.line);
    }
    return left;
  }

  ExprPtr ParseConcat() {
    ExprPtr left = ParseMath2();
    while (IsOp("~")) {
      int line = Next().line;
      left = Binary("~", std::move(left), ParseMath2(), line);
    }
    return left;
  }

  ExprPtr ParseMath2() {
    ExprPtr left = ParsePow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const Token& t = Next();
      left = Binary(t.text, std::move(left), ParsePow(), t.line);
    }
    return left;
  }

  ExprPtr ParsePow() {
    ExprPtr left = ParseUnary(true);
    while (IsOp("**")) {
      int line = Next().line;
      left = Binary("**", std::move(left), ParseUnary(true), line);
    }
    return left;
  }

  ExprPtr ParseUnary(bool with_filter) {
    ExprPtr node;
    if (IsOp("-") || IsOp("+")) {
      const Token& t = Next();
      node = Make(Expr::Kind::kUnary, t.line);
      node->name = t.text;
      node->items.push_back(ParseUnary(false));
    } else {
      node = ParsePrimary();
    }
    node = ParsePostfix(std::move(node));
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  ExprPtr ParsePrimary() {
    const Token& t = Peek();
    int line = t.line;
    switch (t.type) {
      case Token::Type::kName: {
        std::string name = Next().text;
        ExprPtr e = Make(Expr::Kind::kLiteral, line);
        if (name == "true" || name == "True") e->value = Value(true);
        else if (name == "false" || name == "False") e->value = Value(false);
        else if (name == "none" || name == "None") e->value = Value::None();
        else {
          e->kind = Expr::Kind::kName;
          e->name = name;
        }
        return e;
      }
      case Token::Type::kString: {
        std::string text = Next().text;
        while (Peek().type == Token::Type::kString) text += Next().text;  // adjacent literals join
        ExprPtr e = Make(Expr::Kind::kLiteral, line);
        e->value = Value(std::move(text));
        return e;
      }
      case Token::Type::kInt:
      case Token::Type::kFloat: {
        ExprPtr e = Make(Expr::Kind::kLiteral, line);
        e->value = Next().number;
        return e;
      }
      case Token::Type::kOp:
        if (t.text == "(") {
          Next();
          if (SkipOp(")")) return Make(Expr::Kind::kTuple, line);
          ExprPtr inner = ParseTuple(true);
          if (IsOp(",")) Fail(Peek().line, "expected ')'");
          ExpectOp(")");
          return inner;
        }
        if (t.text == "[") {
          Next();
          ExprPtr list = Make(Expr::Kind::kList, line);
          while (!IsOp("]")) {
            list->items.push_back(ParseExpression(true));
            if (!SkipOp(",")) break;
          }
          ExpectOp("]");
          return list;
        }
        if (t.text == "{") {
          Next();
          ExprPtr dict = Make(Expr::Kind::kDict, line);
          while (!IsOp("}")) {
            dict->items.push_back(ParseExpression(true));
            ExpectOp(":");
            dict->items.push_back(ParseExpression(true));
            if (!SkipOp(",")) break;
          }
          ExpectOp("}");
          return dict;
        }
        break;
      default:
        break;
    }
    Fail(line, "unexpected " + Describe(t));
  }

  ExprPtr ParsePostfix(ExprPtr node) {
    while (true) {
      if (IsOp(".")) {
        int line = Next().line;
        ExprPtr e;
        if (Peek().type == Token::Type::kInt) {
          e = Make(Expr::Kind::kGetItem, line);
          e->items.push_back(std::move(node));
          ExprPtr index = Make(Expr::Kind::kLiteral, line);
          index->value = Next().number;
          e->items.push_back(std::move(index));
        } else {
          e = Make(Expr::Kind::kGetAttr, line);
          e->name = ExpectName();
          e->items.push_back(std::move(node));
        }
        node = std::move(e);
      } else if (IsOp("[")) {
        int line = Next().line;
        ExprPtr parts[3];
        bool is_slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!IsOp(":") && !IsOp("]")) parts[k] = ParseExpression(true);
          if (k < 2 && SkipOp(":")) {
            is_slice = true;
            continue;
          }
          break;
        }
        ExpectOp("]");
        ExprPtr e = Make(is_slice ? Expr::Kind::kSlice : Expr::Kind::kGetItem, line);
        e->items.push_back(std::move(node));
        if (!is_slice) {
          if (!parts[0]) Fail(line, "empty subscript");
          e->items.push_back(std::move(parts[0]));
        } else {
          for (auto& p : parts) e->items.push_back(std::move(p));
        }
        node = std::move(e);
      } else if (IsOp("(")) {
        int line = Peek().line;
        ExprPtr e = Make(Expr::Kind::kCall, line);
        e->items.push_back(std::move(node));
        ParseCallArgs(*e);
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  // ( args, name=value ) into e.items[1..] and e.keywords.
  void ParseCallArgs(Expr& e) {
    ExpectOp("(");
    while (!IsOp(")")) {
      if (IsOp("*") || IsOp("**")) Fail(Peek().line, "*args and **kwargs in calls are not supported");
      if (Peek().type == Token::Type::kName && IsOp("=", 1)) {
        std::string name = Next().text;
        Next();
        e.keywords.emplace_back(name, ParseExpression(true));
      } else {
        if (!e.keywords.empty()) Fail(Peek().line, "a positional argument follows a keyword argument");
        e.items.push_back(ParseExpression(true));
      }
      if (!SkipOp(",")) break;
    }
    ExpectOp(")");
  }

  ExprPtr ParseFilterExpr(ExprPtr node) {
    while (true) {
      if (IsOp("|")) {
        node = ParseFilterChain(std::move(node));
      } else if (IsName("is")) {
        int line = Next().line;
        ExprPtr test = Make(Expr::Kind::kTest, line);
        test->negated = SkipName("not");
        test->name = ExpectName();
        test->items.push_back(std::move(node));
        if (IsOp("(")) {
          ParseCallArgs(*test);
        } else if ((Peek().type == Token::Type::kString || Peek().type == Token::Type::kInt ||
                    Peek().type == Token::Type::kFloat || IsOp("[") || IsOp("{") ||
                    (Peek().type == Token::Type::kName && !IsName("else") && !IsName("or") && !IsName("and") &&
                     !IsName("if") && !IsName("in") && !IsName("not") && !IsName("is")))) {
          test->items.push_back(ParsePostfix(ParsePrimary()));
        }
        node = std::move(test);
      } else if (IsOp("(")) {
        ExprPtr e = Make(Expr::Kind::kCall, Peek().line);
        e->items.push_back(std::move(node));
        ParseCallArgs(*e);
        node = std::move(e);
      } else {
        return node;
      }
    }
  }

  // | name(args) | name ...; `node` null for a filter block.
  ExprPtr ParseFilterChain(ExprPtr node, bool leading_pipe = true) {
    bool first = true;
    while (first ? (!leading_pipe || IsOp("|")) : IsOp("|")) {
      if (!first || leading_pipe) ExpectOp("|");
      first = false;
      int line = Peek().line;
      ExprPtr f = Make(Expr::Kind::kFilter, line);
      f->name = ExpectName();
      while (SkipOp(".")) f->name += "." + ExpectName();
      f->items.push_back(std::move(node));
      if (IsOp("(")) ParseCallArgs(*f);
      node = std::move(f);
    }
    return node;
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

Body ParseTemplate(const std::string& raw_source) {
  // As jinja2's lexer: newlines normalised to \n, and one trailing newline dropped
  // (keep_trailing_newline=False).
  std::string source;
  source.reserve(raw_source.size());
  for (size_t i = 0; i < raw_source.size(); ++i) {
    if (raw_source[i] == '\r') {
      source += '\n';
      if (i + 1 < raw_source.size() && raw_source[i + 1] == '\n') ++i;
    } else {
      source += raw_source[i];
    }
  }
  if (!source.empty() && source.back() == '\n') source.pop_back();
  Lexer lexer(source);
  Parser parser(lexer.Run());
  return parser.ParseAll();
}

}  // namespace kvflow::jinja
