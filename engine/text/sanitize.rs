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

use std::collections::HashSet;

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::Value as Json;
use tokenizers::{
    Model, NormalizedString, Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer,
};

use super::{ChatPrompt, TextError, TextTokenizer};

/// Opens a control token found in a user's string.
const MARK_START: char = '\u{F0000}';
/// Closes it.
const MARK_END: char = '\u{F0001}';

fn matcher(kind: MatchKind, tokens: &[&str]) -> Result<AhoCorasick, TextError> {
    AhoCorasick::builder().match_kind(kind).build(tokens).map_err(|e| TextError::Tokenizer {
        during: "matching the control tokens (sanitize_control_tokens)",
        message: e.to_string(),
    })
}

/// Which of `tokens` occur in `text` (overlaps counted), by index; an empty token never does.
/// One pass over the text.
pub(crate) fn occurring(tokens: &[&str], text: &str) -> Result<HashSet<usize>, TextError> {
    let (index, tokens): (Vec<usize>, Vec<&str>) =
        tokens.iter().copied().enumerate().filter(|(_, t)| !t.is_empty()).unzip();
    let ac = matcher(MatchKind::Standard, &tokens)?;
    Ok(ac.find_overlapping_iter(text).map(|m| index[m.pattern().as_usize()]).collect())
}

/// What sanitizing needs of one tokenizer and template, built once: the control tokens to wrap
/// in the request's strings and the added tokens a wrapped piece may be.
pub(crate) struct Sanitizer {
    /// The control tokens, longest first at each position (Python's alternation sorted by
    /// length); `None` when there are none.
    control: Option<AhoCorasick>,
    /// Every added token (a wrapped string that is not one is text between two lone markers).
    /// Tokens holding a marker character are left out: they never match wrapped.
    added: HashSet<String>,
}

impl Sanitizer {
    /// For the `control` tokens among the tokenizer's `added` ones (empty contents ignored).
    pub(crate) fn new(control: &[&str], added: &[&str]) -> Result<Self, TextError> {
        let control: Vec<&str> = control.iter().copied().filter(|t| !t.is_empty()).collect();
        let has_marker = |t: &str| t.contains([MARK_START, MARK_END]);
        Ok(Self {
            control: if control.is_empty() { None } else { Some(matcher(MatchKind::LeftmostLongest, &control)?) },
            added: added.iter().filter(|t| !t.is_empty() && !has_marker(t)).map(|t| t.to_string()).collect(),
        })
    }

    /// `s` without markers, each control token in it wrapped.
    fn mark_str(&self, s: &str) -> String {
        let clean: String = s.chars().filter(|c| *c != MARK_START && *c != MARK_END).collect();
        let Some(ac) = &self.control else { return clean };
        let mut out = String::with_capacity(clean.len());
        let mut last = 0;
        for m in ac.find_iter(&clean) {
            out.push_str(&clean[last..m.start()]);
            out.push(MARK_START);
            out.push_str(&clean[m.start()..m.end()]);
            out.push(MARK_END);
            last = m.end();
        }
        out.push_str(&clean[last..]);
        out
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

    /// The pieces of `chat` as Python's `re.split` on `START(token…)END|[START END]` gives them:
    /// a wrapped added token is a piece of its own, a lone marker leaves no piece but ends the
    /// text before it. One pass (the next end marker is looked up once per end marker).
    fn split<'a>(&self, chat: &'a str) -> Vec<Piece<'a>> {
        let width = MARK_START.len_utf8();
        let mut pieces = Vec::new();
        let (mut last, mut at) = (0, 0);
        let mut next_end: Option<usize> = None;
        while let Some(found) = chat[at..].find([MARK_START, MARK_END]) {
            let p = at + found;
            if chat[p..].starts_with(MARK_START) {
                if next_end.is_none_or(|e| e < p) {
                    next_end = chat[p..].find(MARK_END).map(|e| p + e);
                }
                let wrapped = next_end.map(|e| &chat[p + width..e]).filter(|t| self.added.contains(*t));
                if let (Some(token), Some(e)) = (wrapped, next_end) {
                    pieces.push(Piece::Text(&chat[last..p]));
                    pieces.push(Piece::Marked(token));
                    (last, at) = (e + width, e + width);
                    continue;
                }
            }
            pieces.push(Piece::Text(&chat[last..p]));
            (last, at) = (p + width, p + width);
        }
        pieces.push(Piece::Text(&chat[last..]));
        pieces
    }

    /// transformers' `encode_marked_chat`: the prompt of a chat rendered from marked strings, its
    /// ids with each wrapped token encoded as text; its text without the markers; and the view
    /// the reply parser reads, each wrapped token replaced by U+FFFC (no tag where the model saw
    /// text). One split of the chat gives all three.
    pub(crate) fn prompt(&self, tok: &TextTokenizer, chat: &str) -> Result<ChatPrompt, TextError> {
        let newline = tok.encode_prompt("\n")?;
        let (mut ids, mut text, mut view) = (Vec::new(), String::with_capacity(chat.len()), String::new());
        for (i, piece) in self.split(chat).iter().enumerate() {
            let (part, as_text) = match piece {
                Piece::Text(t) => (*t, false),
                Piece::Marked(t) => (*t, true),
            };
            text.push_str(part);
            view.push_str(if as_text { "\u{FFFC}" } else { part });
            if i == 0 {
                ids.extend(tok.encode_prompt(part)?);
                continue;
            }
            if part.is_empty() {
                continue;
            }
            let run = |t: &str| if as_text { encode_plain(&tok.inner, t) } else { tok.encode_prompt(t) };
            let after_newline = run(&format!("\n{part}"))?;
            let piece_ids = match after_newline.strip_prefix(newline.as_slice()) {
                Some(rest) => rest.to_vec(),
                None => run(part)?,
            };
            if as_text {
                if let Some(id) = tok.token_id(part).filter(|id| piece_ids.contains(id)) {
                    return Err(TextError::BadRequest(format!(
                        "sanitize_control_tokens: cannot encode {part:?} as text, the tokenizer makes its token \
                         (id {id}) from the plain text"
                    )));
                }
            }
            ids.extend(piece_ids);
        }
        Ok(ChatPrompt { text, ids, parser_view: Some(view) })
    }
}

/// One piece of a rendered chat between markers.
#[derive(Debug, PartialEq)]
enum Piece<'a> {
    /// Template text and unmarked user text: encoded with the added vocabulary.
    Text(&'a str),
    /// A control token a user wrote: encoded as plain text.
    Marked(&'a str),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_tokens_win_and_old_markers_are_dropped() {
        let c = Sanitizer::new(&["<a>", "<a><b>", ""], &[]).expect("builds");
        let s = format!("x<a><b>y{MARK_END}<a>");
        assert_eq!(c.mark_str(&s), format!("x{MARK_START}<a><b>{MARK_END}y{MARK_START}<a>{MARK_END}"));
        assert_eq!(Sanitizer::new(&[], &[]).expect("empty").mark_str("<a>"), "<a>");
    }

    #[test]
    fn lone_markers_split_the_text_and_leave_no_piece() {
        let c = Sanitizer::new(&[], &["<a>"]).expect("builds");
        let (s, e) = (MARK_START, MARK_END);
        let chat = format!("p{s}<a>{e}q{e}r{s}<b>{e}{s}{s}<a>{e}");
        use Piece::{Marked, Text};
        let want = vec![
            Text("p"),
            Marked("<a>"),
            Text("q"),
            Text("r"),
            Text("<b>"),
            Text(""),
            Text(""),
            Marked("<a>"),
            Text(""),
        ];
        assert_eq!(c.split(&chat), want);
    }

    /// The one-pass split against Python's `re.split` on `S(tok…)E|[SE]` (the `regex` crate's
    /// leftmost-first alternation, longest token first, is Python's here) over random strings of
    /// markers, tokens, prefixes of tokens and text.
    #[test]
    fn the_split_is_the_regex_split() {
        let added = ["<a>", "<a><b>", "<b>", "ab"];
        let c = Sanitizer::new(&[], &added).expect("builds");
        let (s, e) = (MARK_START, MARK_END);
        let mut sorted = added.to_vec();
        sorted.sort_by_key(|t| std::cmp::Reverse(t.len()));
        let alternation: Vec<String> = sorted.iter().map(|t| regex::escape(t)).collect();
        let re = regex::Regex::new(&format!("{s}({}){e}|[{s}{e}]", alternation.join("|"))).expect("regex");
        let atoms = [
            s.to_string(),
            e.to_string(),
            "<a>".into(),
            "<b>".into(),
            "<a".into(),
            "b>".into(),
            "a".into(),
            "x".into(),
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
        for _ in 0..3000 {
            let mut chat = String::new();
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            for k in 0..(seed % 12) {
                chat.push_str(&atoms[((seed >> (4 * k)) % atoms.len() as u64) as usize]);
            }
            let mut want = Vec::new();
            let mut last = 0;
            for caps in re.captures_iter(&chat) {
                let whole = caps.get(0).expect("match");
                want.push(Piece::Text(&chat[last..whole.start()]));
                if let Some(token) = caps.get(1) {
                    want.push(Piece::Marked(token.as_str()));
                }
                last = whole.end();
            }
            want.push(Piece::Text(&chat[last..]));
            assert_eq!(c.split(&chat), want, "{chat:?}");
        }
    }
}
