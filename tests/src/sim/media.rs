//! The simulator's multimodal processor: images in chat, Responses and Messages requests become
//! runs of one image token, as a vLLM model's processor expands its image placeholder, and each
//! image gets vLLM's item identifier shape.
//!
//! The processor (deterministic, documented here because nothing else defines it):
//! - An image is a chat `image_url` part (`{"image_url": {"url": …}}` or a bare string, with or
//!   without `"type"`), a Responses `input_image` part (`image_url`), or a Messages `image` block
//!   (`source` `{"type": "base64", "data"}` or `{"type": "url", "url"}`). Its *payload* is the
//!   base64 text of a `data:` URL or of a base64 source, else the URL: the same picture sent as a
//!   data URL or as Anthropic base64 is the same payload.
//! - The image token is the model's first added token of `<|image_pad|>`, `<image>`, `<pad>`
//!   (the tiny test model's `<pad>`). Each image part is replaced by a text part holding that
//!   token, the prompt is rendered and tokenized as text, and each image token in the result is
//!   expanded to `IMAGE_BASE_TOKENS + digest[0] % IMAGE_TOKEN_SPREAD` copies of itself
//!   (48–79), `digest` being SHA-256 of the payload: the run's length is a function of the image.
//!   The rendered prompt must hold exactly one image token per image (400 otherwise).
//! - The identifier is the lowercase hex SHA-256 of the model name, a zero byte and the payload
//!   (64 hex digits, the shape of vLLM's default blake3 `mm_hash`), or the part's `uuid`
//!   verbatim (vLLM's `multi_modal_uuids`, used as is when no processor options apply).
//! - Other media (audio, video, embeddings) are refused with 400.

use kvroute_tokenize::ModelTokenizer;
use serde_json::{Value, json};
use sha2::{Digest as _, Sha256};

/// The shortest image run.
const IMAGE_BASE_TOKENS: usize = 48;
/// Image runs are `IMAGE_BASE_TOKENS` plus less than this many tokens.
const IMAGE_TOKEN_SPREAD: usize = 32;

/// Candidate image tokens, most specific first.
const IMAGE_TOKEN_TEXTS: [&str; 3] = ["<|image_pad|>", "<image>", "<pad>"];

/// Media part types the processor refuses (vLLM's other modalities).
const OTHER_MEDIA: [&str; 8] = [
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "image_pil",
    "audio_url",
    "input_audio",
    "video_url",
];

/// One image of a prompt, placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PlacedImage {
    /// vLLM's `identifier`.
    pub(crate) identifier: String,
    /// Its first prompt token.
    pub(crate) offset: usize,
    /// Its tokens.
    pub(crate) length: usize,
}

/// An image found in a request, before rendering.
#[derive(Debug, Clone)]
struct FoundImage {
    identifier: String,
    length: usize,
}

/// The processor for one model.
#[derive(Debug, Clone)]
pub(crate) struct ImageProcessor {
    model_name: String,
    /// The image token's text and id (`None`: the model has none; images are refused).
    token: Option<(&'static str, u32)>,
}

/// What a request's images did to it.
#[derive(Debug)]
pub(crate) struct WithImages<T> {
    /// The request with every image replaced by its token.
    pub(crate) request: T,
    images: Vec<FoundImage>,
}

impl ImageProcessor {
    /// The processor of `tokenizer`'s model served as `model_name`.
    pub(crate) fn new(tokenizer: &ModelTokenizer, model_name: &str) -> Self {
        let token = IMAGE_TOKEN_TEXTS.iter().find_map(|&text| {
            match tokenizer.encode_prompt(text, false).ok()?.as_slice() {
                [id] if tokenizer.id_to_token(*id).as_deref() == Some(text) => Some((text, *id)),
                _ => None,
            }
        });
        Self {
            model_name: model_name.to_owned(),
            token,
        }
    }

    /// A chat request's `messages` with its images replaced.
    pub(crate) fn chat(&self, messages: &Value) -> Result<WithImages<Value>, String> {
        let mut messages = messages.clone();
        let mut images = Vec::new();
        for message in messages.as_array_mut().into_iter().flatten() {
            let parts = message
                .get_mut("content")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten();
            for part in parts {
                let Some(object) = part.as_object() else {
                    continue;
                };
                let kind = object.get("type").and_then(Value::as_str);
                if let Some(other) = OTHER_MEDIA
                    .iter()
                    .find(|m| kind == Some(**m) || (kind.is_none() && object.contains_key(**m)))
                {
                    return Err(format!(
                        "the simulator's processor takes images only, not {other}"
                    ));
                }
                let is_image = matches!(kind, Some("image_url"))
                    || ((kind.is_none() || object.contains_key("uuid"))
                        && object.contains_key("image_url"));
                if !is_image {
                    continue;
                }
                let url = match object.get("image_url") {
                    Some(Value::String(url)) => url.as_str(),
                    Some(Value::Object(inner)) => {
                        inner.get("url").and_then(Value::as_str).unwrap_or("")
                    }
                    _ => "",
                };
                images.push(self.image(url_payload(url), object.get("uuid"))?);
                *part = json!({"type": "text", "text": self.token_text()?});
            }
        }
        Ok(WithImages {
            request: messages,
            images,
        })
    }

    /// A Responses request with its `input_image` parts replaced.
    pub(crate) fn responses(
        &self,
        request: &serde_json::Map<String, Value>,
    ) -> Result<WithImages<serde_json::Map<String, Value>>, String> {
        let mut request = request.clone();
        let mut images = Vec::new();
        let items = request
            .get_mut("input")
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten();
        for item in items {
            let parts = item
                .get_mut("content")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten();
            for part in parts {
                if part.get("type").and_then(Value::as_str) != Some("input_image") {
                    continue;
                }
                let url = part.get("image_url").and_then(Value::as_str).unwrap_or("");
                images.push(self.image(url_payload(url), part.get("uuid"))?);
                *part = json!({"type": "input_text", "text": self.token_text()?});
            }
        }
        Ok(WithImages { request, images })
    }

    /// A Messages request with its `image` blocks replaced.
    pub(crate) fn messages(
        &self,
        request: &serde_json::Map<String, Value>,
    ) -> Result<WithImages<serde_json::Map<String, Value>>, String> {
        let mut request = request.clone();
        let mut images = Vec::new();
        let messages = request
            .get_mut("messages")
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten();
        for message in messages {
            let blocks = message
                .get_mut("content")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten();
            for block in blocks {
                if block.get("type").and_then(Value::as_str) != Some("image") {
                    continue;
                }
                let source = block.get("source");
                let field = |key| source.and_then(|s| s.get(key)).and_then(Value::as_str);
                let payload = match field("type") {
                    Some("base64") => field("data").unwrap_or(""),
                    _ => field("url").map_or("", url_payload),
                };
                images.push(self.image(payload, None)?);
                *block = json!({"type": "text", "text": self.token_text()?});
            }
        }
        Ok(WithImages { request, images })
    }

    fn token_text(&self) -> Result<&'static str, String> {
        self.token
            .map(|(text, _)| text)
            .ok_or_else(|| "the model has no image token".to_owned())
    }

    fn image(&self, payload: &str, uuid: Option<&Value>) -> Result<FoundImage, String> {
        if payload.is_empty() {
            return Err("an image part without an image".to_owned());
        }
        let digest = Sha256::digest(payload.as_bytes());
        let identifier = match uuid {
            None | Some(Value::Null) => {
                let mut hasher = Sha256::new();
                hasher.update(self.model_name.as_bytes());
                hasher.update([0]);
                hasher.update(payload.as_bytes());
                hex::encode(hasher.finalize())
            }
            // vLLM takes `str(uuid)`.
            Some(Value::String(uuid)) => uuid.clone(),
            Some(other) => other.to_string(),
        };
        Ok(FoundImage {
            identifier,
            length: IMAGE_BASE_TOKENS + usize::from(digest[0]) % IMAGE_TOKEN_SPREAD,
        })
    }
}

impl<T> WithImages<T> {
    /// The rendered prompt's tokens with each image token expanded to its image's run, and the
    /// images placed; refused unless the prompt holds one image token per image.
    pub(crate) fn expand(
        &self,
        processor: &ImageProcessor,
        tokens: Vec<u32>,
    ) -> Result<(Vec<u32>, Vec<PlacedImage>), String> {
        if self.images.is_empty() {
            return Ok((tokens, Vec::new()));
        }
        let Some((_, image_token)) = processor.token else {
            return Err("the model has no image token".to_owned());
        };
        let found = tokens.iter().filter(|&&t| t == image_token).count();
        if found != self.images.len() {
            return Err(format!(
                "the rendered prompt holds {found} image tokens for {} images",
                self.images.len()
            ));
        }
        let mut images = self.images.iter();
        let mut expanded = Vec::with_capacity(tokens.len());
        let mut placed = Vec::with_capacity(self.images.len());
        for token in tokens {
            if token != image_token {
                expanded.push(token);
                continue;
            }
            // Counted above: every image token has its image.
            let Some(image) = images.next() else {
                return Err("more image tokens than images".to_owned());
            };
            placed.push(PlacedImage {
                identifier: image.identifier.clone(),
                offset: expanded.len(),
                length: image.length,
            });
            expanded.extend(std::iter::repeat_n(image_token, image.length));
        }
        Ok((expanded, placed))
    }
}

/// The payload of an image URL: a `data:` URL's base64 text, else the URL.
fn url_payload(url: &str) -> &str {
    match url.strip_prefix("data:") {
        Some(rest) => rest.split_once(',').map_or(rest, |(_, data)| data),
        None => url,
    }
}

/// A render answer's `features` for `images` (vLLM's `MultiModalFeatures`): `null` for a text
/// prompt; tensors only when the request did not ask for none (`mm_payload`), and then a stand-in
/// string per item (the simulator processes no pixels).
pub(crate) fn features(images: &[PlacedImage], mm_payload: Option<&str>) -> Value {
    if images.is_empty() {
        return Value::Null;
    }
    let hashes: Vec<&str> = images.iter().map(|i| i.identifier.as_str()).collect();
    let placeholders: Vec<Value> = images
        .iter()
        .map(|i| json!({"offset": i.offset, "length": i.length}))
        .collect();
    let kwargs_data = match mm_payload {
        Some("none") => Value::Null,
        _ => json!({"image": vec!["c2ltdWxhdG9yIHRlbnNvcg=="; images.len()]}),
    };
    json!({"mm_hashes": {"image": hashes}, "mm_placeholders": {"image": placeholders},
        "kwargs_data": kwargs_data, "mm_metadata": null})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn processor() -> ImageProcessor {
        let dir = crate::harness::tiny_model_dir();
        let tokenizer = ModelTokenizer::from_dir(dir).expect("tiny model");
        ImageProcessor::new(&tokenizer, "tiny")
    }

    #[test]
    fn the_tiny_model_has_an_image_token() {
        assert_eq!(processor().token, Some(("<pad>", 2)));
    }

    #[test]
    fn images_expand_to_runs_with_identifiers() {
        let processor = processor();
        let messages = json!([{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
            {"type": "image_url", "image_url": {"url": "http://x/cat.png"}, "uuid": "cat-1"}]}]);
        let with = processor.chat(&messages).expect("images");
        assert_eq!(with.images.len(), 2);
        let (tokens, placed) = with
            .expand(&processor, vec![9, 2, 8, 2, 7])
            .expect("expanded");
        assert_eq!(placed[0].offset, 1);
        assert_eq!(placed[1].offset, 2 + placed[0].length);
        assert_eq!(placed[1].identifier, "cat-1");
        assert_eq!(placed[0].identifier.len(), 64);
        assert!(
            (IMAGE_BASE_TOKENS..IMAGE_BASE_TOKENS + IMAGE_TOKEN_SPREAD).contains(&placed[0].length)
        );
        assert_eq!(tokens.len(), 3 + placed[0].length + placed[1].length);
        // The same picture as Anthropic base64 is the same image.
        let request = json!({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}]}]});
        let anthropic = processor
            .messages(request.as_object().expect("object"))
            .expect("image");
        assert_eq!(anthropic.images[0].identifier, with.images[0].identifier);
        assert!(with.expand(&processor, vec![9, 2]).is_err());
        let audio = json!([{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "x"}}]}]);
        assert!(processor.chat(&audio).is_err());
    }
}
