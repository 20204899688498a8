//! The regexes of a PEFT config with Python `re` semantics, bounded in size and time.
//!
//! peft matches `target_modules` / `exclude_modules` strings with `re.fullmatch(p, name)`, the
//! keys of `rank_pattern` / `alpha_pattern` with `re.match(rf"(.*\.)?({key})$", name)` (peft
//! 0.21, `peft.utils.other.get_pattern_key`) and `layers_pattern` with
//! `re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", name)`. `re.match(p)` is `\A(?:p)` and
//! `re.fullmatch(p)` is `\A(?:p)\z` (a non-capturing group keeps the group numbers Python
//! sees); [`fancy_regex`] gives look-around and back-references. Python's `\Z` is written `\z`
//! here. Python's `$` also matches before a final newline; module names have none.
//!
//! Untrusted configs: a pattern is at most [`MAX_PATTERN_BYTES`], its compiled program at most
//! [`PROGRAM_BYTES`], and one match backtracks at most [`BACKTRACK_LIMIT`] times; exceeding any
//! is a typed [`AdapterError::BadConfig`], never a hang.

use fancy_regex::{Regex, RegexBuilder};

use crate::error::AdapterError;

/// Longest pattern accepted (real ones are module names or a short alternation).
pub(crate) const MAX_PATTERN_BYTES: usize = 4096;
/// Backtracking steps one match may take (only look-around / back-reference patterns
/// backtrack; the rest run on the linear-time `regex` engine).
const BACKTRACK_LIMIT: usize = 10_000;
/// Size of one compiled program (the `regex` crate's default is 10 MiB).
const PROGRAM_BYTES: usize = 256 * 1024;

/// A compiled config regex and where it came from.
#[derive(Clone, Debug)]
pub(crate) struct PyRegex {
    field: String,
    source: String,
    re: Engine,
}

/// Patterns the `regex` crate accepts run there in linear time; only look-around and
/// back-references need fancy-regex's backtracking VM.
#[derive(Clone, Debug)]
enum Engine {
    Linear(regex::Regex),
    Backtracking(Regex),
}

/// Python-only escapes rewritten for fancy-regex: `\Z` (end of string) is `\z`.
fn translate(pattern: &str) -> String {
    let mut out = String::with_capacity(pattern.len());
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            match chars.next() {
                Some('Z') => out.push_str("\\z"),
                Some(n) => {
                    out.push('\\');
                    out.push(n);
                }
                None => out.push('\\'),
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn compile(field: &str, source: &str, wrapped: String) -> Result<PyRegex, AdapterError> {
    if source.len() > MAX_PATTERN_BYTES {
        return Err(AdapterError::BadConfig {
            field: field.into(),
            expected: format!("a regular expression of at most {MAX_PATTERN_BYTES} bytes"),
            found: format!("{} bytes", source.len()),
        });
    }
    let linear = regex::RegexBuilder::new(&wrapped).size_limit(PROGRAM_BYTES).dfa_size_limit(PROGRAM_BYTES).build();
    if let Ok(re) = linear {
        return Ok(PyRegex { field: field.into(), source: source.into(), re: Engine::Linear(re) });
    }
    let re = RegexBuilder::new(&wrapped)
        .backtrack_limit(BACKTRACK_LIMIT)
        .delegate_size_limit(PROGRAM_BYTES)
        .delegate_dfa_size_limit(PROGRAM_BYTES)
        .build()
        .map_err(|e| AdapterError::BadConfig {
            field: field.into(),
            expected: "a valid (Python re) regular expression".into(),
            found: format!("{source:?} ({e})"),
        })?;
    Ok(PyRegex { field: field.into(), source: source.into(), re: Engine::Backtracking(re) })
}

impl PyRegex {
    /// `re.fullmatch(pattern, name)`.
    pub(crate) fn fullmatch(field: &str, pattern: &str) -> Result<Self, AdapterError> {
        compile(field, pattern, format!("\\A(?:{})\\z", translate(pattern)))
    }

    /// peft's `get_pattern_key` test for one key: `re.match(rf"(.*\.)?({key})$", name)`.
    pub(crate) fn pattern_key(field: &str, key: &str) -> Result<Self, AdapterError> {
        compile(field, key, format!("\\A(?:(.*\\.)?({})$)", translate(key)))
    }

    /// peft's layer-index regex for one `layers_pattern` entry.
    pub(crate) fn layers_pattern(field: &str, pattern: &str) -> Result<Self, AdapterError> {
        compile(field, pattern, format!("\\A(?:(?:^|.*?\\.){}\\.(?P<idx>\\d+)\\.)", translate(pattern)))
    }

    /// peft's layer-index regex without `layers_pattern`: the first numbered segment.
    pub(crate) fn any_layer() -> Result<Self, AdapterError> {
        compile("layers_to_transform", "", r"\A(?:.*?\.[^.]*\.(?P<idx>\d+)\.)".into())
    }

    fn costly(&self, name: &str, e: fancy_regex::Error) -> AdapterError {
        AdapterError::BadConfig {
            field: self.field.clone(),
            expected: format!("a regular expression that matches within {BACKTRACK_LIMIT} backtracking steps"),
            found: format!("{:?} on {name:?} ({e})", self.source),
        }
    }

    /// Whether matching can backtrack (look-around or back-references).
    pub(crate) fn backtracks(&self) -> bool {
        matches!(self.re, Engine::Backtracking(_))
    }

    /// Whether the pattern matches `name` (per the constructor's Python function).
    pub(crate) fn is_match(&self, name: &str) -> Result<bool, AdapterError> {
        match &self.re {
            Engine::Linear(re) => Ok(re.is_match(name)),
            Engine::Backtracking(re) => re.is_match(name).map_err(|e| self.costly(name, e)),
        }
    }

    /// The `idx` group of a layer-index regex, if it matches.
    pub(crate) fn layer_index(&self, name: &str) -> Result<Option<usize>, AdapterError> {
        let idx = match &self.re {
            Engine::Linear(re) => re.captures(name).and_then(|c| c.name("idx").map(|m| m.as_str().to_owned())),
            Engine::Backtracking(re) => {
                let caps = re.captures(name).map_err(|e| self.costly(name, e))?;
                caps.and_then(|c| c.name("idx").map(|m| m.as_str().to_owned()))
            }
        };
        Ok(idx.and_then(|i| i.parse().ok()))
    }
}

/// One position of a regex-free key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Atom {
    /// `.`: any character but a newline.
    Any,
    /// A letter, digit, `_`, or an escaped `\.`.
    Lit(char),
}

/// Whether `key` is a module name (matched without a regular expression).
pub(crate) fn is_plain(key: &str) -> bool {
    plain_atoms(key).is_some()
}

/// The atoms of a key made only of `[A-Za-z0-9_]`, `.` and `\.`, or `None`.
fn plain_atoms(key: &str) -> Option<Vec<Atom>> {
    let mut atoms = Vec::with_capacity(key.len());
    let mut chars = key.chars();
    while let Some(c) = chars.next() {
        atoms.push(match c {
            '.' => Atom::Any,
            '\\' => match chars.next() {
                Some('.') => Atom::Lit('.'),
                _ => return None,
            },
            c if c.is_ascii_alphanumeric() || c == '_' => Atom::Lit(c),
            _ => return None,
        });
    }
    (!atoms.is_empty()).then_some(atoms)
}

/// A `rank_pattern` / `alpha_pattern` key: the regex-free keys every real config has (module
/// names, with `.` or `\.`) are tested without a regex engine, exactly as `(.*\.)?(key)$` would
/// test them.
#[derive(Clone, Debug)]
pub(crate) enum PatternKey {
    /// One atom per character of the matched tail.
    Plain(Vec<Atom>),
    /// Anything else, compiled.
    Regex(PyRegex),
}

impl PatternKey {
    /// Parse the key `key` of the map `field`.
    pub(crate) fn new(field: &str, key: &str) -> Result<Self, AdapterError> {
        match plain_atoms(key) {
            Some(atoms) => Ok(PatternKey::Plain(atoms)),
            None => Ok(PatternKey::Regex(PyRegex::pattern_key(field, key)?)),
        }
    }

    /// `re.match(rf"(.*\.)?({key})$", name)`.
    pub(crate) fn matches(&self, name: &str) -> Result<bool, AdapterError> {
        match self {
            PatternKey::Regex(r) => r.is_match(name),
            PatternKey::Plain(atoms) => {
                // `$` ends the match, so the atoms (one character each) cover the last
                // atoms.len() characters; what precedes is empty or `.*\.`.
                let chars: Vec<char> = name.chars().collect();
                let Some(start) = chars.len().checked_sub(atoms.len()) else { return Ok(false) };
                let tail_ok = atoms.iter().zip(&chars[start..]).all(|(a, &c)| match a {
                    Atom::Any => c != '\n',
                    Atom::Lit(l) => c == *l,
                });
                let head_ok = start == 0 || (chars[start - 1] == '.' && !chars[..start].contains(&'\n'));
                Ok(tail_ok && head_ok)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_keys_agree_with_their_regex() {
        let names = [
            "model.layers.0.self_attn.q_proj",
            "model.layers.10.self_attn.q_proj",
            "model.language_model.layers.1.mlp.up_proj",
            "q_proj",
            "xq_proj",
            "model.layers.11.mlp.up_proj",
        ];
        for key in [
            "q_proj",
            "self_attn.q_proj",
            "1.mlp.up_proj",
            "layers.1.mlp",
            "layers",
            "0.self_attn.q_proj",
            r"layers\.0\.self_attn\.q_proj",
            r"1\.mlp.up_proj",
        ] {
            let plain = PatternKey::new("rank_pattern", key).expect("plain");
            assert!(matches!(plain, PatternKey::Plain(_)));
            let re = PyRegex::pattern_key("rank_pattern", key).expect("regex");
            for name in names {
                assert_eq!(plain.matches(name).ok(), re.is_match(name).ok(), "{key} on {name}");
            }
        }
    }

    #[test]
    fn python_anchors_and_look_around() {
        let re = PyRegex::fullmatch("t", r"^(model\.language_model(?=\.).*\.(q_proj|v_proj))$").expect("compiles");
        assert_eq!(re.is_match("model.language_model.layers.0.self_attn.q_proj").ok(), Some(true));
        assert_eq!(re.is_match("model.layers.0.self_attn.q_proj").ok(), Some(false));
        let z = PyRegex::fullmatch("t", r".*q_proj\Z").expect("\\Z");
        assert_eq!(z.is_match("a.q_proj").ok(), Some(true));
        assert!(PyRegex::fullmatch("t", "(unclosed").is_err());
        assert!(PyRegex::fullmatch("t", &"a".repeat(MAX_PATTERN_BYTES + 1)).is_err());
    }

    #[test]
    fn catastrophic_backtracking_is_a_typed_error() {
        let name = "a".repeat(40);
        for p in [r"(a*)*\1b", r"(a|aa)*(?=b)", r"((?=a)a*)*b"] {
            let re = PyRegex::fullmatch("t", p).expect("compiles");
            assert!(re.backtracks());
            let start = std::time::Instant::now();
            assert!(matches!(re.is_match(&name), Err(AdapterError::BadConfig { .. })), "{p}");
            eprintln!("{p}: refused after {:?}", start.elapsed());
        }
        // Without look-around or back-references, the linear-time engine: no limit is needed.
        let re = PyRegex::fullmatch("t", r"(a|aa)*b").expect("compiles");
        assert!(!re.backtracks());
        assert_eq!(re.is_match(&name).ok(), Some(false));
    }
}
