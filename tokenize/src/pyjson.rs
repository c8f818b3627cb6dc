//! Python's `json.dumps` over template values, for transformers' `tojson` filter.
//!
//! transformers (5.19, `utils/chat_template_utils.py`) replaces Jinja's `tojson` with
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, each
//! settable by keyword. So: keys in insertion order (the values come from JSON parsed with
//! serde_json's and minijinja's `preserve_order`), `", "` and `": "` separators (`","` between
//! items when indenting), floats as Python's `repr`, `NaN`/`Infinity`, and no HTML escaping.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Error, ErrorKind, Value};

use crate::chat::ToolValues;

/// Options of `json.dumps` that templates pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Options {
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// The `tojson` filter; the text of a kept tool list, or of one of its tools, is written once
/// per set of options and then taken from `kept`.
pub(crate) fn tojson(kept: &ToolValues, value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let options = options(kwargs)?;
    let Some(address) = object_address(value) else {
        return written(value, &options);
    };
    if let Some(text) = kept.text_of(address, &options) {
        return Ok(text);
    }
    let text = written(value, &options)?;
    kept.remember_text(address, &options, &text);
    Ok(text)
}

/// The address of `value`'s map or list, which tells a kept tool value apart while it is kept
/// (minijinja's maps with `preserve_order` are `IndexMap<Value, Value>`; if that ever changes,
/// nothing is found and every text is written, as before).
pub(crate) fn object_address(value: &Value) -> Option<usize> {
    if let Some(map) = value.downcast_object_ref::<indexmap::IndexMap<Value, Value>>() {
        return Some(std::ptr::from_ref(map).addr());
    }
    value
        .downcast_object_ref::<Vec<Value>>()
        .map(|list| std::ptr::from_ref(list).addr())
}

/// `json.dumps(value)` with `options`, as a safe string.
fn written(value: &Value, options: &Options) -> Result<Value, Error> {
    let mut out = String::new();
    write(value, options, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// `tojson`'s keyword arguments as `json.dumps` reads them.
fn options(kwargs: Kwargs) -> Result<Options, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    // Python: an int indents by that many spaces, a string by itself; None is compact.
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.to_string()),
        Some(v) => Some(" ".repeat(usize::try_from(v)?)),
    };
    let (item_separator, key_separator) = match separators {
        Some(v) if !(v.is_none() || v.is_undefined()) => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] => (item.to_string(), key.to_string()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "separators must be an (item, key) pair",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    Ok(Options {
        indent,
        item_separator,
        key_separator,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    })
}

fn newline(options: &Options, depth: usize, out: &mut String) {
    if let Some(indent) = &options.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

fn write(value: &Value, options: &Options, depth: usize, out: &mut String) -> Result<(), Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => {
            out.push_str(&i128::try_from(value.clone())?.to_string());
        }
        ValueKind::Number => out.push_str(&python_float_repr(f64::try_from(value.clone())?)),
        ValueKind::String | ValueKind::Bytes => {
            write_string(&value.to_string(), options.ensure_ascii, out);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&options.item_separator);
                }
                newline(options, depth + 1, out);
                write(item, options, depth + 1, out)?;
            }
            if !items.is_empty() {
                newline(options, depth, out);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if options.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(&options.item_separator);
                }
                newline(options, depth + 1, out);
                write_key(key, options, out)?;
                out.push_str(&options.key_separator);
                write(&value.get_item(key)?, options, depth + 1, out)?;
            }
            if !keys.is_empty() {
                newline(options, depth, out);
            }
            out.push('}');
        }
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("Object of type {} is not JSON serializable", value.kind()),
            ));
        }
    }
    Ok(())
}

/// Python turns non-string keys into strings (`true`, `1`, `1.5`, `null`).
fn write_key(key: &Value, options: &Options, out: &mut String) -> Result<(), Error> {
    let text = match key.kind() {
        ValueKind::String => key.to_string(),
        ValueKind::Bool => (if key.is_true() { "true" } else { "false" }).to_owned(),
        ValueKind::None | ValueKind::Undefined => "null".to_owned(),
        ValueKind::Number if key.is_integer() => i128::try_from(key.clone())?.to_string(),
        ValueKind::Number => python_float_repr(f64::try_from(key.clone())?),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "keys must be str, int, float, bool or None",
            ));
        }
    };
    write_string(&text, options.ensure_ascii, out);
    Ok(())
}

/// A JSON string literal as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`, `\f`, other
/// control characters as `\u00xx`; with `ensure_ascii` every non-ASCII character as `\uxxxx`
/// (UTF-16 surrogate pairs above the BMP).
pub(crate) fn write_string(text: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && !c.is_ascii()) => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `repr(float)`: the shortest digits that round-trip, fixed notation for exponents -4..16 (with
/// `.0` when integral), else `d.ddde[+-]XX`; `NaN`, `Infinity` and `-Infinity` as `json.dumps`.
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.to_owned();
    }
    // Rust's `{:e}` prints the shortest round-trip digits: "1.2345e-7", "1e16".
    let sci = format!("{:e}", f.abs());
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let sign = if f < 0.0 { "-" } else { "" };
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        let text = if point <= 0 {
            format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
        } else {
            let point = point as usize;
            if digits.len() <= point {
                format!("{digits}{}.0", "0".repeat(point - digits.len()))
            } else {
                format!("{}.{}", &digits[..point], &digits[point..])
            }
        };
        format!("{sign}{text}")
    } else {
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exponent.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_as_python_repr() {
        for (f, python) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (100.0, "100.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (1e-4, "0.0001"),
            (1e-5, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (-2.5, "-2.5"),
            (1e100, "1e+100"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (9999999999999998.0, "9999999999999998.0"),
        ] {
            assert_eq!(python_float_repr(f), python, "{f}");
        }
    }

    #[test]
    fn strings_escape_as_python() {
        let mut out = String::new();
        write_string("a\"\\\n\u{1}\u{7f}é😀", false, &mut out);
        assert_eq!(out, "\"a\\\"\\\\\\n\\u0001\u{7f}é😀\"");
        out.clear();
        write_string("é😀", true, &mut out);
        assert_eq!(out, "\"\\u00e9\\ud83d\\ude00\"");
    }
}
