//! vLLM's per-block extra keys (LoRA adapter, images, cache salt), in the shape of each vLLM era.

use crate::{HashValue, KeyError};

/// Which vLLM releases' extra-key shapes to reproduce. Order inside a block's key tuple is always
/// LoRA, then cache salt; LoRA goes on every block, the salt on the first block only.
///
/// | era | LoRA item | salt item |
/// |---|---|---|
/// | `UpTo0_11_0` (0.9.0-0.11.0) | `lora_int_id` | `salt` |
/// | `V0_11_1To0_30` (0.11.1-0.30.x) | `lora_name` | `salt` |
/// | `From0_31` (0.31.0+) | `("lora", lora_name, lora_path)` | `("cache_salt", salt)` |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ExtraKeysEra {
    /// vLLM 0.9.0 through 0.11.0: the LoRA integer id.
    UpTo0_11_0,
    /// vLLM 0.11.1 through 0.30.x: the LoRA name.
    V0_11_1To0_30,
    /// vLLM 0.31.0 and later: tagged tuples.
    From0_31,
}

/// The LoRA adapter of a request, as vLLM's `LoRARequest` knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoraRef<'a> {
    /// `lora_int_id` (needed for [`ExtraKeysEra::UpTo0_11_0`]).
    pub id: Option<i64>,
    /// `lora_name`.
    pub name: &'a str,
    /// `lora_path` (needed for [`ExtraKeysEra::From0_31`]).
    pub path: Option<&'a str>,
}

impl ExtraKeysEra {
    /// The era a vLLM release belongs to, from its version string (`"0.11.1"`, `"0.32.0rc1"`).
    pub fn for_vllm_version(version: &str) -> Result<Self, KeyError> {
        let bad = || KeyError::BadVllmVersion {
            version: version.to_owned(),
        };
        let mut parts = version.trim_start_matches('v').split('.');
        let mut number = || -> Result<u32, KeyError> {
            let part = parts.next().ok_or_else(bad)?;
            let digits = part
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(part.len());
            part[..digits].parse().map_err(|_| bad())
        };
        let (major, minor) = (number()?, number()?);
        let patch = number().unwrap_or(0);
        Ok(match (major, minor, patch) {
            (0, ..=10, _) | (0, 11, 0) => Self::UpTo0_11_0,
            (0, 11..=30, _) => Self::V0_11_1To0_30,
            _ => Self::From0_31,
        })
    }

    /// The extra keys vLLM hashes into block `block_index` (0 = the prompt's first block), or
    /// `None` when there are none. An empty `cache_salt` counts as none, as in vLLM.
    pub fn block_extra_keys(
        self,
        lora: Option<&LoraRef<'_>>,
        cache_salt: Option<&str>,
        block_index: usize,
    ) -> Result<Option<HashValue>, KeyError> {
        let salt = cache_salt.filter(|s| !s.is_empty() && block_index == 0);
        let mut items = Vec::with_capacity(2);
        if let Some(lora) = lora {
            items.push(self.lora_item(lora)?);
        }
        if let Some(salt) = salt {
            items.push(self.salt_item(salt));
        }
        Ok((!items.is_empty()).then_some(HashValue::Tuple(items)))
    }

    fn lora_item(self, lora: &LoraRef<'_>) -> Result<HashValue, KeyError> {
        let missing = |field| KeyError::LoraFieldMissing { era: self, field };
        Ok(match self {
            Self::UpTo0_11_0 => HashValue::Int(lora.id.ok_or_else(|| missing("id"))?),
            Self::V0_11_1To0_30 => HashValue::Str(lora.name.to_owned()),
            Self::From0_31 => HashValue::Tuple(vec![
                HashValue::Str("lora".to_owned()),
                HashValue::Str(lora.name.to_owned()),
                HashValue::Str(lora.path.ok_or_else(|| missing("path"))?.to_owned()),
            ]),
        })
    }

    fn salt_item(self, salt: &str) -> HashValue {
        match self {
            Self::UpTo0_11_0 | Self::V0_11_1To0_30 => HashValue::Str(salt.to_owned()),
            Self::From0_31 => HashValue::Tuple(vec![
                HashValue::Str("cache_salt".to_owned()),
                HashValue::Str(salt.to_owned()),
            ]),
        }
    }
}

/// An image (or another multimodal item) in a prompt, as vLLM's `MultiModalFeatureSpec` places
/// it: its identifier (vLLM's `mm_hash` of the item and processor settings, or the client's
/// `multi_modal_uuids` value) and the prompt tokens its placeholder spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MultiModalItem<'a> {
    /// `identifier`.
    pub identifier: &'a str,
    /// `mm_position.offset`: the placeholder's first prompt token.
    pub offset: usize,
    /// `mm_position.length`: its tokens.
    pub length: usize,
}

/// A request's extra keys for every block, built once. Without images they only differ between
/// the first block (which carries the cache salt) and the rest; a block an image's placeholder
/// overlaps carries the image too (`per_block`, up to the last such block).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtraKeys {
    first_block: Option<HashValue>,
    later_blocks: Option<HashValue>,
    per_block: Vec<Option<HashValue>>,
}

impl ExtraKeys {
    /// No extra keys (plain text, no LoRA, no salt).
    pub const NONE: Self = Self {
        first_block: None,
        later_blocks: None,
        per_block: Vec::new(),
    };

    /// The extra keys of a request in the given era.
    pub fn new(
        era: ExtraKeysEra,
        lora: Option<&LoraRef<'_>>,
        cache_salt: Option<&str>,
    ) -> Result<Self, KeyError> {
        Ok(Self {
            first_block: era.block_extra_keys(lora, cache_salt, 0)?,
            later_blocks: era.block_extra_keys(lora, cache_salt, 1)?,
            per_block: Vec::new(),
        })
    }

    /// The extra keys of a request with images (`items`, in prompt order as vLLM keeps them) in
    /// blocks of `block_size` tokens, as vLLM 0.31+ builds them
    /// (`generate_block_hash_extra_keys`): per block the LoRA item, then
    /// `("mm", identifier, offset - block start)` for every item whose placeholder overlaps the
    /// block (the offset is negative in the blocks after the item's first), then the salt on the
    /// first block.
    pub fn with_multimodal(
        era: ExtraKeysEra,
        lora: Option<&LoraRef<'_>>,
        cache_salt: Option<&str>,
        items: &[MultiModalItem<'_>],
        block_size: usize,
    ) -> Result<Self, KeyError> {
        let mut keys = Self::new(era, lora, cache_salt)?;
        if items.is_empty() {
            return Ok(keys);
        }
        if era != ExtraKeysEra::From0_31 {
            return Err(KeyError::MultiModalEra { era });
        }
        if block_size == 0 {
            return Err(KeyError::ZeroBlockSize);
        }
        let end = items
            .iter()
            .map(|item| item.offset.saturating_add(item.length))
            .max()
            .unwrap_or(0);
        let lora_item = lora.map(|lora| era.lora_item(lora)).transpose()?;
        let salt = cache_salt.filter(|s| !s.is_empty());
        keys.per_block = (0..end.div_ceil(block_size))
            .map(|block| {
                let start = block * block_size;
                let stop = start + block_size;
                let mut block_items: Vec<HashValue> = lora_item.iter().cloned().collect();
                for item in items {
                    if item.offset < stop && item.offset.saturating_add(item.length) > start {
                        block_items.push(HashValue::Tuple(vec![
                            HashValue::Str("mm".to_owned()),
                            HashValue::Str(item.identifier.to_owned()),
                            HashValue::Int(signed(item.offset) - signed(start)),
                        ]));
                    }
                }
                if let (0, Some(salt)) = (block, salt) {
                    block_items.push(era.salt_item(salt));
                }
                (!block_items.is_empty()).then_some(HashValue::Tuple(block_items))
            })
            .collect();
        Ok(keys)
    }

    /// The extra keys of block `block_index`, counted from the prompt's first block.
    pub fn for_block(&self, block_index: usize) -> Option<&HashValue> {
        if let Some(keys) = self.per_block.get(block_index) {
            keys.as_ref()
        } else if block_index == 0 {
            self.first_block.as_ref()
        } else {
            self.later_blocks.as_ref()
        }
    }

    /// Block `block_index`'s extra keys as KV events publish them: vLLM 0.31+ hashes tagged
    /// items but publishes them untagged (`to_event_extra_keys`): a tagged image item
    /// `("mm", identifier, offset)` as `(identifier, offset)`, any other tagged item
    /// (`("lora", name, path)`, `("cache_salt", salt)`) as its second element; older eras' bare
    /// items as they are.
    pub fn published_for_block(&self, block_index: usize) -> Option<HashValue> {
        let untagged = |item: &HashValue| match item {
            HashValue::Tuple(tagged) => match tagged.as_slice() {
                [HashValue::Str(tag), rest @ ..] if tag == "mm" => HashValue::Tuple(rest.to_vec()),
                [_, value, ..] => value.clone(),
                _ => item.clone(),
            },
            bare => bare.clone(),
        };
        self.for_block(block_index).map(|keys| match keys {
            HashValue::Tuple(items) => HashValue::Tuple(items.iter().map(untagged).collect()),
            single => single.clone(),
        })
    }
}

/// A token position as a Python int.
fn signed(position: usize) -> i64 {
    i64::try_from(position).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> HashValue {
        HashValue::Str(v.to_owned())
    }

    #[test]
    fn versions_map_to_eras() {
        for (v, era) in [
            ("0.9.0", ExtraKeysEra::UpTo0_11_0),
            ("0.10.1.1", ExtraKeysEra::UpTo0_11_0),
            ("0.11.0", ExtraKeysEra::UpTo0_11_0),
            ("0.11.1", ExtraKeysEra::V0_11_1To0_30),
            ("v0.30.2", ExtraKeysEra::V0_11_1To0_30),
            ("0.31.0rc1", ExtraKeysEra::From0_31),
            ("0.33", ExtraKeysEra::From0_31),
            ("1.0.0", ExtraKeysEra::From0_31),
        ] {
            assert_eq!(ExtraKeysEra::for_vllm_version(v), Ok(era), "{v}");
        }
        assert!(ExtraKeysEra::for_vllm_version("latest").is_err());
        assert!(ExtraKeysEra::for_vllm_version("0").is_err());
    }

    #[test]
    fn lora_then_salt_on_first_block_only() {
        let lora = LoraRef {
            id: Some(1),
            name: "Alice",
            path: Some("/a"),
        };
        let era = ExtraKeysEra::V0_11_1To0_30;
        let keys = ExtraKeys::new(era, Some(&lora), Some("t")).unwrap();
        assert_eq!(
            keys.for_block(0),
            Some(&HashValue::Tuple(vec![s("Alice"), s("t")]))
        );
        assert_eq!(keys.for_block(5), Some(&HashValue::Tuple(vec![s("Alice")])));
        let salt_only = ExtraKeys::new(era, None, Some("t")).unwrap();
        assert_eq!(salt_only.for_block(1), None);
        assert_eq!(
            ExtraKeys::new(era, None, Some("")).unwrap(),
            ExtraKeys::NONE
        );
    }

    #[test]
    fn published_extra_keys_are_untagged_as_vllm_publishes_them() {
        let lora = LoraRef {
            id: Some(1),
            name: "Alice",
            path: Some("/a"),
        };
        let image = [MultiModalItem {
            identifier: "h",
            offset: 5,
            length: 20,
        }];
        let keys =
            ExtraKeys::with_multimodal(ExtraKeysEra::From0_31, Some(&lora), Some("t"), &image, 16)
                .unwrap();
        let pair = |offset| HashValue::Tuple(vec![s("h"), HashValue::Int(offset)]);
        assert_eq!(
            keys.published_for_block(0),
            Some(HashValue::Tuple(vec![s("Alice"), pair(5), s("t")]))
        );
        assert_eq!(
            keys.published_for_block(1),
            Some(HashValue::Tuple(vec![s("Alice"), pair(-11)]))
        );
        assert_eq!(
            keys.published_for_block(2),
            Some(HashValue::Tuple(vec![s("Alice")]))
        );
        let plain =
            ExtraKeys::with_multimodal(ExtraKeysEra::From0_31, None, None, &image, 16).unwrap();
        assert_eq!(plain.published_for_block(2), None);
        let old = ExtraKeys::new(ExtraKeysEra::V0_11_1To0_30, Some(&lora), Some("t")).unwrap();
        assert_eq!(
            old.published_for_block(0),
            Some(HashValue::Tuple(vec![s("Alice"), s("t")]))
        );
    }

    #[test]
    fn missing_lora_fields_are_errors() {
        let lora = LoraRef {
            id: None,
            name: "Alice",
            path: None,
        };
        for (era, field) in [
            (ExtraKeysEra::UpTo0_11_0, "id"),
            (ExtraKeysEra::From0_31, "path"),
        ] {
            assert_eq!(
                era.block_extra_keys(Some(&lora), None, 0),
                Err(KeyError::LoraFieldMissing { era, field })
            );
        }
    }
}
