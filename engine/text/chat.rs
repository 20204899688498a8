//! Chat templates as transformers renders them (`apply_chat_template` → `render_jinja_template`):
//! Jinja with `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`,
//! `strftime_now`, the `{% generation %}` block, `tojson` as `json.dumps(ensure_ascii=False)`
//! and Python's `str()` for printed values, Python's string methods (minijinja-contrib's
//! pycompat), `tools`/`documents` defined as none when not given, the tokenizer's special
//! tokens and any template variable (`enable_thinking`, …), `continue_final_message`.

use minijinja::value::{Kwargs, Rest, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use super::python::{indent, method, py_str, strftime, tojson, trim};
use super::sanitize::Sanitizer;
use super::TextError;

/// One chat message, as transformers takes it (a dict): `None` fields are left out.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `"system"`, `"user"`, `"assistant"`, `"tool"`.
    pub role: String,
    /// The text, or a list of typed parts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// An assistant message's reasoning (what the model wrote inside `<think>`); also read from
    /// `thinking` or `reasoning`, as transformers does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The tool calls of an assistant message (`None`, or JSON `null`, leaves the key out; an
    /// empty list is passed as one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The tool's or the participant's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Any other field, passed to the template as given.
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

/// A message's content.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Typed parts (`{"type": "text", "text": …}`); image, video and audio parts are refused.
    Parts(Vec<ContentPart>),
}

/// One part of a list-valued content.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContentPart {
    /// `"text"` (or `"image"`, `"image_url"`, `"video"`, … which a text model refuses).
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The text of a text part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    /// Any other field.
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

/// A tool call, as OpenAI's API and transformers' templates write it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, if the caller gave one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `"function"` (left out when the caller left it out).
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// The function and its arguments.
    pub function: FunctionCall,
    /// Any other field (`index`, …), passed to the template as given.
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

/// The function of a [`ToolCall`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// The arguments: a JSON object, as transformers' templates expect (a string, as OpenAI's API
    /// sends it, reaches the template as a string, as in transformers: Qwen 3.5's template
    /// refuses it, Qwen3-VL's prints it verbatim; see [`ChatRequest::parse_tool_arguments`]).
    /// `null` leaves the key out.
    #[serde(default, skip_serializing_if = "Json::is_null")]
    pub arguments: Json,
    /// Any other field.
    #[serde(flatten)]
    pub extra: Map<String, Json>,
}

impl ToolCall {
    /// A call of `name` with `arguments` (a JSON object).
    pub fn new(name: &str, arguments: Json) -> Self {
        Self {
            id: None,
            kind: Some("function".into()),
            function: FunctionCall { name: name.into(), arguments, extra: Map::new() },
            extra: Map::new(),
        }
    }
}

impl ChatMessage {
    /// A message with text content.
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.into(), content: Some(Content::Text(content.into())), ..Default::default() }
    }

    /// An assistant message with reasoning, content and tool calls (what a [`super::ChatReply`]
    /// holds), to put a reply back into the conversation.
    pub fn assistant(reasoning: Option<&str>, content: &str, tool_calls: Vec<ToolCall>) -> Self {
        Self {
            role: "assistant".into(),
            content: Some(Content::Text(content.into())),
            reasoning_content: reasoning.map(String::from),
            tool_calls: (!tool_calls.is_empty()).then_some(tool_calls),
            ..Default::default()
        }
    }

    /// A tool's result.
    pub fn tool(content: &str, tool_call_id: Option<&str>) -> Self {
        Self {
            role: "tool".into(),
            content: Some(Content::Text(content.into())),
            tool_call_id: tool_call_id.map(String::from),
            ..Default::default()
        }
    }
}

/// Everything a chat template renders: `apply_chat_template`'s arguments.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    /// The conversation.
    pub messages: Vec<ChatMessage>,
    /// Tool definitions (JSON schemas, OpenAI's `{"type": "function", "function": {…}}`).
    pub tools: Option<Vec<Json>>,
    /// Documents for retrieval templates (objects).
    pub documents: Option<Vec<Json>>,
    /// End with the header of a new assistant turn (`true` from [`ChatRequest::new`]).
    pub add_generation_prompt: bool,
    /// Leave the final message open so the model continues it: the field to continue
    /// (`"content"`, or `"reasoning_content"`), as transformers' `continue_final_message`.
    pub continue_final_message: Option<String>,
    /// Template variables (`enable_thinking`, `add_vision_id`, …); they override the tokenizer's
    /// special tokens of the same name.
    pub vars: Map<String, Json>,
    /// Encode the control tokens (`<|im_end|>`, `<think>`, …) written in the request's strings as
    /// plain text, as transformers' `sanitize_control_tokens=True` does (off by default, as there):
    /// see [`crate::TextTokenizer::encode_chat`].
    pub sanitize_control_tokens: bool,
}

impl ChatRequest {
    /// `messages` with the generation prompt, no tools, no variables.
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        Self {
            messages,
            tools: None,
            documents: None,
            add_generation_prompt: true,
            continue_final_message: None,
            vars: Map::new(),
            sanitize_control_tokens: false,
        }
    }

    /// Encode control tokens written in the request's strings as text (see
    /// [`ChatRequest::sanitize_control_tokens`]).
    pub fn sanitized(mut self, on: bool) -> Self {
        self.sanitize_control_tokens = on;
        self
    }

    /// Set `enable_thinking` (Qwen 3 / 3.5: `false` ends the prompt with an empty think block).
    pub fn thinking(self, on: bool) -> Self {
        self.var("enable_thinking", Json::Bool(on))
    }

    /// Offer `tools`.
    pub fn with_tools(mut self, tools: Vec<Json>) -> Self {
        self.tools = Some(tools);
        self
    }

    /// Set template variable `name`.
    pub fn var(mut self, name: &str, value: Json) -> Self {
        self.vars.insert(name.into(), value);
        self
    }

    /// Parse tool-call `arguments` given as a string holding a JSON object (OpenAI's API sends
    /// them so) into the object Qwen's templates iterate, as vLLM does before rendering; other
    /// strings stay as they are.
    pub fn parse_tool_arguments(mut self) -> Self {
        for call in self.messages.iter_mut().filter_map(|m| m.tool_calls.as_mut()).flatten() {
            if let Json::String(s) = &call.function.arguments {
                if let Ok(parsed @ Json::Object(_)) = serde_json::from_str::<Json>(s) {
                    call.function.arguments = parsed;
                }
            }
        }
        self
    }

    /// Continue the final message's content instead of starting a new turn.
    pub fn continue_final(mut self) -> Self {
        self.add_generation_prompt = false;
        self.continue_final_message = Some("content".into());
        self
    }
}

/// The tokenizer's named special tokens (`bos_token`, `eos_token`, `unk_token`, `sep_token`,
/// `pad_token`, `cls_token`, `mask_token`, and the names `extra_special_tokens` gives), passed
/// to the template when set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecialTokens(pub Vec<(String, String)>);

/// The names transformers passes itself; a template variable of the same name is refused.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Where a reasoning field may be found, the first being the one templates read.
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// What `render_jinja_template` appends to the continued field.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Instructions one render may run (minijinja fuel): a hostile template cannot spin forever.
/// Qwen 3.5's template spends ~400 per message.
const TEMPLATE_FUEL: u64 = 50_000_000;

/// The largest template source accepted.
pub const MAX_TEMPLATE_BYTES: usize = 1 << 20;

/// The most text one render may write: far past any prompt a context holds (262,144 tokens are
/// a few MB of text), far below what a hostile template's loop would allocate.
pub const MAX_RENDER_BYTES: usize = 64 << 20;

/// The render's output, refusing to grow past [`MAX_RENDER_BYTES`].
#[derive(Default)]
struct BoundedOutput(Vec<u8>);

impl std::io::Write for BoundedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.0.len() + buf.len() > MAX_RENDER_BYTES {
            return Err(std::io::Error::other(format!(
                "the rendered prompt would pass {MAX_RENDER_BYTES} bytes (found at least {})",
                self.0.len() + buf.len()
            )));
        }
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn template_error(e: Error) -> TextError {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    TextError::Template(message)
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

/// transformers' `_get_template_literal_text`: the template data and string constants of
/// `source`, as the lexer that compiles it reads them (comments are not literals).
fn literal_text(source: &str) -> Result<String, TextError> {
    use minijinja::machinery::{tokenize, Token, WhitespaceConfig};
    let whitespace = WhitespaceConfig { keep_trailing_newline: false, lstrip_blocks: true, trim_blocks: true };
    let mut literals: Vec<String> = Vec::new();
    // Adjacent string constants are one constant ('<tool' '_call>'), as Jinja2's parser joins them.
    let mut in_string = false;
    for token in tokenize(source, false, Default::default(), whitespace) {
        let (token, _) = token.map_err(template_error)?;
        let (text, string) = match token {
            Token::TemplateData(s) => (s.to_string(), false),
            Token::Str(s) => (s.to_string(), true),
            Token::String(s) => (s.into_string(), true),
            _ => {
                in_string = false;
                continue;
            }
        };
        match literals.last_mut() {
            Some(last) if string && in_string => last.push_str(&text),
            _ => literals.push(text),
        }
        in_string = string;
    }
    Ok(literals.join("\0"))
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' `AssistantTracker` extension, which
/// only marks the assistant's tokens) become a block with the same whitespace control that
/// renders its body unchanged.
fn without_generation_tags(source: &str) -> String {
    let open = regex::Regex::new(r"\{%([-+]?)\s*generation\s*([-+]?)%\}");
    let close = regex::Regex::new(r"\{%([-+]?)\s*endgeneration\s*([-+]?)%\}");
    match (open, close) {
        (Ok(open), Ok(close)) => {
            let s = open.replace_all(source, "{%${1} if true ${2}%}");
            close.replace_all(&s, "{%${1} endif ${2}%}").into_owned()
        }
        _ => source.to_string(),
    }
}

impl ChatTemplate {
    /// Compile a template source.
    pub fn new(source: String) -> Result<Self, TextError> {
        if source.len() > MAX_TEMPLATE_BYTES {
            return Err(TextError::Template(format!(
                "the template is {} bytes, more than the {MAX_TEMPLATE_BYTES} accepted",
                source.len()
            )));
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(method);
        env.set_formatter(|out, _state, value| {
            out.write_str(&py_str(value)?).map_err(|_| Error::new(ErrorKind::WriteFailure, "writing the output"))
        });
        env.add_filter("tojson", |value: Value, args: Rest<Value>, kwargs: Kwargs| tojson(&value, &args, kwargs));
        env.add_filter("string", |value: Value| py_str(&value));
        env.add_filter(
            "indent",
            |value: Value, width: Option<Value>, first: Option<bool>, blank: Option<bool>, kwargs: Kwargs| {
                indent(&value, width, first, blank, kwargs)
            },
        );
        env.add_filter("trim", |value: Value, chars: Option<String>| trim(&value, chars));
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| -> Result<String, Error> {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0);
            strftime(&format, now)
        });
        env.add_template_owned("chat", without_generation_tags(&source)).map_err(template_error)?;
        Ok(Self { env, source })
    }

    /// The template's literal text (its text outside tags and its string constants), joined by
    /// NUL so that no search matches across two: where transformers looks for the added tokens
    /// that are control tokens. Lexed on demand (sanitizing asks once per template).
    pub(crate) fn literal_text(&self) -> Result<String, TextError> {
        literal_text(&without_generation_tags(&self.source))
    }

    /// Render `messages` with the generation prompt and no variables (see
    /// [`ChatTemplate::render_request`]).
    pub fn render(&self, messages: &[ChatMessage], special: &SpecialTokens) -> Result<String, TextError> {
        self.render_request(&ChatRequest::new(messages.to_vec()), special)
    }

    /// Render a request as `tokenizer.apply_chat_template(messages, tools=…, documents=…,
    /// add_generation_prompt=…, continue_final_message=…, tokenize=False, **vars)` does.
    pub fn render_request(&self, req: &ChatRequest, special: &SpecialTokens) -> Result<String, TextError> {
        self.render_marked(req, special, None)
    }

    /// [`ChatTemplate::render_request`] with every string of the request (message fields, tools,
    /// documents, template variables; not the special tokens) marked by `control` first, as
    /// transformers' `_mark_chat_inputs`.
    pub(crate) fn render_marked(
        &self,
        req: &ChatRequest,
        special: &SpecialTokens,
        control: Option<&Sanitizer>,
    ) -> Result<String, TextError> {
        if req.messages.is_empty() {
            return Err(TextError::BadRequest("the conversation has no messages".into()));
        }
        if req.continue_final_message.is_some() && req.add_generation_prompt {
            return Err(TextError::BadRequest(
                "continue_final_message and add_generation_prompt cannot both be set".into(),
            ));
        }
        if let Some(name) = RESERVED.iter().find(|n| req.vars.contains_key(**n)) {
            return Err(TextError::BadRequest(format!("template variable {name:?} is set by the request itself")));
        }
        for (what, list) in [("tools", &req.tools), ("documents", &req.documents)] {
            if let Some(bad) = list.iter().flatten().find(|t| !t.is_object()) {
                return Err(TextError::BadRequest(format!("each of {what} must be a JSON object, found {bad}")));
            }
        }
        let mut chat = req.messages.iter().map(message_json).collect::<Result<Vec<_>, _>>()?;
        let mut tools = req.tools.clone().map_or(Json::Null, Json::Array);
        let mut documents = req.documents.clone().map_or(Json::Null, Json::Array);
        let mut vars = req.vars.clone();
        if let Some(control) = control {
            chat.iter_mut().chain([&mut tools, &mut documents]).chain(vars.values_mut()).for_each(|v| control.mark(v));
        }
        let continued = match &req.continue_final_message {
            Some(field) => Some(mark_continued(&mut chat, field, &self.source)?),
            None => None,
        };
        let mut ctx = Map::new();
        for (name, token) in &special.0 {
            ctx.insert(name.clone(), Json::String(token.clone()));
        }
        ctx.extend(vars);
        ctx.insert("messages".into(), Json::Array(chat));
        ctx.insert("tools".into(), tools);
        ctx.insert("documents".into(), documents);
        ctx.insert("add_generation_prompt".into(), Json::Bool(req.add_generation_prompt));
        let t = self.env.get_template("chat").map_err(template_error)?;
        let mut out = BoundedOutput::default();
        t.render_captured_to(Value::from_serialize(&ctx), &mut out).map_err(template_error)?;
        let rendered = String::from_utf8(out.0)
            .map_err(|e| TextError::Template(format!("the rendered prompt is not UTF-8: {e}")))?;
        match continued {
            Some(final_message) => cut_at_continue_tag(rendered, &final_message),
            None => Ok(rendered),
        }
    }
}

/// A message as the template sees it: the dict transformers builds (None fields dropped, the
/// reasoning under each of its names); media parts refused.
fn message_json(m: &ChatMessage) -> Result<Json, TextError> {
    if let Some(Content::Parts(parts)) = &m.content {
        for p in parts {
            let media = ["image", "image_url", "video", "video_url", "input_audio", "audio"];
            let kind = p.kind.as_deref().unwrap_or("");
            if media.contains(&kind) || media.iter().any(|k| p.extra.contains_key(*k)) {
                return Err(TextError::Unsupported {
                    feature: format!(
                        "{} content parts (this is a text model)",
                        if kind.is_empty() { "media" } else { kind }
                    ),
                });
            }
        }
    }
    let mut v = serde_json::to_value(m).map_err(|e| TextError::BadRequest(e.to_string()))?;
    let Json::Object(obj) = &mut v else {
        return Err(TextError::BadRequest("a message must be a JSON object".into()));
    };
    obj.retain(|_, value| !value.is_null());
    let reasoning = REASONING_FIELDS.iter().find_map(|f| obj.get(*f).cloned());
    if let Some(r) = reasoning {
        let mut aliased = Map::new();
        aliased.insert("thinking".into(), r.clone());
        for (k, val) in std::mem::take(obj) {
            aliased.insert(k, val);
        }
        aliased.insert("reasoning_content".into(), r);
        *obj = aliased;
    }
    Ok(v)
}

/// transformers' `continue_final_message`: append the tag to the continued field of the final
/// message (the last text part of a list); returns the original text to find again.
fn mark_continued(chat: &mut [Json], field: &str, source: &str) -> Result<String, TextError> {
    let last = chat
        .last_mut()
        .and_then(Json::as_object_mut)
        .ok_or_else(|| TextError::BadRequest("continue_final_message is set but the conversation is empty".into()))?;
    let final_message = last.get(field).cloned().ok_or_else(|| {
        TextError::BadRequest(format!("continue_final_message: the final message has no {field:?} to continue"))
    })?;
    let fields: Vec<String> = if REASONING_FIELDS.contains(&field) {
        REASONING_FIELDS.iter().filter(|f| last.get(**f) == Some(&final_message)).map(|f| f.to_string()).collect()
    } else {
        vec![field.to_string()]
    };
    if !fields.iter().any(|f| source.contains(f.as_str())) {
        return Err(TextError::BadRequest(format!(
            "continue_final_message is set to {field:?} but the chat template does not read that field"
        )));
    }
    match final_message {
        Json::Array(mut parts) => {
            let text = parts
                .iter_mut()
                .rev()
                .find_map(|p| p.get_mut("text"))
                .and_then(|t| t.as_str().map(String::from).map(|s| (t, s)));
            let Some((slot, text)) = text else {
                return Err(TextError::BadRequest(
                    "continue_final_message: the final message has no text part to continue".into(),
                ));
            };
            *slot = Json::String(format!("{text}{CONTINUE_TAG}"));
            last.insert(field.to_string(), Json::Array(parts));
            Ok(text)
        }
        Json::String(text) => {
            for f in &fields {
                last.insert(f.clone(), Json::String(format!("{text}{CONTINUE_TAG}")));
            }
            Ok(text)
        }
        other => Err(TextError::BadRequest(format!("continue_final_message: {field:?} is {other}, not text"))),
    }
}

fn cut_at_continue_tag(rendered: String, final_message: &str) -> Result<String, TextError> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_message.trim()) || !rendered.contains(tag) {
        return Err(TextError::BadRequest(
            "continue_final_message is set but the final message does not appear in the rendered chat".into(),
        ));
    }
    let at = rendered.rfind(tag).unwrap_or(rendered.len());
    if rendered[at..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..at].to_string())
    } else {
        Ok(rendered[..at].trim_end().to_string())
    }
}
