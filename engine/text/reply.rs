//! The generated text of a chat turn split the way Qwen's templates write an assistant message:
//! `<think>\n{reasoning}\n</think>\n\n{content}` and tool calls as
//! `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`.
//! Streamed: deltas of reasoning and content never contain a piece of a tag, and a tool call is
//! reported once it is complete. Parameter values become JSON by the tool's schema (`string`
//! parameters stay text; others are parsed as JSON, or Python's `True`/`False`/`None`, which the
//! template's `| string` writes), without a schema by trying JSON first.

use std::collections::HashMap;

use serde_json::{Map, Value as Json};

use super::chat::ToolCall;

/// A piece of the reply, in order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ChatDelta<'a> {
    /// Reasoning text (inside `<think>`).
    Reasoning(&'a str),
    /// Answer text.
    Content(&'a str),
    /// A complete tool call.
    ToolCall(&'a ToolCall),
}

/// A whole reply.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChatReply {
    /// The reasoning, trimmed (`None` when there was no reasoning block; a continued block keeps
    /// the model's leading whitespace).
    pub reasoning_content: Option<String>,
    /// The answer, trimmed (a continued message keeps the model's leading whitespace).
    pub content: String,
    /// The tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
    /// The generated text as it came (up to a stop string, which is not included).
    pub text: String,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
/// Where a turn starts in ChatML (Qwen's templates).
const TURN_START: &str = "<|im_start|>";

/// Whether a parameter's JSON schema allows a string (`"string"`, a type list with it, an
/// `anyOf`/`oneOf` member with it, or an `enum` of strings only): its text is then kept as text.
fn is_text(schema: &Json) -> bool {
    let ty = schema.get("type");
    if ty.and_then(Json::as_str) == Some("string") {
        return true;
    }
    if let Some(list) = ty.and_then(Json::as_array) {
        if list.iter().any(|t| t.as_str() == Some("string")) {
            return true;
        }
    }
    for key in ["anyOf", "oneOf"] {
        if schema.get(key).and_then(Json::as_array).is_some_and(|alts| alts.iter().any(is_text)) {
            return true;
        }
    }
    ty.is_none()
        && schema.get("enum").and_then(Json::as_array).is_some_and(|e| !e.is_empty() && e.iter().all(Json::is_string))
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// Before any visible content: `<think>` may still open reasoning.
    Start,
    Reasoning,
    Content,
    Call,
}

/// Splits streamed text into [`ChatDelta`]s (see the module docs).
pub struct ReplyParser {
    mode: Mode,
    /// Text not yet classified: a possible tag prefix, or whitespace that only counts if more
    /// text follows.
    pending: String,
    reply: ChatReply,
    reasoning: String,
    /// Tool-call body being collected.
    call: String,
    /// The whitespace dropped before a tool call (restored if the call is kept as text).
    gap: String,
    /// Whether the content has had visible text (leading whitespace is dropped).
    content_started: bool,
    reasoning_started: bool,
    /// Whether a repeated `<think>` at the start of the block was looked for.
    reopen_checked: bool,
    /// Whether the reply has a reasoning block (opened by the prompt or by the model).
    thought: bool,
    /// Whether each parameter is text (its schema allows a string), by function name.
    types: HashMap<String, HashMap<String, bool>>,
}

/// The length of the longest suffix of `s` that is a proper prefix of `tag` (text that may
/// still become the tag).
fn partial_tag_len(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

impl ReplyParser {
    /// A parser for the text generated after `prompt`: when the prompt ends inside an open
    /// `<think>` (Qwen 3.5 with thinking on), the reply starts as reasoning. `tools` are the
    /// request's tool definitions, whose parameter types guide the argument conversion.
    pub fn new(prompt: &str, tools: Option<&[Json]>) -> Self {
        // Only the last turn counts: a `<think>` written earlier in the conversation is text.
        let turn = prompt.rfind(TURN_START).map_or(prompt, |at| &prompt[at..]);
        let open = turn.rfind(THINK_OPEN);
        let in_think = open.is_some_and(|at| !turn[at..].contains(THINK_CLOSE));
        let mut types = HashMap::new();
        for tool in tools.unwrap_or(&[]) {
            let f = tool.get("function").unwrap_or(tool);
            let Some(name) = f.get("name").and_then(Json::as_str) else { continue };
            let props = f.pointer("/parameters/properties").and_then(Json::as_object);
            let params = props.map(|p| p.iter().map(|(k, v)| (k.clone(), is_text(v))).collect()).unwrap_or_default();
            types.insert(name.to_string(), params);
        }
        // Fresh turn (the prompt ends with the generation header's newline): the template's
        // whitespace before the text is dropped; a continued message keeps the model's.
        let fresh = prompt.is_empty() || prompt.ends_with(char::is_whitespace);
        Self {
            mode: if in_think { Mode::Reasoning } else { Mode::Start },
            pending: String::new(),
            reply: ChatReply::default(),
            reasoning: String::new(),
            call: String::new(),
            gap: String::new(),
            content_started: !fresh,
            reasoning_started: !fresh,
            thought: in_think,
            reopen_checked: false,
            types,
        }
    }

    /// Add generated text; `emit` receives the deltas it completes and returns `false` to stop
    /// (then so does this).
    pub fn push(&mut self, text: &str, emit: &mut dyn FnMut(ChatDelta<'_>) -> bool) -> bool {
        self.reply.text.push_str(text);
        self.pending.push_str(text);
        self.drain(false, emit)
    }

    /// End of generation: flush what is held back and return the whole reply. An unfinished tool
    /// call is kept as content text.
    pub fn finish(mut self, emit: &mut dyn FnMut(ChatDelta<'_>) -> bool) -> ChatReply {
        self.drain(true, emit);
        if self.mode == Mode::Call {
            let raw = format!("{}{CALL_OPEN}{}", self.gap, self.call);
            self.content(&raw, true, emit);
        }
        if self.thought {
            self.reply.reasoning_content = Some(self.reasoning.trim_end().to_string());
        }
        self.reply.content = self.reply.content.trim_end().to_string();
        self.reply
    }

    fn drain(&mut self, end: bool, emit: &mut dyn FnMut(ChatDelta<'_>) -> bool) -> bool {
        loop {
            let text = std::mem::take(&mut self.pending);
            let go_on = match self.mode {
                Mode::Start => {
                    let rest = text.trim_start();
                    if rest.is_empty() && !end {
                        self.pending = text;
                        return true;
                    }
                    if let Some(after) = rest.strip_prefix(THINK_OPEN) {
                        self.mode = Mode::Reasoning;
                        self.thought = true;
                        self.reasoning_started = false;
                        self.reopen_checked = true;
                        self.pending = after.to_string();
                        continue;
                    }
                    if !end && THINK_OPEN.starts_with(rest) {
                        self.pending = text;
                        return true;
                    }
                    self.mode = Mode::Content;
                    self.pending = text;
                    continue;
                }
                Mode::Reasoning if !self.reasoning_started && !self.reopen_checked => {
                    // The prompt opened <think>; a model that writes it again does not start a
                    // second block.
                    let rest = text.trim_start();
                    if !end && THINK_OPEN.starts_with(rest) {
                        self.pending = text;
                        return true;
                    }
                    self.reopen_checked = true;
                    self.pending = rest.strip_prefix(THINK_OPEN).unwrap_or(rest).to_string();
                    continue;
                }
                Mode::Reasoning => match text.find(THINK_CLOSE) {
                    Some(at) => {
                        let go = self.reasoning_text(&text[..at], true, emit);
                        self.mode = Mode::Content;
                        self.content_started = false;
                        self.pending = text[at + THINK_CLOSE.len()..].to_string();
                        if !go {
                            return false;
                        }
                        continue;
                    }
                    None => {
                        let keep = if end { 0 } else { partial_tag_len(&text, THINK_CLOSE) };
                        let (now, later) = text.split_at(text.len() - keep);
                        self.pending = later.to_string();
                        self.reasoning_text(now, end, emit)
                    }
                },
                Mode::Content => match text.find(CALL_OPEN) {
                    Some(at) => {
                        let go = self.content(&text[..at], true, emit);
                        self.mode = Mode::Call;
                        self.pending = text[at + CALL_OPEN.len()..].to_string();
                        if !go {
                            return false;
                        }
                        continue;
                    }
                    None => {
                        let keep = if end { 0 } else { partial_tag_len(&text, CALL_OPEN) };
                        let (now, later) = text.split_at(text.len() - keep);
                        self.pending = later.to_string();
                        self.content(now, end, emit)
                    }
                },
                Mode::Call => match text.find(CALL_CLOSE) {
                    Some(at) => {
                        self.call.push_str(&text[..at]);
                        let body = std::mem::take(&mut self.call);
                        self.pending = text[at + CALL_CLOSE.len()..].to_string();
                        self.mode = Mode::Content;
                        let go = match self.parse_call(&body) {
                            Some(call) => {
                                self.reply.tool_calls.push(call);
                                self.reply.tool_calls.last().is_none_or(|c| emit(ChatDelta::ToolCall(c)))
                            }
                            None => {
                                let raw = format!("{}{CALL_OPEN}{body}{CALL_CLOSE}", std::mem::take(&mut self.gap));
                                self.content(&raw, true, emit)
                            }
                        };
                        if !go {
                            return false;
                        }
                        continue;
                    }
                    None => {
                        let keep = partial_tag_len(&text, CALL_CLOSE);
                        let (now, later) = text.split_at(text.len() - keep);
                        self.call.push_str(now);
                        self.pending = later.to_string();
                        if end {
                            self.call.push_str(&std::mem::take(&mut self.pending));
                        }
                        true
                    }
                },
            };
            return go_on;
        }
    }

    /// Reasoning text: leading whitespace dropped, trailing whitespace held until more text
    /// follows (the template trims the reasoning).
    fn reasoning_text(&mut self, text: &str, flush_end: bool, emit: &mut dyn FnMut(ChatDelta<'_>) -> bool) -> bool {
        let text = if self.reasoning_started { text } else { text.trim_start() };
        let body = text.trim_end();
        let tail = &text[body.len()..];
        self.reasoning_started |= !body.is_empty();
        if body.is_empty() {
            if !flush_end {
                self.pending.insert_str(0, tail);
            }
            return true;
        }
        self.reasoning.push_str(body);
        let go = emit(ChatDelta::Reasoning(body));
        if !flush_end {
            self.pending.insert_str(0, tail);
        }
        go
    }

    /// Content text, with the same whitespace rules as the reasoning.
    fn content(&mut self, text: &str, flush_end: bool, emit: &mut dyn FnMut(ChatDelta<'_>) -> bool) -> bool {
        let text = if self.content_started { text } else { text.trim_start() };
        let body = text.trim_end();
        let tail = &text[body.len()..];
        if body.is_empty() {
            if flush_end {
                self.gap = tail.to_string();
            } else {
                self.pending.insert_str(0, tail);
            }
            return true;
        }
        self.content_started = true;
        self.reply.content.push_str(body);
        let go = emit(ChatDelta::Content(body));
        if flush_end {
            // Whitespace before a tool call or at the end is the template's, not the answer's,
            // unless the call turns out to be text.
            self.gap = tail.to_string();
        } else {
            self.pending.insert_str(0, tail);
        }
        go
    }

    /// `\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n…</function>\n` (Qwen 3.5's
    /// format), or `\n{"name": NAME, "arguments": {…}}\n` (Qwen 3 / Qwen3-VL's); anything else
    /// (text between the parts, an empty name) is not a call.
    fn parse_call(&self, body: &str) -> Option<ToolCall> {
        let body = body.trim();
        if body.starts_with('{') {
            let v: Json = serde_json::from_str(body).ok()?;
            let name = v.get("name")?.as_str().filter(|n| !n.is_empty())?;
            let arguments = match v.get("arguments") {
                Some(Json::String(s)) => serde_json::from_str(s).unwrap_or_else(|_| Json::String(s.clone())),
                Some(a) => a.clone(),
                None => Json::Object(Map::new()),
            };
            return Some(ToolCall::new(name, arguments));
        }
        let rest = body.strip_prefix("<function=")?;
        let close = rest.find('>')?;
        let name = rest[..close].trim().to_string();
        if name.is_empty() || name.contains('\n') {
            return None;
        }
        let mut rest = rest[close + 1..].strip_suffix("</function>")?;
        let types = self.types.get(&name);
        let mut args = Map::new();
        loop {
            let trimmed = rest.trim_start();
            if trimmed.is_empty() {
                break;
            }
            let after = trimmed.strip_prefix("<parameter=")?;
            let close = after.find('>')?;
            let pname = after[..close].trim().to_string();
            let value_start = &after[close + 1..];
            // The template writes `\n</parameter>`: prefer that end, so a value may contain the
            // tag, unless it comes after the next parameter and another `</parameter>` ends this
            // one first (a model that left out the newline once).
            let plain = value_start.find("</parameter>")?;
            let next = value_start.find("\n<parameter=");
            let (stop, tag) = match value_start.find("\n</parameter>") {
                Some(at) if at + 1 == plain || next.is_none_or(|n| at < n) => (at, "\n</parameter>".len()),
                _ => (plain, "</parameter>".len()),
            };
            let value = &value_start[..stop];
            let value = value.strip_prefix('\n').unwrap_or(value);
            let text = types.and_then(|t| t.get(&pname)).copied();
            args.insert(pname, parameter_value(value, text));
            rest = &value_start[stop + tag..];
        }
        Some(ToolCall::new(&name, Json::Object(args)))
    }
}

/// A parameter's text as JSON: parameters whose schema allows a string as written; other typed
/// ones (and those without a schema) as JSON when the text is JSON, Python's `True`/`False`/
/// `None` as such, else the text.
fn parameter_value(text: &str, is_text: Option<bool>) -> Json {
    if is_text == Some(true) {
        return Json::String(text.to_string());
    }
    match text.trim() {
        "True" => return Json::Bool(true),
        "False" => return Json::Bool(false),
        "None" => return Json::Null,
        _ => {}
    }
    match serde_json::from_str::<Json>(text) {
        Ok(v) if is_text.is_some() || !v.is_string() => v,
        _ => Json::String(text.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{ChatDelta, ChatReply, ReplyParser};
    use crate::text::ToolCall;

    /// Feed `text` in pieces of every size 1..=len and check the stream and the reply.
    fn parse_every_split(prompt: &str, text: &str) -> ChatReply {
        let whole = {
            let p = ReplyParser::new(prompt, None);
            let mut p = p;
            p.push(text, &mut |_| true);
            p.finish(&mut |_| true)
        };
        for size in 1..=text.len().min(12) {
            let mut p = ReplyParser::new(prompt, None);
            let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
            let mut sink = |d: ChatDelta<'_>| {
                match d {
                    ChatDelta::Reasoning(r) => {
                        assert!(!r.contains('<') || !r.contains("think>"), "tag in {r:?}");
                        reasoning.push_str(r)
                    }
                    ChatDelta::Content(c) => {
                        assert!(!c.contains("</think"), "tag in {c:?}");
                        content.push_str(c)
                    }
                    ChatDelta::ToolCall(c) => calls.push(c.clone()),
                }
                true
            };
            let mut start = 0;
            while start < text.len() {
                let mut end = (start + size).min(text.len());
                while !text.is_char_boundary(end) {
                    end += 1;
                }
                p.push(&text[start..end], &mut sink);
                start = end;
            }
            let reply = p.finish(&mut sink);
            assert_eq!(reply, whole, "split {size}");
            assert_eq!(
                reasoning,
                whole.reasoning_content.clone().unwrap_or_default(),
                "streamed reasoning, split {size}"
            );
            assert_eq!(content, whole.content, "streamed content, split {size}");
            assert_eq!(calls, whole.tool_calls, "streamed calls, split {size}");
        }
        whole
    }

    #[test]
    fn reasoning_content_and_calls_are_split_at_any_chunking() {
        let r = parse_every_split("<|im_start|>assistant\n<think>\n", "Let me see.\nYes.\n</think>\n\nIt is 4.");
        assert_eq!(r.reasoning_content.as_deref(), Some("Let me see.\nYes."));
        assert_eq!(r.content, "It is 4.");
        let r = parse_every_split("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello <b>there</b> é!");
        assert_eq!(r.reasoning_content, None);
        assert_eq!(r.content, "Hello <b>there</b> é!");
        let r = parse_every_split(
            "<|im_start|>assistant\n<think>\n",
            "Need weather.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
        );
        assert_eq!(r.content, "Checking.");
        assert_eq!(
            r.tool_calls,
            vec![ToolCall::new("get_weather", json!({"city": "Paris", "days": 3})), ToolCall::new("now", json!({}))]
        );
        let r = parse_every_split("<|im_start|>assistant\n", "<think>\nhm\n</think>\n\nok");
        assert_eq!((r.reasoning_content.as_deref(), r.content.as_str()), (Some("hm"), "ok"));
    }

    #[test]
    fn unfinished_or_malformed_calls_stay_text() {
        let r = parse_every_split("", "a <tool_call>\n<function=f>\n<parameter=x>\n1");
        assert!(r.tool_calls.is_empty());
        assert_eq!(r.content, "a <tool_call>\n<function=f>\n<parameter=x>\n1");
        let r = parse_every_split("", "<tool_call>{\"name\": 1}</tool_call>");
        assert!(r.tool_calls.is_empty());
        assert_eq!(r.content, "<tool_call>{\"name\": 1}</tool_call>");
    }

    #[test]
    fn parameter_values_follow_the_schema() {
        let tools = [json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"s": {"type": "string"}, "n": {"type": "number"}, "b": {"type": "boolean"}, "o": {"type": "object"}}}}})];
        let mut p = ReplyParser::new("", Some(&tools));
        p.push("<tool_call>\n<function=f>\n<parameter=s>\n42\n</parameter>\n<parameter=n>\n2.5\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n<parameter=o>\n{\"a\": [1, 2]}\n</parameter>\n<parameter=x>\nfree text\n</parameter>\n</function>\n</tool_call>", &mut |_| true);
        let r = p.finish(&mut |_| true);
        assert_eq!(
            r.tool_calls,
            vec![ToolCall::new("f", json!({"s": "42", "n": 2.5, "b": true, "o": {"a": [1, 2]}, "x": "free text"}))]
        );
    }

    #[test]
    fn the_prompt_and_the_schema_decide_what_is_reasoning_and_text() {
        // A `<think>` in an earlier turn is text; only the last turn's open block counts.
        let r =
            parse_every_split("<|im_start|>system\nNever write <think>.<|im_end|>\n<|im_start|>assistant\n", "Hello.");
        assert_eq!((r.reasoning_content, r.content.as_str()), (None, "Hello."));
        // A continued message keeps the model's leading whitespace.
        let r = parse_every_split("<|im_start|>assistant\n<think>\n\n</think>\n\nOne, two,", " three.");
        assert_eq!(r.content, " three.");
        let r = parse_every_split("<|im_start|>assistant\n<think>\nLet me", " think.\n</think>\n\nOk");
        assert_eq!((r.reasoning_content.as_deref(), r.content.as_str()), (Some(" think."), "Ok"));
        // A model that opens the block the prompt already opened.
        let r = parse_every_split("<|im_start|>assistant\n<think>\n", "<think>\nhm\n</think>\n\nok");
        assert_eq!((r.reasoning_content.as_deref(), r.content.as_str()), (Some("hm"), "ok"));
        // JSON tool calls (Qwen 3 / Qwen3-VL).
        let r = parse_every_split(
            "",
            "Sure.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {\"tz\": \"UTC\"}}\n</tool_call>",
        );
        assert_eq!(
            (r.content.as_str(), r.tool_calls.clone()),
            ("Sure.", vec![ToolCall::new("now", json!({"tz": "UTC"}))])
        );
        // Not calls: text between the parts, an empty name.
        for bad in [
            "<tool_call>\n<function=f>\nJUNK\n</function>\n</tool_call>",
            "<tool_call>\n<function=>\n</function>\n</tool_call>",
        ] {
            let r = parse_every_split("", bad);
            assert!(r.tool_calls.is_empty(), "{bad}");
            assert_eq!(r.content, bad);
        }
        // A value holding the closing tag.
        let r = parse_every_split(
            "",
            "<tool_call>\n<function=say>\n<parameter=s>\nsay </parameter> x\n</parameter>\n</function>\n</tool_call>",
        );
        assert_eq!(r.tool_calls, vec![ToolCall::new("say", json!({"s": "say </parameter> x"}))]);
        // A parameter whose end tag lacks the newline ends there, not at the next one's.
        let r = parse_every_split(
            "",
            "<tool_call>\n<function=f>\n<parameter=a>\n1</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>",
        );
        assert_eq!(r.tool_calls, vec![ToolCall::new("f", json!({"a": 1, "b": 2}))]);
        // A value holding a parameter tag, ended as the template ends it.
        let r = parse_every_split(
            "",
            "<tool_call>\n<function=f>\n<parameter=code>\nx\n<parameter=y>\n</parameter>\n</function>\n</tool_call>",
        );
        assert_eq!(r.tool_calls, vec![ToolCall::new("f", json!({"code": "x\n<parameter=y>"}))]);
        // Schemas that allow a string keep the text.
        let tools =
            [json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "zip": {"type": ["string", "null"]}, "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "e": {"enum": ["1", "2"]}, "n": {"type": ["integer", "null"]}}}}})];
        let mut p = ReplyParser::new("", Some(&tools));
        p.push("<tool_call>\n<function=f>\n<parameter=zip>\n012345\n</parameter>\n<parameter=code>\n42\n</parameter>\n<parameter=e>\n1\n</parameter>\n<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>", &mut |_| true);
        let r = p.finish(&mut |_| true);
        assert_eq!(r.tool_calls, vec![ToolCall::new("f", json!({"zip": "012345", "code": "42", "e": "1", "n": 7}))]);
    }
}
