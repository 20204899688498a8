//! Text in, text out: the checkpoint's own tokenizer (`tokenizer.json`, through the `tokenizers`
//! crate) and chat template (`chat_template.jinja` or `tokenizer_config.json`, rendered as
//! transformers renders it), streaming decode that never splits a UTF-8 character across
//! deltas, and the reply split into reasoning, content and tool calls.

mod chat;
mod python;
mod reply;
mod sanitize;

use std::collections::HashSet;
use std::path::Path;
use std::sync::OnceLock;

use sanitize::Sanitizer;

pub use chat::{
    ChatMessage, ChatRequest, ChatTemplate, Content, ContentPart, FunctionCall, SpecialTokens, ToolCall,
    MAX_RENDER_BYTES, MAX_TEMPLATE_BYTES,
};
pub use reply::{ChatDelta, ChatReply, ReplyParser};

/// Errors of the text layer.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A tokenizer file is missing or unreadable.
    #[error("cannot read {path}: {message}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        message: String,
    },
    /// The tokenizer rejected a file or an input.
    #[error("tokenizer error ({during}): {message}")]
    Tokenizer {
        /// What was being done.
        during: &'static str,
        /// The library's message.
        message: String,
    },
    /// The chat template failed to parse or render.
    #[error("chat template error: {0}")]
    Template(String),
    /// A chat request the template cannot take (no messages, a reserved variable, a tool that is
    /// not an object, `continue_final_message` with nothing to continue, …).
    #[error("chat request: {0}")]
    BadRequest(String),
    /// Input this text model cannot take (image, video or audio content).
    #[error("not supported: {feature}")]
    Unsupported {
        /// What was asked for.
        feature: String,
    },
    /// The directory has no chat template.
    #[error("no chat template in {0} (neither chat_template.jinja nor tokenizer_config.json's chat_template)")]
    NoTemplate(std::path::PathBuf),
}

/// The largest `tokenizer.json` read (Qwen's is 11 MB).
pub const MAX_TOKENIZER_BYTES: u64 = 64 << 20;

/// The most named chat templates read from `tokenizer_config.json` (each is compiled once at
/// load; checkpoints name one to three: `default`, `tool_use`, `rag`).
pub const MAX_NAMED_TEMPLATES: usize = 64;

/// A tokenizer with its special tokens and (optional) chat template.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// The named chat templates (`default` first when the directory has one file).
    templates: Vec<(String, ChatTemplate)>,
    special: SpecialTokens,
    eos_token: Option<String>,
    /// `tokenizer_config.json`'s `chat_control_tokens`: the added tokens besides the special ones
    /// that `sanitize_control_tokens` encodes as text (by default, those the template writes).
    chat_control_tokens: Option<Vec<String>>,
    /// Tokens the configuration makes special besides `tokenizer.json`'s flags, as transformers
    /// does: the named special tokens, `extra_special_tokens`' named ones and
    /// `added_tokens_decoder`'s entries marked special.
    config_special: HashSet<String>,
    /// Per template (in `templates`' order), what sanitizing needs, built on first use.
    sanitizers: Vec<OnceLock<Result<Sanitizer, String>>>,
}

/// A chat request rendered and encoded (see [`TextTokenizer::encode_chat`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ChatPrompt {
    /// The rendered prompt.
    pub text: String,
    /// Its token ids.
    pub ids: Vec<u32>,
    /// With sanitized control tokens, the prompt as the reply parser reads it: each control
    /// token a user wrote (text to the model) replaced by U+FFFC, so that a `<think>` typed at
    /// the end of a continued message does not open the reply's reasoning.
    parser_view: Option<String>,
}

impl ChatPrompt {
    /// The parser of the reply generated after this prompt (see [`ReplyParser::new`]).
    pub fn reply_parser(&self, tools: Option<&[serde_json::Value]>) -> ReplyParser {
        ReplyParser::new(self.parser_view.as_deref().unwrap_or(&self.text), tools)
    }
}

fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(String::from),
        _ => None,
    }
}

impl TextTokenizer {
    /// Load `tokenizer.json` and, if present, `tokenizer_config.json` / `chat_template.jinja`
    /// from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let read = |name: &str, limit: u64| -> Result<Option<String>, TextError> {
            let path = dir.join(name);
            if !path.exists() {
                return Ok(None);
            }
            crate::io::read_bounded_text(&path, limit, name)
                .map(Some)
                .map_err(|e| TextError::Io { path: path.clone(), message: e.to_string() })
        };
        let path = dir.join("tokenizer.json");
        let json = read("tokenizer.json", MAX_TOKENIZER_BYTES)?
            .ok_or_else(|| TextError::Io { path: path.clone(), message: "no such file".into() })?;
        screen_stages(&json)?;
        let mut inner = tokenizers::Tokenizer::from_bytes(json.as_bytes())
            .map_err(|e| TextError::Tokenizer { during: "loading tokenizer.json", message: e.to_string() })?;
        // Prompts are encoded whole, as transformers' chat path does. A file's truncation or
        // padding would cut them silently, and tokenizers panics or allocates what they say
        // (a stride not below max_length, a fixed padding of 10^12).
        inner
            .with_truncation(None)
            .map_err(|e| TextError::Tokenizer { during: "loading tokenizer.json", message: e.to_string() })?;
        inner.with_padding(None);
        if let Some(d) = inner.get_decoder() {
            check_decoder(d)?;
        }
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match read("tokenizer_config.json", crate::io::MAX_JSON_BYTES)? {
            Some(text) => serde_json::from_str(&text)
                .map_err(|e| TextError::Io { path: config_path.clone(), message: e.to_string() })?,
            None => serde_json::Value::Null,
        };
        // transformers: `chat_template.jinja` is the default template; a list in
        // tokenizer_config.json names several (`default`, `tool_use`, …).
        let mut templates = Vec::new();
        if let Some(text) = read("chat_template.jinja", MAX_TEMPLATE_BYTES as u64)? {
            templates.push(("default".to_string(), ChatTemplate::new(text)?));
        } else {
            match config.get("chat_template") {
                Some(serde_json::Value::String(s)) => templates.push(("default".into(), ChatTemplate::new(s.clone())?)),
                Some(serde_json::Value::Array(list)) => {
                    if list.len() > MAX_NAMED_TEMPLATES {
                        return Err(TextError::Template(format!(
                            "tokenizer_config.json chat_template: expected at most {MAX_NAMED_TEMPLATES} named templates, found {}",
                            list.len()
                        )));
                    }
                    for t in list {
                        let name = t.get("name").and_then(|n| n.as_str());
                        let source = t.get("template").and_then(|t| t.as_str());
                        if let (Some(name), Some(source)) = (name, source) {
                            templates.push((name.to_string(), ChatTemplate::new(source.to_string())?));
                        }
                    }
                }
                _ => {}
            }
        }
        // The legacy special_tokens_map.json fills what tokenizer_config.json leaves out.
        let legacy = match read("special_tokens_map.json", crate::io::MAX_JSON_BYTES)? {
            Some(text) => serde_json::from_str(&text)
                .map_err(|e| TextError::Io { path: dir.join("special_tokens_map.json"), message: e.to_string() })?,
            None => serde_json::Value::Null,
        };
        let mut special = SpecialTokens(
            ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]
                .iter()
                .filter_map(|name| {
                    token_string(config.get(*name))
                        .or_else(|| token_string(legacy.get(*name)))
                        .map(|t| (name.to_string(), t))
                })
                .collect(),
        );
        // Named extra special tokens (`{"image_token": "<|image_pad|>"}`) are in transformers'
        // special_tokens_map too, so templates see them.
        if let Some(serde_json::Value::Object(named)) = config.get("extra_special_tokens") {
            for (name, token) in named {
                if let (Some(token), false) = (token_string(Some(token)), special.0.iter().any(|(n, _)| n == name)) {
                    special.0.push((name.clone(), token));
                }
            }
        }
        // transformers requires a list and compares its entries with the tokens' text (other
        // entries match nothing).
        let chat_control_tokens = match config.get("chat_control_tokens") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Array(list)) => {
                Some(list.iter().filter_map(|t| t.as_str().map(String::from)).collect())
            }
            Some(other) => {
                return Err(TextError::Io {
                    path: config_path,
                    message: format!("chat_control_tokens: expected a list, found {other}"),
                })
            }
        };
        let mut config_special: HashSet<String> = special.0.iter().map(|(_, t)| t.clone()).collect();
        if let Some(serde_json::Value::Object(decoder)) = config.get("added_tokens_decoder") {
            let marked = decoder.values().filter(|t| t.get("special").and_then(|v| v.as_bool()) == Some(true));
            config_special.extend(marked.filter_map(|t| token_string(Some(t))));
        }
        let sanitizers = templates.iter().map(|_| OnceLock::new()).collect();
        Ok(Self {
            inner,
            templates,
            eos_token: token_string(config.get("eos_token")),
            special,
            chat_control_tokens,
            config_special,
            sanitizers,
        })
    }

    /// Token ids of `text` (special tokens written in the text, like `<|im_start|>`, become their
    /// ids; the post-processor's own additions are applied as transformers does by default).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.encode_with(text, true)
    }

    /// Token ids of a rendered chat prompt: as transformers' `apply_chat_template` tokenizes,
    /// without the post-processor's additions (the template writes any BOS itself).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.encode_with(text, false)
    }

    fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| TextError::Tokenizer { during: "encoding", message: e.to_string() })?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TextError> {
        self.inner.decode(ids, true).map_err(|e| TextError::Tokenizer { during: "decoding", message: e.to_string() })
    }

    /// The id of a token string (e.g. `"<|im_end|>"`).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The chat template a request uses, as transformers picks it: `tool_use` when the request
    /// has tools and the checkpoint names one, else `default`, else the only one.
    pub fn chat_template_for(&self, request: &ChatRequest) -> Result<&ChatTemplate, TextError> {
        Ok(&self.templates[self.template_index(request)?].1)
    }

    fn template_index(&self, request: &ChatRequest) -> Result<usize, TextError> {
        let named = |name: &str| self.templates.iter().position(|(n, _)| n == name);
        let tool_use = request.tools.is_some().then(|| named("tool_use")).flatten();
        let single = (self.templates.len() == 1).then_some(0);
        tool_use
            .or_else(|| named("default"))
            .or(single)
            .ok_or_else(|| TextError::NoTemplate(Path::new("<model>").to_path_buf()))
    }

    /// What sanitizing with template `index` needs (see [`TextTokenizer::encode_chat`]).
    fn sanitizer(&self, index: usize) -> Result<&Sanitizer, TextError> {
        let built = self.sanitizers[index].get_or_init(|| {
            let template = &self.templates[index].1;
            let mut added: Vec<(u32, String, bool)> =
                self.inner.get_added_tokens_decoder().into_iter().map(|(id, t)| (id, t.content, t.special)).collect();
            added.sort_by_key(|(id, _, _)| *id);
            let contents: Vec<&str> = added.iter().map(|(_, c, _)| c.as_str()).collect();
            let literal = sanitize::occurring(&contents, &template.literal_text().map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
            let control: Vec<&str> = added
                .iter()
                .enumerate()
                .filter(|(i, (_, content, special))| {
                    *special
                        || self.config_special.contains(content)
                        || match &self.chat_control_tokens {
                            Some(listed) => listed.contains(content),
                            None => !python::py_isspace_str(content) && literal.contains(i),
                        }
                })
                .map(|(_, (_, content, _))| content.as_str())
                .collect();
            Sanitizer::new(&control, &contents).map_err(|e| e.to_string())
        });
        built
            .as_ref()
            .map_err(|message| TextError::Tokenizer { during: "sanitize_control_tokens", message: message.clone() })
    }

    /// The default chat template, if the checkpoint has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template_for(&ChatRequest::new(Vec::new())).ok()
    }

    /// The special tokens the chat template sees (`bos_token`, `eos_token`, …).
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The EOS token string of `tokenizer_config.json`, if any.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Render `messages` with the checkpoint's chat template (with the generation prompt, no
    /// tools, no template variables).
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String, TextError> {
        self.render_chat(&ChatRequest::new(messages.to_vec()))
    }

    /// Render a chat request (tools, template variables such as `enable_thinking`,
    /// `continue_final_message`) with the checkpoint's chat template.
    pub fn render_chat(&self, request: &ChatRequest) -> Result<String, TextError> {
        self.chat_template_for(request)?.render_request(request, &self.special)
    }

    /// Render `request` and encode it as transformers' `apply_chat_template(..., tokenize=True)`.
    ///
    /// With [`ChatRequest::sanitize_control_tokens`] set, the control tokens in the request's
    /// strings are encoded as the text they are, as transformers'
    /// `sanitize_control_tokens=True`: a user who writes `<|im_end|>` cannot end the turn. The
    /// control tokens are the special added tokens (special in `tokenizer.json`, named as a
    /// special token or marked special in `tokenizer_config.json`) and, unless
    /// `tokenizer_config.json` lists `chat_control_tokens`, the other added tokens the template
    /// writes literally (Qwen's `<think>`, `<tool_call>`, …); the rest of the added vocabulary
    /// stays as it is. What this needs of the template is built on its first sanitized request.
    /// The prompt text returned is the render without the markers: it can differ from the
    /// render without the option where the template trims or splits a string that held a
    /// control token.
    pub fn encode_chat(&self, request: &ChatRequest) -> Result<ChatPrompt, TextError> {
        let index = self.template_index(request)?;
        let template = &self.templates[index].1;
        if !request.sanitize_control_tokens {
            let text = template.render_request(request, &self.special)?;
            let ids = self.encode_prompt(&text)?;
            return Ok(ChatPrompt { text, ids, parser_view: None });
        }
        let sanitizer = self.sanitizer(index)?;
        sanitizer.prompt(self, &template.render_marked(request, &self.special, Some(sanitizer))?)
    }

    /// A streaming decoder: feed ids one at a time, get text deltas that never end inside a
    /// UTF-8 character.
    pub fn stream(&self) -> TextStream<'_> {
        TextStream { tokenizer: self, ids: Vec::new(), prefix: String::new(), prefix_index: 0 }
    }
}

/// Incremental decoding of generated ids (see [`TextTokenizer::stream`]).
pub struct TextStream<'a> {
    tokenizer: &'a TextTokenizer,
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

impl TextStream<'_> {
    /// Add one id; returns the new text, or `None` while a character is incomplete (or the id
    /// is a skipped special token).
    pub fn step(&mut self, id: u32) -> Result<Option<String>, TextError> {
        tokenizers::tokenizer::step_decode_stream(
            &self.tokenizer.inner,
            vec![id],
            true,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| TextError::Tokenizer { during: "stream decoding", message: e.to_string() })
    }

    /// The generation ended: the text `step` held back (bytes of a character that never
    /// completed, decoded as U+FFFD, or a final U+FFFD of the text itself), so that the deltas
    /// add up to what decoding all the ids at once gives.
    pub fn finish(&self) -> Result<Option<String>, TextError> {
        let text = self
            .tokenizer
            .inner
            .decode(&self.ids, true)
            .map_err(|e| TextError::Tokenizer { during: "stream decoding", message: e.to_string() })?;
        Ok(text.strip_prefix(self.prefix.as_str()).filter(|rest| !rest.is_empty()).map(str::to_string))
    }
}

/// The stages of tokenizer.json screened before tokenizers reads the file.
#[derive(serde::Deserialize)]
struct Stages {
    #[serde(default)]
    normalizer: serde_json::Value,
    #[serde(default)]
    pre_tokenizer: serde_json::Value,
    /// Read only to be parsed: tokenizers `expect`s its decoder field to parse as JSON (a number
    /// out of f64's range, a lone surrogate or nesting past serde_json's depth limit there
    /// panics), and a `Value` parses it the same way.
    #[serde(default, rename = "decoder")]
    _decoder: serde_json::Value,
}

/// Refuse what tokenizers panics on, before it reads the file: a `decoder` field that does not
/// parse as JSON, a `Precompiled` normalizer (its loader `expect`s a well-formed charsmap,
/// and an empty or inconsistent one indexes out of bounds on the first encode; Qwen's tokenizers
/// normalize by NFC) and a pre-tokenizer `length` of 0 (`FixedLength` splits with `chunks(0)`).
/// Untagged stages are screened by their fields, at any depth of a `Sequence`.
fn screen_stages(json: &str) -> Result<(), TextError> {
    let refuse = |message: String| TextError::Tokenizer { during: "loading tokenizer.json", message };
    let stages: Stages = serde_json::from_str(json).map_err(|e| refuse(e.to_string()))?;
    fn objects<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Map<String, serde_json::Value>>) {
        match v {
            serde_json::Value::Object(o) => {
                out.push(o);
                o.values().for_each(|v| objects(v, out));
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| objects(v, out)),
            _ => {}
        }
    }
    let mut found = Vec::new();
    objects(&stages.normalizer, &mut found);
    if found.iter().any(|o| o.contains_key("precompiled_charsmap") || o.get("type") == Some(&"Precompiled".into())) {
        return Err(refuse(
            "normalizer: expected none of type Precompiled, found one (tokenizers panics on a malformed charsmap)"
                .into(),
        ));
    }
    found.clear();
    objects(&stages.pre_tokenizer, &mut found);
    if let Some(len) = found.iter().filter_map(|o| o.get("length")).find(|l| l.as_u64().is_none_or(|l| l == 0)) {
        return Err(refuse(format!(
            "pre_tokenizer length: expected a positive integer, found {len} (tokenizers splits by it)"
        )));
    }
    Ok(())
}

/// Refuse decoders tokenizers panics in: `Strip` with `stop` > 0 slices out of range on a token
/// made only of its character.
fn check_decoder(d: &tokenizers::DecoderWrapper) -> Result<(), TextError> {
    match d {
        tokenizers::DecoderWrapper::Strip(s) if s.stop > 0 => Err(TextError::Tokenizer {
            during: "loading tokenizer.json",
            message: format!(
                "decoder Strip: expected stop 0, found {} (tokenizers panics on a token made only of {:?})",
                s.stop, s.content
            ),
        }),
        tokenizers::DecoderWrapper::Sequence(seq) => seq.get_decoders().iter().try_for_each(check_decoder),
        _ => Ok(()),
    }
}
