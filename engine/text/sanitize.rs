//! transformers' `apply_chat_template(..., tokenize=True, sanitize_control_tokens=True)`: a
//! control token written in a user's string (`<|im_end|>` in a message, a tool description, an
//! argument) is encoded as the plain text it is, so user text cannot close a turn or open a new
//! one; the control tokens the template writes itself stay tokens.
//!
//! As in transformers (`utils/chat_template_utils.py`): every string the template is given is
//! searched for control tokens, longest first, and each is wrapped in two private-use markers
//! (markers already in the string are dropped first, so they cannot forge a wrapped token); the
//! rendered prompt is split at the markers, a wrapped token is encoded without the added
//! vocabulary, and a lone marker (a template method that cut a wrapped token) still breaks the
//! text, so the pieces on either side cannot join into a token. Each piece after the first is
//! encoded after a newline that is then removed, as transformers does.

use regex::Regex;
use serde_json::Value as Json;
use tokenizers::{
    Model, NormalizedString, Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer,
};

use super::TextError;

/// Opens a control token found in a user's string.
pub(crate) const MARK_START: char = '\u{F0000}';
/// Closes it.
pub(crate) const MARK_END: char = '\u{F0001}';

/// `tokens` as one alternation, longest first, so a token wins over the tokens it contains.
fn alternation(tokens: &[String]) -> String {
    let mut sorted: Vec<&String> = tokens.iter().filter(|t| !t.is_empty()).collect();
    // Python's sort is stable: ties keep the given order.
    sorted.sort_by_key(|t| std::cmp::Reverse(t.chars().count()));
    sorted.iter().map(|t| regex::escape(t)).collect::<Vec<_>>().join("|")
}

fn compile(pattern: &str) -> Result<Regex, TextError> {
    Regex::new(pattern).map_err(|e| TextError::Tokenizer {
        during: "matching the control tokens (sanitize_control_tokens)",
        message: e.to_string(),
    })
}

/// Wraps the control tokens in the strings a template is given.
pub(crate) struct ControlTokens(Option<Regex>);

impl ControlTokens {
    /// The control tokens of one render.
    pub(crate) fn new(tokens: &[String]) -> Result<Self, TextError> {
        let pattern = alternation(tokens);
        Ok(Self(if pattern.is_empty() { None } else { Some(compile(&pattern)?) }))
    }

    /// `s` without markers, each control token in it wrapped.
    fn mark_str(&self, s: &str) -> String {
        let clean: String = s.chars().filter(|c| *c != MARK_START && *c != MARK_END).collect();
        match &self.0 {
            Some(re) => re.replace_all(&clean, format!("{MARK_START}${{0}}{MARK_END}").as_str()).into_owned(),
            None => clean,
        }
    }

    /// Every string in `value` marked, in place: the values of objects and the items of arrays,
    /// not the keys.
    pub(crate) fn mark(&self, value: &mut Json) {
        match value {
            Json::String(s) => *s = self.mark_str(s),
            Json::Array(items) => items.iter_mut().for_each(|v| self.mark(v)),
            Json::Object(map) => map.values_mut().for_each(|v| self.mark(v)),
            _ => {}
        }
    }
}

/// One piece of a rendered chat between markers.
enum Piece<'a> {
    /// Template text and unmarked user text: encoded with the added vocabulary.
    Text(&'a str),
    /// A control token a user wrote: encoded as plain text.
    Marked(&'a str),
}

/// The pieces of `chat` as Python's `re.split` gives them (a lone marker leaves no piece but
/// ends the text before it).
fn split_marked<'a>(chat: &'a str, markers: &Regex) -> Vec<Piece<'a>> {
    let mut pieces = Vec::new();
    let mut last = 0;
    for caps in markers.captures_iter(chat) {
        let Some(whole) = caps.get(0) else { continue };
        pieces.push(Piece::Text(&chat[last..whole.start()]));
        if let Some(token) = caps.get(1) {
            pieces.push(Piece::Marked(token.as_str()));
        }
        last = whole.end();
    }
    pieces.push(Piece::Text(&chat[last..]));
    pieces
}

/// transformers' `_encode_without_added_tokens`: the normalizer, the pre-tokenizer and the model,
/// no added token matched, nothing added.
fn encode_plain(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>, TextError> {
    let failed = |e: tokenizers::Error| TextError::Tokenizer {
        during: "encoding a control token as text",
        message: e.to_string(),
    };
    let mut normalized = NormalizedString::from(text);
    if let Some(n) = tokenizer.get_normalizer() {
        n.normalize(&mut normalized).map_err(failed)?;
    }
    let mut pre = PreTokenizedString::from(normalized.get());
    if let Some(p) = tokenizer.get_pre_tokenizer() {
        p.pre_tokenize(&mut pre).map_err(failed)?;
    }
    let mut ids = Vec::new();
    for (split, _, _) in pre.get_splits(OffsetReferential::Original, OffsetType::Char) {
        ids.extend(tokenizer.get_model().tokenize(split).map_err(failed)?.iter().map(|t| t.id));
    }
    Ok(ids)
}

/// transformers' `encode_marked_chat`: ids of a chat rendered from marked strings, each wrapped
/// token as text. `added` are all the tokenizer's added tokens (a wrapped string that is not
/// one of them is text with two lone markers).
pub(crate) fn encode_marked(
    tokenizer: &tokenizers::Tokenizer,
    added: &[String],
    chat: &str,
) -> Result<Vec<u32>, TextError> {
    let tokens = alternation(added);
    let markers = compile(&if tokens.is_empty() {
        format!("[{MARK_START}{MARK_END}]")
    } else {
        format!("{MARK_START}({tokens}){MARK_END}|[{MARK_START}{MARK_END}]")
    })?;
    let encode = |text: &str| -> Result<Vec<u32>, TextError> {
        let enc = tokenizer
            .encode(text, false)
            .map_err(|e| TextError::Tokenizer { during: "encoding", message: e.to_string() })?;
        Ok(enc.get_ids().to_vec())
    };
    let newline = encode("\n")?;
    let pieces = split_marked(chat, &markers);
    let mut ids = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        let (text, as_text) = match piece {
            Piece::Text(t) => (*t, false),
            Piece::Marked(t) => (*t, true),
        };
        if i == 0 {
            ids.extend(encode(text)?);
            continue;
        }
        if text.is_empty() {
            continue;
        }
        let run = |t: &str| if as_text { encode_plain(tokenizer, t) } else { encode(t) };
        let after_newline = run(&format!("\n{text}"))?;
        let piece_ids = match after_newline.strip_prefix(newline.as_slice()) {
            Some(rest) => rest.to_vec(),
            None => run(text)?,
        };
        if as_text {
            if let Some(id) = tokenizer.token_to_id(text).filter(|id| piece_ids.contains(id)) {
                return Err(TextError::BadRequest(format!(
                    "sanitize_control_tokens: cannot encode {text:?} as text, the tokenizer makes its token \
                     (id {id}) from the plain text"
                )));
            }
        }
        ids.extend(piece_ids);
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_tokens_win_and_old_markers_are_dropped() {
        let c = ControlTokens::new(&["<a>".into(), "<a><b>".into(), "".into()]).expect("compiles");
        let s = format!("x<a><b>y{MARK_END}<a>");
        assert_eq!(c.mark_str(&s), format!("x{MARK_START}<a><b>{MARK_END}y{MARK_START}<a>{MARK_END}"));
        assert_eq!(ControlTokens::new(&[]).expect("empty").mark_str("<a>"), "<a>");
    }

    #[test]
    fn lone_markers_split_the_text_and_leave_no_piece() {
        let markers = compile(&format!("{MARK_START}(<a>){MARK_END}|[{MARK_START}{MARK_END}]")).expect("compiles");
        let chat = format!("p{MARK_START}<a>{MARK_END}q{MARK_END}r{MARK_START}<b>{MARK_END}");
        let got: Vec<(bool, &str)> = split_marked(&chat, &markers)
            .iter()
            .map(|p| match p {
                Piece::Text(t) => (false, *t),
                Piece::Marked(t) => (true, *t),
            })
            .collect();
        assert_eq!(got, vec![(false, "p"), (true, "<a>"), (false, "q"), (false, "r"), (false, "<b>"), (false, "")]);
    }
}
