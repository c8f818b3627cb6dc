//! The media items of a rendered prompt (images, audio, video), as the engine's render answer
//! places them: what vLLM hashes into the blocks they overlap.
//!
//! A render answer's `features` (vLLM 0.32 `MultiModalFeatures`) gives, per modality, each
//! item's identifier (`mm_hashes`: the processor's hash of the item and its processing options,
//! or the client's `uuid` verbatim) and placeholder (`mm_placeholders`: the prompt tokens the
//! item's embeddings take). The engine keeps one list of items sorted by placeholder offset
//! across modalities (`argsort_mm_positions`, a stable sort) and adds `("mm", identifier, offset
//! from the block's start)` to the extra keys of every block an item overlaps
//! (`kvroute_block_keys::ExtraKeys::with_multimodal`); [`MultiModalPlaces`] is that list.

use kvroute_block_keys::MultiModalItem;
use serde::Deserialize;

/// One media item of a prompt: its identifier and the tokens its placeholder spans.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PlacedItem {
    /// vLLM's `identifier` (the `mm_hash`, or the client's uuid).
    pub identifier: Box<str>,
    /// The placeholder's first prompt token.
    pub offset: usize,
    /// Its tokens (at least one).
    pub length: usize,
}

/// A prompt's media items in the order vLLM hashes them: by placeholder offset, which never
/// overlap, each within the prompt.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MultiModalPlaces {
    items: Box<[PlacedItem]>,
}

/// `features` of a render answer, as far as routing reads it (`kwargs_data` and `mm_metadata`
/// are left unread: kvroute asks for none with `mm_payload: "none"`).
#[derive(Debug, Deserialize)]
pub(super) struct RenderedFeatures {
    mm_hashes: serde_json::Map<String, serde_json::Value>,
    mm_placeholders: serde_json::Map<String, serde_json::Value>,
}

#[derive(Debug, Deserialize)]
struct Placeholder {
    offset: usize,
    length: usize,
}

impl MultiModalPlaces {
    /// The items of a render answer's `features` for a prompt of `prompt_len` tokens: `None`
    /// when it has none; a reason when the features are malformed (a modality's hashes and
    /// placeholders differ in number, a hash that is not a string, an empty placeholder, one
    /// past the prompt, two that overlap).
    pub(super) fn from_features(
        features: &RenderedFeatures,
        prompt_len: usize,
    ) -> Result<Option<Self>, String> {
        let mut items = Vec::new();
        // vLLM flattens modality by modality in the placeholders' order, then sorts stably by
        // offset.
        for (modality, placeholders) in &features.mm_placeholders {
            let placeholders: Vec<Placeholder> = serde_json::from_value(placeholders.clone())
                .map_err(|e| format!("features.mm_placeholders.{modality}: {e}"))?;
            let hashes = match features.mm_hashes.get(modality) {
                Some(serde_json::Value::Array(hashes)) => hashes,
                Some(_) => return Err(format!("features.mm_hashes.{modality} is not a list")),
                None if placeholders.is_empty() => continue,
                None => return Err(format!("features.mm_hashes has no {modality}")),
            };
            if hashes.len() != placeholders.len() {
                return Err(format!(
                    "features: {} {modality} hashes for {} placeholders",
                    hashes.len(),
                    placeholders.len()
                ));
            }
            for (hash, placeholder) in hashes.iter().zip(placeholders) {
                let Some(identifier) = hash.as_str() else {
                    return Err(format!("features.mm_hashes.{modality}: not a string"));
                };
                if placeholder.length == 0 {
                    return Err(format!("features: an empty {modality} placeholder"));
                }
                items.push(PlacedItem {
                    identifier: identifier.into(),
                    offset: placeholder.offset,
                    length: placeholder.length,
                });
            }
        }
        for modality in features.mm_hashes.keys() {
            if !features.mm_placeholders.contains_key(modality) {
                return Err(format!("features.mm_placeholders has no {modality}"));
            }
        }
        items.sort_by_key(|item| item.offset);
        let mut end = 0;
        for item in &items {
            if item.offset < end {
                return Err("features: overlapping placeholders".to_owned());
            }
            end = item.offset.saturating_add(item.length);
            if end > prompt_len {
                return Err(format!(
                    "features: a placeholder ends at token {end}, past the prompt's {prompt_len}"
                ));
            }
        }
        Ok((!items.is_empty()).then(|| Self {
            items: items.into(),
        }))
    }

    /// The items, in vLLM's order.
    pub fn items(&self) -> &[PlacedItem] {
        &self.items
    }

    /// The items as block-keys takes them.
    pub fn block_key_items(&self) -> Vec<MultiModalItem<'_>> {
        self.items
            .iter()
            .map(|item| MultiModalItem {
                identifier: &item.identifier,
                offset: item.offset,
                length: item.length,
            })
            .collect()
    }

    /// Bytes the items account for in the token cache.
    pub fn cache_bytes(&self) -> usize {
        self.items
            .iter()
            .map(|item| std::mem::size_of::<PlacedItem>() + item.identifier.len())
            .sum()
    }
}

/// The block keys of a prompt's media items, as [`kvroute_block_keys::KeyScheme`] takes them
/// (none for a text prompt).
pub fn block_key_items(places: Option<&MultiModalPlaces>) -> Vec<MultiModalItem<'_>> {
    places.map_or_else(Vec::new, MultiModalPlaces::block_key_items)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(features: &str, prompt_len: usize) -> Result<Option<MultiModalPlaces>, String> {
        let features: RenderedFeatures = serde_json::from_str(features).expect("features shape");
        MultiModalPlaces::from_features(&features, prompt_len)
    }

    fn item(identifier: &str, offset: usize, length: usize) -> PlacedItem {
        PlacedItem {
            identifier: identifier.into(),
            offset,
            length,
        }
    }

    #[test]
    fn items_are_ordered_by_offset_across_modalities() {
        // vLLM answers per modality; the engine hashes them in prompt order.
        let places = parse(
            r#"{"mm_hashes": {"video": ["v0"], "image": ["i0", "i1"]},
                "mm_placeholders": {"video": [{"offset": 40, "length": 10}],
                                    "image": [{"offset": 70, "length": 5}, {"offset": 3, "length": 30}]},
                "kwargs_data": null, "mm_metadata": null}"#,
            100,
        )
        .expect("well-formed")
        .expect("items");
        assert_eq!(
            places.items(),
            [item("i1", 3, 30), item("v0", 40, 10), item("i0", 70, 5)]
        );
        let keyed = places.block_key_items();
        assert_eq!(
            keyed.iter().map(|i| i.identifier).collect::<Vec<_>>(),
            ["i1", "v0", "i0"]
        );
    }

    #[test]
    fn no_items_is_none() {
        assert_eq!(
            parse(r#"{"mm_hashes": {}, "mm_placeholders": {}}"#, 10),
            Ok(None)
        );
        assert_eq!(
            parse(
                r#"{"mm_hashes": {"image": []}, "mm_placeholders": {"image": []}}"#,
                10
            ),
            Ok(None)
        );
    }

    #[test]
    fn malformed_features_are_refused_with_a_reason() {
        for (features, why) in [
            (
                r#"{"mm_hashes": {"image": ["a", "b"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 4}]}}"#,
                "2 image hashes for 1 placeholders",
            ),
            (
                r#"{"mm_hashes": {}, "mm_placeholders": {"image": [{"offset": 0, "length": 4}]}}"#,
                "no image",
            ),
            (
                r#"{"mm_hashes": {"image": ["a"]}, "mm_placeholders": {}}"#,
                "mm_placeholders has no image",
            ),
            (
                r#"{"mm_hashes": {"image": [7]}, "mm_placeholders": {"image": [{"offset": 0, "length": 4}]}}"#,
                "not a string",
            ),
            (
                r#"{"mm_hashes": {"image": ["a"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 0}]}}"#,
                "empty",
            ),
            (
                r#"{"mm_hashes": {"image": ["a"]}, "mm_placeholders": {"image": [{"offset": 8, "length": 4}]}}"#,
                "past the prompt",
            ),
            (
                r#"{"mm_hashes": {"image": ["a", "b"]}, "mm_placeholders": {"image": [{"offset": 0, "length": 4}, {"offset": 3, "length": 2}]}}"#,
                "overlapping",
            ),
            (
                r#"{"mm_hashes": {"image": ["a"]}, "mm_placeholders": {"image": [{"offset": -1, "length": 4}]}}"#,
                "mm_placeholders.image",
            ),
            (
                r#"{"mm_hashes": {"image": "a"}, "mm_placeholders": {"image": [{"offset": 0, "length": 4}]}}"#,
                "not a list",
            ),
        ] {
            let error = parse(features, 10).expect_err(features);
            assert!(error.contains(why), "{error:?} should say {why:?}");
        }
    }
}
