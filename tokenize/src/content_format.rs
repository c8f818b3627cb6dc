//! vLLM's chat-template "content format" detection, on minijinja's syntax tree.
//!
//! vLLM 0.32 (`vllm/renderers/hf.py`, `_detect_content_format`) parses the template and decides
//! whether it iterates over a message's `content`. If it does ("openai" format) every message's
//! content is handed to the template as a list of parts (`[{"type": "text", "text": ...}]`);
//! otherwise ("string" format) text parts are joined with `"\n"` into one string. The search, as
//! vLLM does it:
//!
//! 1. *messages variables*: `messages`, and every name assigned (`{% set x = ... %}`) from a
//!    messages variable, possibly through filters, tests or a slice (`messages[1:]`), repeatedly;
//! 2. *message variables*: the targets of `{% for m in <messages variable> %}` loops;
//! 3. a content loop is a `for` whose iterable is `<message variable>.content` (or
//!    `['content']`, through filters, tests or slices); or, inside a macro called with
//!    `<message variable>.content` as an argument, a loop over that parameter; or, outside
//!    macros, a loop over a variable named `content`.
//!
//! Any content loop means "openai". vLLM asserts loop and assignment targets are plain names;
//! where that assertion would fail the detection errs, and vLLM then falls back to "string". A
//! template that does not parse is "string" too.

use minijinja::machinery::ast::{CallArg, Expr, Macro, Stmt};

/// How message content reaches the template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// Text parts joined with `"\n"` into one string.
    String,
    /// A list of `{"type": "text", "text": ...}` parts.
    OpenAi,
}

/// Detects the content format of a template source, as vLLM does.
pub(crate) fn detect(source: &str) -> ContentFormat {
    let Some(ast) = parse(source) else {
        return ContentFormat::String;
    };
    let mut nodes = Nodes::default();
    nodes.stmt(&ast, false);
    match nodes.has_content_loop() {
        Ok(true) => ContentFormat::OpenAi,
        Ok(false) | Err(TargetNotAName) => ContentFormat::String,
    }
}

/// Words whose presence anywhere in a template makes SGLang take it for a multimodal one.
const SGLANG_MEDIA_WORDS: [&str; 4] = ["image", "audio", "video", "vision"];

/// Detects the content format of a template source as SGLang 0.5.23 does
/// (`parser/jinja_template_utils.py`, `detect_jinja_template_content_format`), which is not
/// vLLM's: a template mentioning a media word is "openai" outright; otherwise it is "openai" only
/// when some loop (anywhere, macros included) iterates over `message.content`, `msg.content` or
/// `m.content` (by attribute or subscript, through filters, tests or slices), whatever the loop
/// variables are named after.
pub(crate) fn detect_sglang(source: &str) -> ContentFormat {
    if SGLANG_MEDIA_WORDS.iter().any(|word| source.contains(word)) {
        return ContentFormat::OpenAi;
    }
    let Some(ast) = parse(source) else {
        return ContentFormat::String;
    };
    let mut nodes = Nodes::default();
    nodes.stmt(&ast, false);
    let content_loop = nodes.loops.iter().any(|(_, iter, _)| {
        ["message", "msg", "m"]
            .iter()
            .any(|var| is_var_or_elems_access(iter, var, Some("content")))
    });
    if content_loop {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

/// The template's syntax tree as vLLM and SGLang parse it (`None`: it does not parse).
fn parse(source: &str) -> Option<minijinja::machinery::ast::Stmt<'_>> {
    let whitespace = minijinja::machinery::WhitespaceConfig {
        keep_trailing_newline: false,
        lstrip_blocks: true,
        trim_blocks: true,
    };
    minijinja::machinery::parse(
        source,
        "chat",
        // A unit struct unless minijinja's `custom_syntax` feature is on.
        Default::default(),
        whitespace,
    )
    .ok()
}

/// vLLM's `assert isinstance(target, Name)` failing.
struct TargetNotAName;

/// The nodes the detection looks at, in document order.
#[derive(Default)]
struct Nodes<'t, 'a> {
    /// `{% set target = expr %}`.
    sets: Vec<(&'t Expr<'a>, &'t Expr<'a>)>,
    /// `for` loops, and whether each is inside a macro.
    loops: Vec<(&'t Expr<'a>, &'t Expr<'a>, bool)>,
    /// Macro definitions with the loops in their bodies (indices into `loops`).
    macros: Vec<(&'t Macro<'a>, Vec<usize>)>,
    /// Every call expression (`name(args)`), including `{% call %}` blocks and `{% do %}`.
    calls: Vec<(&'t Expr<'a>, &'t [CallArg<'a>])>,
}

impl<'t, 'a> Nodes<'t, 'a> {
    fn stmts(&mut self, stmts: &'t [Stmt<'a>], in_macro: bool) {
        for stmt in stmts {
            self.stmt(stmt, in_macro);
        }
    }

    fn stmt(&mut self, stmt: &'t Stmt<'a>, in_macro: bool) {
        match stmt {
            Stmt::Template(t) => self.stmts(&t.children, in_macro),
            Stmt::EmitExpr(e) => self.expr(&e.expr),
            Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => {}
            Stmt::ForLoop(f) => {
                self.loops.push((&f.target, &f.iter, in_macro));
                self.expr(&f.target);
                self.expr(&f.iter);
                if let Some(filter) = &f.filter_expr {
                    self.expr(filter);
                }
                self.stmts(&f.body, in_macro);
                self.stmts(&f.else_body, in_macro);
            }
            Stmt::IfCond(c) => {
                self.expr(&c.expr);
                self.stmts(&c.true_body, in_macro);
                self.stmts(&c.false_body, in_macro);
            }
            Stmt::WithBlock(w) => {
                for (target, value) in &w.assignments {
                    self.expr(target);
                    self.expr(value);
                }
                self.stmts(&w.body, in_macro);
            }
            Stmt::Set(s) => {
                self.sets.push((&s.target, &s.expr));
                self.expr(&s.target);
                self.expr(&s.expr);
            }
            Stmt::SetBlock(s) => {
                self.expr(&s.target);
                if let Some(filter) = &s.filter {
                    self.expr(filter);
                }
                self.stmts(&s.body, in_macro);
            }
            Stmt::AutoEscape(a) => {
                self.expr(&a.enabled);
                self.stmts(&a.body, in_macro);
            }
            Stmt::FilterBlock(f) => {
                self.expr(&f.filter);
                self.stmts(&f.body, in_macro);
            }
            Stmt::Block(b) => self.stmts(&b.body, in_macro),
            Stmt::Import(i) => {
                self.expr(&i.expr);
                self.expr(&i.name);
            }
            Stmt::FromImport(i) => {
                self.expr(&i.expr);
                for (name, alias) in &i.names {
                    self.expr(name);
                    if let Some(alias) = alias {
                        self.expr(alias);
                    }
                }
            }
            Stmt::Extends(e) => self.expr(&e.name),
            Stmt::Include(i) => self.expr(&i.name),
            Stmt::Macro(m) => self.macro_decl(m),
            Stmt::CallBlock(c) => {
                self.call(&c.call.expr, &c.call.args);
                self.macro_decl(&c.macro_decl);
            }
            Stmt::Do(d) => self.call(&d.call.expr, &d.call.args),
        }
    }

    fn macro_decl(&mut self, m: &'t Macro<'a>) {
        let first = self.loops.len();
        for arg in m.args.iter().chain(&m.defaults) {
            self.expr(arg);
        }
        self.stmts(&m.body, true);
        let loops = (first..self.loops.len()).collect();
        self.macros.push((m, loops));
    }

    fn call(&mut self, callee: &'t Expr<'a>, args: &'t [CallArg<'a>]) {
        self.calls.push((callee, args));
        self.expr(callee);
        self.args(args);
    }

    fn args(&mut self, args: &'t [CallArg<'a>]) {
        for arg in args {
            match arg {
                CallArg::Pos(e) | CallArg::Kwarg(_, e) | CallArg::PosSplat(e) => self.expr(e),
                CallArg::KwargSplat(e) => self.expr(e),
            }
        }
    }

    fn expr(&mut self, expr: &'t Expr<'a>) {
        match expr {
            Expr::Var(_) | Expr::Const(_) => {}
            Expr::Slice(s) => {
                self.expr(&s.expr);
                for part in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                    self.expr(part);
                }
            }
            Expr::UnaryOp(u) => self.expr(&u.expr),
            Expr::BinOp(b) => {
                self.expr(&b.left);
                self.expr(&b.right);
            }
            Expr::Compare(c) => {
                self.expr(&c.expr);
                for op in &c.ops {
                    self.expr(&op.expr);
                }
            }
            Expr::IfExpr(i) => {
                self.expr(&i.test_expr);
                self.expr(&i.true_expr);
                if let Some(e) = &i.false_expr {
                    self.expr(e);
                }
            }
            Expr::Filter(f) => {
                if let Some(e) = &f.expr {
                    self.expr(e);
                }
                self.args(&f.args);
            }
            Expr::Test(t) => {
                self.expr(&t.expr);
                self.args(&t.args);
            }
            Expr::GetAttr(g) => self.expr(&g.expr),
            Expr::GetItem(g) => {
                self.expr(&g.expr);
                self.expr(&g.subscript_expr);
            }
            Expr::Call(c) => self.call(&c.expr, &c.args),
            Expr::List(l) => {
                for item in &l.items {
                    self.expr(item);
                }
            }
            Expr::Map(m) => {
                for e in m.keys.iter().chain(&m.values) {
                    self.expr(e);
                }
            }
        }
    }

    /// Names assigned from `messages` (transitively), `messages` first.
    fn messages_vars(&self) -> Result<Vec<&'a str>, TargetNotAName> {
        let mut names = vec!["messages"];
        let mut queue = std::collections::VecDeque::from(["messages"]);
        while let Some(related) = queue.pop_front() {
            for (target, rhs) in &self.sets {
                if is_var_or_elems_access(rhs, related, None) {
                    let name = var_name(target).ok_or(TargetNotAName)?;
                    names.push(name);
                    if name != related {
                        queue.push_back(name);
                    }
                }
            }
        }
        Ok(names)
    }

    /// Targets of loops over a messages variable.
    fn message_vars(&self) -> Result<Vec<&'a str>, TargetNotAName> {
        let messages = self.messages_vars()?;
        let mut names = Vec::new();
        for (target, iter, _) in &self.loops {
            if messages
                .iter()
                .any(|m| is_var_or_elems_access(iter, m, None))
            {
                names.push(var_name(target).ok_or(TargetNotAName)?);
            }
        }
        Ok(names)
    }

    fn has_content_loop(&self) -> Result<bool, TargetNotAName> {
        let message_vars = self.message_vars()?;
        let is_content = |e: &Expr<'_>| {
            message_vars
                .iter()
                .any(|m| is_var_or_elems_access(e, m, Some("content")))
        };
        // Macro parameters that receive a message's content, by the loops of each macro
        // (a later macro's entry replaces an earlier one's, as vLLM's dict does).
        let mut content_params: Vec<Option<Vec<&str>>> = vec![None; self.loops.len()];
        for (m, loops) in &self.macros {
            let param_names: Vec<&str> = m.args.iter().filter_map(var_name).collect();
            let mut params = Vec::new();
            for (callee, args) in &self.calls {
                if var_name(callee) != Some(m.name) {
                    continue;
                }
                let positional = args.iter().filter_map(|a| match a {
                    CallArg::Pos(e) => Some(e),
                    _ => None,
                });
                for (i, arg) in positional.enumerate() {
                    if i < m.args.len() && is_content(arg) {
                        params.extend(var_name(&m.args[i]));
                    }
                }
                for arg in args.iter() {
                    if let CallArg::Kwarg(key, value) = arg
                        && param_names.contains(key)
                        && is_content(value)
                    {
                        params.push(key);
                    }
                }
            }
            if !params.is_empty() {
                for &i in loops {
                    content_params[i] = Some(params.clone());
                }
            }
        }
        for (i, (target, iter, in_macro)) in self.loops.iter().enumerate() {
            let found = if is_content(iter) {
                true
            } else if let (Some(params), Some(name)) = (&content_params[i], var_name(iter))
                && params.contains(&name)
            {
                true
            } else {
                !in_macro && var_name(iter) == Some("content")
            };
            if found {
                var_name(target).ok_or(TargetNotAName)?;
                return Ok(true);
            }
        }
        Ok(false)
    }
}

fn var_name<'a>(expr: &Expr<'a>) -> Option<&'a str> {
    match expr {
        Expr::Var(v) => Some(v.id),
        _ => None,
    }
}

/// vLLM's `_is_var_or_elems_access`: `var` (or `var.key` / `var['key']`), through filters,
/// tests and slices.
fn is_var_or_elems_access(expr: &Expr<'_>, var: &str, key: Option<&str>) -> bool {
    match expr {
        Expr::Filter(f) => f
            .expr
            .as_ref()
            .is_some_and(|e| is_var_or_elems_access(e, var, key)),
        Expr::Test(t) => is_var_or_elems_access(&t.expr, var, key),
        Expr::Slice(s) => is_var_or_elems_access(&s.expr, var, key),
        _ => match key {
            None => var_name(expr) == Some(var),
            Some(key) => match expr {
                Expr::GetAttr(g) => var_name(&g.expr) == Some(var) && g.name == key,
                Expr::GetItem(g) => {
                    var_name(&g.expr) == Some(var)
                        && matches!(&g.subscript_expr, Expr::Const(c) if c.value.as_str() == Some(key))
                }
                _ => false,
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_loops_over_content() {
        let openai = [
            "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
            "{% for m in messages %}{% for p in m['content'] | list %}{{ p }}{% endfor %}{% endfor %}",
            "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for p in m.content %}{% endfor %}{% endfor %}",
            "{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.content) }}{% endfor %}",
            "{% macro r(x, c=none) %}{% for p in c %}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(1, c=m.content) }}{% endfor %}",
            "{% for m in messages %}{% set content = m.content %}{% for p in content %}{% endfor %}{% endfor %}",
        ];
        for t in openai {
            assert_eq!(detect(t), ContentFormat::OpenAi, "{t}");
        }
        let string = [
            "{% for m in messages %}{{ m.content }}{% endfor %}",
            "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
            "{% macro r(c) %}{% for p in content %}{% endfor %}{% endmacro %}",
            "{% for m in messages %}{% for p in m.content %}",
            // vLLM's assertion on the target fails: it falls back to "string".
            "{% for m in messages %}{% for a, b in m.content %}{% endfor %}{% endfor %}",
        ];
        for t in string {
            assert_eq!(detect(t), ContentFormat::String, "{t}");
        }
    }

    #[test]
    fn sglang_detects_by_its_own_rules() {
        // A loop over a macro parameter is no content loop for SGLang; vLLM follows the call.
        let through_macro = "{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}\
            {% for m in messages %}{{ r(m.content) }}{% endfor %}";
        assert_eq!(detect(through_macro), ContentFormat::OpenAi);
        assert_eq!(detect_sglang(through_macro), ContentFormat::String);
        // SGLang matches the loop variable by name, not by what it iterates over.
        let named = "{% for turn in messages %}{% for p in turn.content %}{% endfor %}{% endfor %}";
        assert_eq!(detect(named), ContentFormat::OpenAi);
        assert_eq!(detect_sglang(named), ContentFormat::String);
        let msg = "{% for msg in x %}{% for p in msg['content'] | list %}{% endfor %}{% endfor %}";
        assert_eq!(detect_sglang(msg), ContentFormat::OpenAi);
        // A media word anywhere decides for "openai".
        let media = "{# no images here #}{% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(detect(media), ContentFormat::String);
        assert_eq!(detect_sglang(media), ContentFormat::OpenAi);
        assert_eq!(detect_sglang("{% for"), ContentFormat::String);
    }
}
