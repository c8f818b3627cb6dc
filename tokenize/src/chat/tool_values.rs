//! The template values of the tool definitions requests send, kept for the next request that
//! sends the same ones.
//!
//! An application sends the same tool definitions with every request. Checking them, building
//! vLLM's canonical form and converting that into template values allocates a map per object
//! and a string per key: about a tenth of a short chat's decision. The values depend on the
//! definitions alone, and template values are immutable, so a request whose definitions equal
//! (in order: the template renders them in order) a kept entry's shares that entry's values,
//! and the `tojson` texts the template wrote of them.

use std::collections::VecDeque;
use std::sync::Arc;

use minijinja::Value;
use parking_lot::Mutex;
use serde_json::Value as Json;

use crate::pyjson::{Options, object_address};

/// Distinct tool lists kept: a few applications' worth.
const KEPT: usize = 16;
/// Largest tool list kept, in bytes of its strings (keys and values) and numbers: [`KEPT`] of
/// them bound the memory at 1 MiB.
const KEPT_BYTES: usize = 64 << 10;

/// Recently sent tool lists and their template values, most recent first.
#[derive(Debug, Default)]
pub(crate) struct ToolValues {
    kept: Mutex<VecDeque<Kept>>,
}

/// One kept tool list.
#[derive(Debug)]
struct Kept {
    sent: Arc<Json>,
    value: Value,
    /// Addresses of the list's and its tools' template objects (alive while kept: no other
    /// object can have them meanwhile).
    objects: Vec<usize>,
    /// `tojson` texts of those objects, by address and options.
    texts: Vec<(usize, Options, Value)>,
}

/// `tojson` texts kept per kept object: a template writes a tool with one set of options.
const TEXTS_PER_OBJECT: usize = 2;

impl ToolValues {
    /// The template value of the tool list `sent`: a kept one when the same list (the same
    /// shared list, or an equal one) was sent before, otherwise `build(sent)`'s, kept when small
    /// enough. Never waits for the lock (renders also run on an idle-priority thread that may be
    /// preempted holding it): when it is taken, the value is built.
    pub(crate) fn get_or_build<E>(
        &self,
        sent: &Arc<Json>,
        build: impl FnOnce(&Json) -> Result<Value, E>,
    ) -> Result<Value, E> {
        if let Some(mut kept) = self.kept.try_lock()
            && let Some(at) = kept
                .iter()
                .position(|k| Arc::ptr_eq(&k.sent, sent) || same_in_order(&k.sent, sent))
            && let Some(entry) = kept.remove(at)
        {
            let value = entry.value.clone();
            kept.push_front(entry);
            return Ok(value);
        }
        let value = build(sent)?;
        if json_bytes(sent, KEPT_BYTES).is_some()
            && let Some(mut kept) = self.kept.try_lock()
        {
            let mut objects: Vec<usize> = object_address(&value).into_iter().collect();
            if let Ok(items) = value.try_iter() {
                objects.extend(items.filter_map(|item| object_address(&item)));
            }
            kept.push_front(Kept {
                sent: Arc::clone(sent),
                value: value.clone(),
                objects,
                texts: Vec::new(),
            });
            kept.truncate(KEPT);
        }
        Ok(value)
    }

    /// The `tojson` text with `options` of the kept object at `address`, if written before.
    pub(crate) fn text_of(&self, address: usize, options: &Options) -> Option<Value> {
        let kept = self.kept.try_lock()?;
        kept.iter()
            .flat_map(|k| &k.texts)
            .find(|(at, with, _)| *at == address && with == options)
            .map(|(.., text)| text.clone())
    }

    /// Keeps `text`, the `tojson` text with `options` of the object at `address`, if that is a
    /// kept list or one of its tools.
    pub(crate) fn remember_text(&self, address: usize, options: &Options, text: &Value) {
        let Some(mut kept) = self.kept.try_lock() else {
            return;
        };
        if let Some(entry) = kept.iter_mut().find(|k| k.objects.contains(&address))
            && entry.texts.len() < entry.objects.len() * TEXTS_PER_OBJECT
        {
            entry.texts.push((address, options.clone(), text.clone()));
        }
    }
}

#[cfg(test)]
impl ToolValues {
    /// `tojson` texts kept, over every kept list.
    pub(crate) fn texts_kept(&self) -> usize {
        self.kept.lock().iter().map(|k| k.texts.len()).sum()
    }
}

/// Whether `a` and `b` are the same JSON with object keys in the same order (serde_json's
/// `==` ignores key order, which the template does not).
fn same_in_order(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Object(a), Json::Object(b)) => {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|((ka, va), (kb, vb))| ka == kb && same_in_order(va, vb))
        }
        (Json::Array(a), Json::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same_in_order(a, b))
        }
        (Json::Object(_) | Json::Array(_), _) | (_, Json::Object(_) | Json::Array(_)) => false,
        // Scalars: a number compares by its representation (1 and 1.0 differ, as rendered).
        (a, b) => a == b,
    }
}

/// The bytes of `value`'s strings and numbers, if at most `limit`.
fn json_bytes(value: &Json, limit: usize) -> Option<usize> {
    let own = match value {
        Json::Null | Json::Bool(_) => 1,
        Json::Number(_) => 8,
        Json::String(s) => s.len(),
        Json::Array(items) => {
            let mut total = 0;
            for item in items {
                total += json_bytes(item, limit.checked_sub(total)?)?;
            }
            return Some(total);
        }
        Json::Object(map) => {
            let mut total = 0;
            for (key, item) in map {
                total += key.len();
                total += json_bytes(item, limit.checked_sub(total)?)?;
            }
            return (total <= limit).then_some(total);
        }
    };
    (own <= limit).then_some(own)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn build(calls: &std::cell::Cell<usize>) -> impl Fn(&Json) -> Result<Value, ()> + '_ {
        move |sent| {
            calls.set(calls.get() + 1);
            Ok(Value::from(sent.to_string()))
        }
    }

    #[test]
    fn an_equal_list_shares_the_kept_value_and_a_reordered_one_does_not() {
        let values = ToolValues::default();
        let calls = std::cell::Cell::new(0);
        let tools =
            Arc::new(json!([{"type": "function", "function": {"name": "a", "description": "d"}}]));
        let first = values.get_or_build(&tools, build(&calls)).unwrap();
        let again = values
            .get_or_build(&Arc::new((*tools).clone()), build(&calls))
            .unwrap();
        assert_eq!(calls.get(), 1, "built once (an equal list)");
        values.get_or_build(&tools, build(&calls)).unwrap();
        assert_eq!(calls.get(), 1, "built once (the same shared list)");
        assert_eq!(first, again);
        let reordered =
            Arc::new(json!([{"function": {"description": "d", "name": "a"}, "type": "function"}]));
        assert_eq!(reordered, tools, "serde_json's equality ignores the order");
        let other = values.get_or_build(&reordered, build(&calls)).unwrap();
        assert_eq!(
            calls.get(),
            2,
            "a reordered list is built: the template renders in order"
        );
        assert_ne!(other, first);
        let float = Arc::new(json!([1.0]));
        values
            .get_or_build(&Arc::new(json!([1])), build(&calls))
            .unwrap();
        values.get_or_build(&float, build(&calls)).unwrap();
        assert_eq!(calls.get(), 4, "1 and 1.0 render differently");
    }

    #[test]
    fn errors_are_not_kept_and_memory_is_bounded() {
        let values = ToolValues::default();
        let calls = std::cell::Cell::new(0);
        let bad = Arc::new(json!("not a list"));
        for _ in 0..2 {
            let failed: Result<Value, &str> =
                values.get_or_build(&bad, |_| Err("tools must be a list"));
            assert!(failed.is_err());
        }
        let huge = Arc::new(json!([{"description": "x".repeat(KEPT_BYTES + 1)}]));
        values.get_or_build(&huge, build(&calls)).unwrap();
        values.get_or_build(&huge, build(&calls)).unwrap();
        assert_eq!(calls.get(), 2, "a list over the size bound is not kept");
        for i in 0..(KEPT + 4) {
            values
                .get_or_build(&Arc::new(json!([i])), build(&calls))
                .unwrap();
        }
        assert_eq!(values.kept.lock().len(), KEPT);
        values
            .get_or_build(&Arc::new(json!([0])), build(&calls))
            .unwrap();
        assert_eq!(
            calls.get(),
            2 + KEPT + 4 + 1,
            "the oldest lists were dropped"
        );
    }
}
