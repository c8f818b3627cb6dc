//! Output tags that join strings with `+` (`{{- '<|im_start|>' + message.role + '\n' + content
//! }}`), rewritten to print their operands one after another when every one is a string.
//!
//! minijinja builds each `+`'s result as a new string, so a message's text was copied once per
//! operator after it (three times in Qwen's templates) before being written: on a long chat,
//! more than half of the render. Printing strings in turn writes the same text. Any other operand
//! (a number, a list, undefined) takes the original expression, so its sum, its concatenation or
//! its error is minijinja's own; each operand is evaluated once, into a variable both branches
//! read. Only a plain chain is rewritten: operands that are names, literals, attribute and item
//! lookups, calls and filters, joined by `+` alone; a tag with any other operator or keyword
//! outside brackets is left as written. The rewrite adds no whitespace of its own and begins and
//! ends with an output tag, so the environment's `trim_blocks` and `lstrip_blocks` act as on the
//! original, and the tag's own `-` markers stay where they were.

/// Prefix of the variables the rewrite assigns (no template uses it).
const VARIABLE: &str = "__kvroute_joined_";

/// Words that are operators or parts of a conditional expression in Jinja: outside brackets they
/// bind looser than `+` (or change what it applies to), so a tag using one is left alone.
const KEYWORDS: [&str; 9] = [
    "if",
    "else",
    "and",
    "or",
    "not",
    "in",
    "is",
    "for",
    "recursive",
];

/// `source` with every plain `+` chain of an output tag printed operand by operand (see the
/// module's documentation). Comments, statements and `raw` blocks are copied as written.
pub(crate) fn split_joined_output(source: &str) -> String {
    let mut out = String::with_capacity(source.len() * 2);
    let mut rest = source;
    while let Some(start) = next_tag(rest) {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(len) = tag_len(tag) else {
            // Unterminated: the compiler reports it on the source as written.
            out.push_str(tag);
            return out;
        };
        let (whole, after) = tag.split_at(len);
        rest = after;
        if whole.starts_with("{{") {
            match split_output(whole) {
                Some(split) => out.push_str(&split),
                None => out.push_str(whole),
            }
        } else if is_statement(whole, "raw") {
            out.push_str(whole);
            let end = raw_end(rest).unwrap_or(rest.len());
            out.push_str(&rest[..end]);
            rest = &rest[end..];
        } else {
            out.push_str(whole);
        }
    }
    out.push_str(rest);
    out
}

/// Offset of the next `{{`, `{%` or `{#`.
fn next_tag(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    (0..bytes.len().saturating_sub(1))
        .find(|&i| bytes[i] == b'{' && matches!(bytes[i + 1], b'{' | b'%' | b'#'))
}

/// Length of the tag `tag` starts with, through its closing delimiter: a comment's first `#}`,
/// a statement's first `%}` and an output tag's first `}}` outside string literals (and, for an
/// output tag, outside brackets: a dict literal ends in `}`).
fn tag_len(tag: &str) -> Option<usize> {
    let bytes = tag.as_bytes();
    let (close, brackets) = match bytes.get(1) {
        Some(b'#') => return tag[2..].find("#}").map(|i| i + 4),
        Some(b'%') => (b'%', false),
        _ => (b'}', true),
    };
    let mut depth = 0usize;
    let mut i = 2;
    while i < bytes.len() {
        match bytes[i] {
            quote @ (b'\'' | b'"') => i = string_end(bytes, i, quote)?,
            b'(' | b'[' | b'{' if brackets => depth += 1,
            b')' | b']' if brackets => depth = depth.checked_sub(1)?,
            b'}' if brackets && depth > 0 => depth -= 1,
            c if c == close && depth == 0 && bytes.get(i + 1) == Some(&b'}') => return Some(i + 2),
            _ => {}
        }
        i += 1;
    }
    None
}

/// Offset of the closing quote of the string literal opening at `start` (backslash escapes
/// skipped).
fn string_end(bytes: &[u8], start: usize, quote: u8) -> Option<usize> {
    let mut i = start + 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            c if c == quote => return Some(i),
            _ => i += 1,
        }
    }
    None
}

/// Whether the statement tag `tag` is `{% name %}` (whitespace control allowed).
fn is_statement(tag: &str, name: &str) -> bool {
    tag.strip_prefix("{%")
        .and_then(|t| t.strip_suffix("%}"))
        .map(|inner| inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace()))
        == Some(name)
}

/// Offset just past the `{% endraw %}` tag in `text`, if any.
fn raw_end(text: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(start) = text[from..].find("{%").map(|i| i + from) {
        let end = text[start..].find("%}").map(|i| start + i + 2)?;
        if is_statement(&text[start..end], "endraw") {
            return Some(end);
        }
        from = end;
    }
    None
}

/// The output tag `tag` printed operand by operand, when it is a plain chain of two or more.
fn split_output(tag: &str) -> Option<String> {
    let inner = &tag[2..tag.len() - 2];
    let (open, body) = match inner.strip_prefix('-') {
        Some(body) => ("-", body),
        None => ("", inner),
    };
    let (body, close) = match body.strip_suffix('-') {
        Some(body) => (body, "-"),
        None => (body, ""),
    };
    if body.starts_with('+') || body.ends_with('+') {
        return None;
    }
    let operands = plain_chain(body)?;
    let names: Vec<String> = (0..operands.len())
        .map(|i| format!("{VARIABLE}{i}"))
        .collect();
    let mut out = format!("{{{{{open} '' }}}}");
    for (name, operand) in names.iter().zip(&operands) {
        out.push_str(&format!("{{% set {name} = {operand} %}}"));
    }
    let strings: Vec<String> = names.iter().map(|n| format!("{n} is string")).collect();
    out.push_str(&format!("{{% if {} %}}", strings.join(" and ")));
    for name in &names {
        out.push_str(&format!("{{{{ {name} }}}}"));
    }
    out.push_str(&format!("{{% else %}}{{{{ {} }}}}", names.join(" + ")));
    out.push_str(&format!("{{% endif %}}{{{{ '' {close}}}}}"));
    Some(out)
}

/// The operands of `expression` when it is two or more joined by `+` with nothing else outside
/// brackets but names, literals, `.` lookups and `|` filters (`None` otherwise).
fn plain_chain(expression: &str) -> Option<Vec<&str>> {
    let bytes = expression.as_bytes();
    let mut operands = Vec::new();
    let (mut depth, mut start, mut i) = (0usize, 0, 0);
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'\'' | b'"' => i = string_end(bytes, i, c)?,
            b'(' | b'[' | b'{' => depth += 1,
            b')' | b']' | b'}' => depth = depth.checked_sub(1)?,
            _ if depth > 0 => {}
            b'+' => {
                operands.push(expression[start..i].trim());
                start = i + 1;
            }
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let end = (i..bytes.len())
                    .find(|&j| !(bytes[j].is_ascii_alphanumeric() || bytes[j] == b'_'))
                    .unwrap_or(bytes.len());
                let word = &expression[i..end];
                let attribute = expression[..i].trim_end().ends_with('.');
                if !attribute && KEYWORDS.contains(&word) {
                    return None;
                }
                i = end;
                continue;
            }
            c if c.is_ascii_digit() || c.is_ascii_whitespace() || c == b'.' || c == b'|' => {}
            _ => return None,
        }
        i += 1;
    }
    if depth != 0 {
        return None;
    }
    operands.push(expression[start..].trim());
    (operands.len() >= 2 && operands.iter().all(|o| !o.is_empty())).then_some(operands)
}

#[cfg(test)]
mod tests {
    use minijinja::{Environment, Value, context};

    use super::*;

    /// The environment's whitespace settings (transformers').
    fn render(source: &str, ctx: &Value) -> Result<String, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.render_str(source, ctx)
            .map_err(|e| e.kind().to_string())
    }

    #[test]
    fn chains_print_operand_by_operand_and_render_the_same() {
        let templates = [
            "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
            "{% for m in messages %}\n  {{- '<' + m.role + '>' + m.content|trim -}}\n  x {{ m.n + 1 }}\n{% endfor %}\n",
            "a  {{ x + y }}  b\n{%- if true %}\n    {{ x + y -}}   \n{% endif %}\n c",
            "{{ {'a': x}['a'] + y }}{{ '}}' + y }}{# {{ x + y }} #}{% raw %}{{ x + y }}{% endraw %}",
            "{{ x + y|upper + (z if z else 'none') }}",
            "{{ n + m }}|{{ x + n }}|{{ list + list }}|{{ x + missing }}",
            "{{ x - n + y }}{{ x + y if n else y }}{{ x ~ y + y }}{{ x + y is string }}",
        ];
        let contexts = [
            context! {
                message => context!{ role => "user", content => "hi\nthere" },
                messages => vec![
                    context!{ role => "system", content => "  s  ", n => 1 },
                    context!{ role => "user", content => "u", n => 2.5 },
                ],
                x => "x", y => "y", z => "", n => 3, m => 4, list => vec![1, 2],
            },
            context! { message => context!{ role => 1, content => Value::UNDEFINED }, x => 1, y => 2, n => 0 },
        ];
        let mut rewritten = 0;
        for source in templates {
            let split = split_joined_output(source);
            rewritten += usize::from(split != source);
            for ctx in &contexts {
                assert_eq!(
                    render(&split, ctx),
                    render(source, ctx),
                    "{source}\n{split}"
                );
            }
        }
        assert_eq!(
            rewritten, 6,
            "every template but the last has a chain to split"
        );
    }

    #[test]
    fn only_plain_chains_are_split() {
        for (expression, operands) in [
            (
                "'a' + b.c + d['e'] + f(g, 'h+i')|j",
                Some(vec!["'a'", "b.c", "d['e']", "f(g, 'h+i')|j"]),
            ),
            ("a + loop.index", Some(vec!["a", "loop.index"])),
            ("x.is + y", Some(vec!["x.is", "y"])),
            ("a", None),
            ("a + b - c", None),
            ("a + b if c else d", None),
            ("a + b ~ c", None),
            ("a + b * 2", None),
            ("a + -b", None),
            ("a + b == c", None),
            ("not a + b", None),
            ("a + (b", None),
            ("a +", None),
        ] {
            assert_eq!(plain_chain(expression), operands, "{expression}");
        }
        for tag in ["{{+ a + b }}", "{{ a + b +}}"] {
            assert_eq!(split_joined_output(tag), tag, "a `+` marker is left alone");
        }
        assert_eq!(split_joined_output("{{ a + b"), "{{ a + b", "unterminated");
    }
}
