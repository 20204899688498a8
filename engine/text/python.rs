//! What Python prints for a template value, so that chat templates render as transformers renders
//! them (Jinja2 in Python): `json.dumps` for the `tojson` filter transformers installs
//! (`ensure_ascii=False`, Python's separators, insertion order unless `sort_keys`), `str()` for
//! `{{ value }}` and the `string` filter (`True`, `None`, `2.0`, `['a', 1]`), and `strftime`
//! for `strftime_now`.

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

fn invalid(message: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.into())
}

/// Python's `repr(float)`: the shortest digits that round-trip, positional for exponents in
/// [-4, 16), otherwise `d.ddde±XX`.
pub(crate) fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // Rust's `{:e}` prints the shortest round-trip digits: "1.5e-7", "1e16", "-0e0".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat((-point) as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!("{}.{}", &digits[..point as usize], &digits[point as usize..])
        };
        format!("{sign}{body}")
    } else {
        let mantissa = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{esign}{:02}", exp.abs())
    }
}

fn number_str(v: &Value) -> String {
    if v.is_integer() {
        v.to_string()
    } else {
        float_repr(f64::try_from(v.clone()).unwrap_or(f64::NAN))
    }
}

/// A JSON string literal as Python's `json` writes it.
fn json_string(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{u:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// `json.dumps` options.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
}

/// The deepest nesting `tojson` writes (Python's own limit is the interpreter's recursion limit).
const MAX_JSON_DEPTH: usize = 512;

/// The most text one value may become (`{{ value }}`, `string`, `tojson`, `indent`): a template
/// that writes a list of 10^12 items, or a list doubled 64 times, gets an error instead of the
/// memory or the time it asks for. A rendered chat prompt is far smaller.
pub(crate) const MAX_TEXT_BYTES: usize = 16 << 20;

/// The widest `indent` filter accepted.
const MAX_INDENT_WIDTH: usize = 1024;

fn too_long(what: &str) -> Error {
    invalid(format!("{what}: the text would pass {MAX_TEXT_BYTES} bytes"))
}

/// Append `s` to `out` within [`MAX_TEXT_BYTES`].
fn push(out: &mut String, s: &str, what: &str) -> Result<(), Error> {
    if out.len() + s.len() > MAX_TEXT_BYTES {
        return Err(too_long(what));
    }
    out.push_str(s);
    Ok(())
}

fn json_key(key: &Value) -> Result<String, Error> {
    Ok(match key.kind() {
        ValueKind::String => key.as_str().unwrap_or_default().to_string(),
        ValueKind::Number => number_str(key),
        ValueKind::Bool => if key.is_true() { "true" } else { "false" }.to_string(),
        ValueKind::None => "null".to_string(),
        other => return Err(invalid(format!("keys must be str, int, float, bool or None, not {other}"))),
    })
}

fn json_value(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) -> Result<(), Error> {
    const WHAT: &str = "tojson";
    if depth > MAX_JSON_DEPTH {
        return Err(invalid("tojson: value nested too deeply"));
    }
    if out.len() > MAX_TEXT_BYTES {
        return Err(too_long(WHAT));
    }
    let newline = |out: &mut String, level: usize| -> Result<(), Error> {
        if let Some(indent) = &style.indent {
            if out.len() + 1 + level * indent.len() > MAX_TEXT_BYTES {
                return Err(too_long(WHAT));
            }
            out.push('\n');
            for _ in 0..level {
                out.push_str(indent);
            }
        }
        Ok(())
    };
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&number_str(v)),
        ValueKind::String => {
            let text = v.as_str().unwrap_or_default();
            // Escapes take at most 12 bytes a character.
            if out.len() + text.len() > MAX_TEXT_BYTES {
                return Err(too_long(WHAT));
            }
            json_string(out, text, style.ensure_ascii)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            // Item by item (never collected: a lazy `[0] * 10**12` reports its whole length).
            let mut empty = true;
            for (i, item) in v.try_iter()?.enumerate() {
                push(out, if i > 0 { &style.item_sep } else { "[" }, WHAT)?;
                newline(out, depth + 1)?;
                json_value(out, &item, style, depth + 1)?;
                empty = false;
            }
            if empty {
                out.push_str("[]");
                return Ok(());
            }
            newline(out, depth)?;
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in v.try_iter()? {
                if entries.len() * 2 > MAX_TEXT_BYTES {
                    return Err(too_long(WHAT));
                }
                let item = v.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, (key, item)) in entries.iter().enumerate() {
                if i > 0 {
                    push(out, &style.item_sep, WHAT)?;
                }
                newline(out, depth + 1)?;
                if out.len() + key.len() > MAX_TEXT_BYTES {
                    return Err(too_long(WHAT));
                }
                json_string(out, key, style.ensure_ascii);
                push(out, &style.key_sep, WHAT)?;
                json_value(out, item, style, depth + 1)?;
            }
            newline(out, depth)?;
            out.push('}');
        }
        other => return Err(invalid(format!("tojson: object of type {other} is not JSON serializable"))),
    }
    Ok(())
}

/// The `tojson` filter transformers installs: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, arguments by position or keyword.
pub(crate) fn tojson(value: &Value, args: &[Value], kwargs: Kwargs) -> Result<String, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(invalid(format!("tojson takes at most {} arguments, {} given", NAMES.len(), args.len())));
    }
    let arg = |i: usize| -> Result<Option<Value>, Error> {
        match (args.get(i), kwargs.get::<Option<Value>>(NAMES[i])?) {
            (Some(_), Some(_)) => Err(invalid(format!("tojson got multiple values for {}", NAMES[i]))),
            (Some(v), None) => Ok(Some(v.clone())),
            (None, v) => Ok(v),
        }
    };
    let ensure_ascii = arg(0)?.is_some_and(|v| v.is_true());
    let indent = match arg(1)? {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.clamp(0, 64) as usize)),
            None => return Err(invalid(format!("tojson: indent must be an int or a string, not {v}"))),
        },
    };
    let (item_sep, key_sep) = match arg(2)? {
        Some(v) if !v.is_none() => {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [a, b] if a.as_str().is_some() && b.as_str().is_some() => {
                    (a.as_str().unwrap_or_default().to_string(), b.as_str().unwrap_or_default().to_string())
                }
                _ => return Err(invalid(format!("tojson: separators must be two strings, not {v}"))),
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let sort_keys = arg(3)?.is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let style = JsonStyle { ensure_ascii, indent, item_sep, key_sep, sort_keys };
    let mut out = String::new();
    json_value(&mut out, value, &style, 0)?;
    Ok(out)
}

/// Python's `str.isprintable()` for one character: not a control, format, private-use or
/// surrogate character nor a separator, the space excepted. Unassigned code points, which
/// Python also escapes, are printed as they are, and so are the few format characters newer
/// than `unicode_categories`' tables (U+0890, U+0891 of Unicode 14): which are which depends on
/// the Unicode version, and Python's tables differ from this crate's.
fn py_printable(c: char) -> bool {
    use unicode_categories::UnicodeCategories;
    c == ' ' || !(c.is_other_control() || c.is_other_format() || c.is_other_private_use() || c.is_separator())
}

/// Python's `repr(str)`.
fn str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if !py_printable(c) => {
                let _ = match c as u32 {
                    n @ 0..=0xff => write!(out, "\\x{n:02x}"),
                    n @ 0x100..=0xffff => write!(out, "\\u{n:04x}"),
                    n => write!(out, "\\U{n:08x}"),
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

fn py_write(out: &mut String, v: &Value, repr: bool, depth: usize) -> Result<(), Error> {
    const WHAT: &str = "str()";
    if out.len() > MAX_TEXT_BYTES {
        return Err(too_long(WHAT));
    }
    if depth > MAX_JSON_DEPTH {
        out.push_str("...");
        return Ok(());
    }
    match v.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        ValueKind::Number => out.push_str(&number_str(v)),
        ValueKind::String if repr => {
            let text = v.as_str().unwrap_or_default();
            // Escapes take at most 4 bytes a character.
            if out.len() + text.len() > MAX_TEXT_BYTES {
                return Err(too_long(WHAT));
            }
            str_repr(out, text)
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    push(out, ", ", WHAT)?;
                }
                py_write(out, &item, true, depth + 1)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    push(out, ", ", WHAT)?;
                }
                py_write(out, &key, true, depth + 1)?;
                push(out, ": ", WHAT)?;
                py_write(out, &v.get_item(&key).unwrap_or_default(), true, depth + 1)?;
            }
            out.push('}');
        }
        _ => write!(Bounded(out), "{v}").map_err(|_| too_long(WHAT))?,
    }
    Ok(())
}

/// A `fmt::Write` into a string that fails past [`MAX_TEXT_BYTES`].
struct Bounded<'a>(&'a mut String);

impl std::fmt::Write for Bounded<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        if self.0.len() + s.len() > MAX_TEXT_BYTES {
            return Err(std::fmt::Error);
        }
        self.0.push_str(s);
        Ok(())
    }
}

/// Python's `str(value)` (the text `{{ value }}` and the `string` filter produce), within
/// [`MAX_TEXT_BYTES`].
pub(crate) fn py_str(v: &Value) -> Result<String, Error> {
    let mut out = String::new();
    py_write(&mut out, v, false, 0)?;
    Ok(out)
}

/// Python's `str.isspace` for one character: Rust's whitespace and the four separators
/// U+001C..U+001F.
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `str.isspace()`: not empty, and every character whitespace.
pub(crate) fn py_isspace_str(s: &str) -> bool {
    !s.is_empty() && s.chars().all(py_isspace)
}

/// Python's `str.splitlines()`: split at `\n`, `\r\n`, `\r`, `\v`, `\f`, U+001C..U+001E,
/// U+0085, U+2028 and U+2029, without a last empty line after a final break.
fn py_splitlines(s: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        let end = match c {
            '\r' if chars.peek().is_some_and(|&(_, n)| n == '\n') => {
                chars.next();
                i + 2
            }
            '\n' | '\r' | '\u{b}' | '\u{c}' | '\u{1c}' | '\u{1d}' | '\u{1e}' | '\u{85}' | '\u{2028}' | '\u{2029}' => {
                i + c.len_utf8()
            }
            _ => continue,
        };
        lines.push(&s[start..i]);
        start = end;
    }
    if start < s.len() {
        lines.push(&s[start..]);
    }
    lines
}

/// The characters Python's `str.strip(chars)` removes: those of `chars`, or whitespace as
/// `str.isspace` has it when `chars` is none.
fn py_strip_set(chars: Option<&str>) -> impl Fn(char) -> bool + '_ {
    move |c| chars.map_or(py_isspace(c), |set| set.contains(c))
}

/// How many times Python's `str.count(sub)` finds `sub` in `s` (`""` between every two
/// characters and at both ends).
fn py_count(s: &str, sub: &str) -> usize {
    if sub.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(sub).count()
    }
}

/// Jinja2's `trim` filter: Python's `str.strip(chars)`.
pub(crate) fn trim(value: &Value, chars: Option<String>) -> Result<String, Error> {
    Ok(py_str(value)?.trim_matches(py_strip_set(chars.as_deref())).to_string())
}

/// Jinja2's `indent` filter (`do_indent`: `width` spaces or a string, `first`, `blank`, by
/// position or keyword; lines as `str.splitlines` cuts them after a `\n` is appended), with the
/// indentation at most [`MAX_INDENT_WIDTH`] bytes and the text within [`MAX_TEXT_BYTES`].
pub(crate) fn indent(
    value: &Value,
    width: Option<Value>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<String, Error> {
    let width = match width {
        Some(w) => Some(w),
        None => kwargs.get::<Option<Value>>("width")?,
    };
    let first = match first {
        Some(f) => f,
        None => kwargs.get::<Option<bool>>("first")?.unwrap_or(false),
    };
    let blank = match blank {
        Some(b) => b,
        None => kwargs.get::<Option<bool>>("blank")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let indention = match width {
        None => " ".repeat(4),
        Some(w) => match w.as_str() {
            Some(s) if s.len() <= MAX_INDENT_WIDTH => s.to_string(),
            Some(s) => {
                return Err(invalid(format!("indent: width of {} bytes, more than {MAX_INDENT_WIDTH}", s.len())))
            }
            None => {
                let n = usize::try_from(w.clone())
                    .map_err(|_| invalid(format!("indent: width {w}, expected a count or a string")))?;
                if n > MAX_INDENT_WIDTH {
                    return Err(invalid(format!("indent: width {n}, more than {MAX_INDENT_WIDTH}")));
                }
                " ".repeat(n)
            }
        },
    };
    let mut text = py_str(value)?;
    text.push('\n');
    let lines = py_splitlines(&text);
    if text.len() + lines.len() * (indention.len() + 1) > MAX_TEXT_BYTES {
        return Err(too_long("indent"));
    }
    let mut out = String::with_capacity(text.len() + lines.len() * (indention.len() + 1));
    if first {
        out.push_str(&indention);
    }
    if blank {
        out.push_str(&lines.join(&format!("\n{indention}")));
    } else {
        let mut it = lines.iter();
        out.push_str(it.next().copied().unwrap_or_default());
        for line in it {
            out.push('\n');
            if !line.is_empty() {
                out.push_str(&indention);
            }
            out.push_str(line);
        }
    }
    Ok(out)
}

/// Days since 1970-01-01 → (year, month 1–12, day 1–31) in the proleptic Gregorian calendar.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

/// Days since 1970-01-01 of (year, month, day).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Python's `datetime.strftime` for `unix_seconds` (UTC: the engine has no time-zone database;
/// a template that needs the user's local date gets it as a variable): `%Y %y %m %B %b %d %e %j
/// %A %a %w %u %H %I %M %S %p %F %D %T %R %c %x %X %Z %z %n %t %%` (C locale), with glibc's
/// `%-d`-style unpadded forms; any other directive is an error.
pub(crate) fn strftime(format: &str, unix_seconds: i64) -> Result<String, Error> {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut d = chars.next().ok_or_else(|| invalid("strftime_now: format ends with '%'"))?;
        let pad = d != '-';
        if !pad {
            d = chars.next().ok_or_else(|| invalid("strftime_now: format ends with '%-'"))?;
        }
        let num = |n: i64, width: usize| if pad { format!("{n:0width$}") } else { n.to_string() };
        let text = match d {
            'Y' => year.to_string(),
            'y' => num(year.rem_euclid(100), 2),
            'm' => num(i64::from(month), 2),
            'B' => MONTHS[month as usize - 1].to_string(),
            'b' | 'h' => MONTHS[month as usize - 1][..3].to_string(),
            'd' => num(i64::from(day), 2),
            'e' => format!("{day:>2}"),
            'j' => num(yday, 3),
            'A' => WEEKDAYS[weekday].to_string(),
            'a' => WEEKDAYS[weekday][..3].to_string(),
            'w' => ((weekday + 1) % 7).to_string(),
            'H' => num(hour, 2),
            'I' => num((hour + 11) % 12 + 1, 2),
            'M' => num(minute, 2),
            'S' => num(second, 2),
            'p' => if hour < 12 { "AM" } else { "PM" }.to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'D' | 'x' => format!("{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            'T' | 'X' => format!("{hour:02}:{minute:02}:{second:02}"),
            'R' => format!("{hour:02}:{minute:02}"),
            'c' => format!(
                "{} {} {day:>2} {hour:02}:{minute:02}:{second:02} {year}",
                &WEEKDAYS[weekday][..3],
                &MONTHS[month as usize - 1][..3]
            ),
            'u' => (weekday + 1).to_string(),
            'Z' => "UTC".to_string(),
            'z' => "+0000".to_string(),
            'n' => "\n".to_string(),
            't' => "\t".to_string(),
            '%' => "%".to_string(),
            other => return Err(invalid(format!("strftime_now: unsupported directive %{other}"))),
        };
        push(&mut out, &text, "strftime_now")?;
    }
    Ok(out)
}

/// Python's string methods where minijinja-contrib's `pycompat` differs from Python or has no
/// bound: `strip` / `lstrip` / `rstrip` and `split()` with Python's whitespace, `find` / `rfind`
/// as character indices, `splitlines` at every line boundary, `count` (of `""` too, which looped
/// forever there) and `replace` within [`MAX_TEXT_BYTES`]. Every other method is `pycompat`'s.
pub(crate) fn method(state: &minijinja::State, value: &Value, name: &str, args: &[Value]) -> Result<Value, Error> {
    let Some(s) = value.as_str() else {
        return minijinja_contrib::pycompat::unknown_method_callback(state, value, name, args);
    };
    let chars_arg = |at: usize| -> Result<Option<String>, Error> {
        match args.get(at) {
            None => Ok(None),
            Some(v) if v.is_none() => Ok(None),
            Some(v) => v.as_str().map(|c| Some(c.to_string())).ok_or_else(|| invalid(format!("{name}: a string"))),
        }
    };
    let text_arg = |at: usize| -> Result<&str, Error> {
        args.get(at).and_then(Value::as_str).ok_or_else(|| invalid(format!("{name}: a string argument")))
    };
    let char_index = |byte: Option<usize>| byte.map_or(-1, |b| s[..b].chars().count() as i64);
    let arity = |most: usize| {
        if args.len() > most {
            return Err(invalid(format!("{name}: at most {most} arguments, {} given", args.len())));
        }
        Ok(())
    };
    match name {
        "strip" | "lstrip" | "rstrip" => {
            arity(1)?;
            let chars = chars_arg(0)?;
            let set = py_strip_set(chars.as_deref());
            let out = match name {
                "strip" => s.trim_matches(set),
                "lstrip" => s.trim_start_matches(set),
                _ => s.trim_end_matches(set),
            };
            Ok(Value::from(out))
        }
        "split" if args.first().is_none_or(Value::is_none) && args.len() <= 1 => {
            Ok(s.split(py_isspace).filter(|w| !w.is_empty()).map(Value::from).collect())
        }
        "find" => {
            arity(1)?;
            Ok(Value::from(char_index(s.find(text_arg(0)?))))
        }
        "rfind" => {
            arity(1)?;
            Ok(Value::from(char_index(s.rfind(text_arg(0)?))))
        }
        "splitlines" if args.is_empty() => Ok(py_splitlines(s).into_iter().map(Value::from).collect()),
        "count" => {
            arity(1)?;
            Ok(Value::from(py_count(s, text_arg(0)?)))
        }
        "replace" if args.len() == 2 => {
            let (old, new) = (text_arg(0)?, text_arg(1)?);
            let len = py_count(s, old).checked_mul(new.len()).and_then(|grow| grow.checked_add(s.len()));
            if len.is_none_or(|l| l > MAX_TEXT_BYTES) {
                return Err(too_long("replace"));
            }
            minijinja_contrib::pycompat::unknown_method_callback(state, value, name, args)
        }
        _ => minijinja_contrib::pycompat::unknown_method_callback(state, value, name, args),
    }
}

#[cfg(test)]
mod tests {
    use super::{float_repr, strftime};

    #[test]
    fn floats_print_as_python_repr() {
        for (x, want) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (2.5e-5, "2.5e-05"),
            (0.0001, "0.0001"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (-0.0, "-0.0"),
            (-3.25, "-3.25"),
            (1e-7, "1e-07"),
            (f64::INFINITY, "Infinity"),
        ] {
            assert_eq!(float_repr(x), want, "{x}");
        }
    }

    #[test]
    fn strftime_matches_python_on_fixed_dates() {
        // python3 -c "import datetime as d; print(d.datetime.fromtimestamp(T, d.UTC).strftime(F))"
        assert_eq!(strftime("%d %b %Y", 0).expect("fmt"), "01 Jan 1970");
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %A %B %j %p %I %y %w %%", 1_796_157_296).expect("fmt"),
            "2026-12-01 20:34:56 Tue Tuesday December 335 PM 08 26 2 %"
        );
        assert_eq!(strftime("%-d %-m", 951_782_400).expect("fmt"), "29 2");
        assert_eq!(
            strftime("%F %T %D %R %c %x %X %u %Z %z", 1_796_157_296).expect("fmt"),
            "2026-12-01 20:34:56 12/01/26 20:34 Tue Dec  1 20:34:56 2026 12/01/26 20:34:56 2 UTC +0000"
        );
        assert!(strftime("%Q", 0).is_err());
        // Each %c writes 24 bytes: a format that would write past the text bound is refused.
        let long = "%c".repeat(super::MAX_TEXT_BYTES / 24 + 1);
        assert!(strftime(&long, 0).expect_err("past the bound").to_string().contains("strftime_now"));
        assert_eq!(strftime(&"%c".repeat(4), 0).expect("fmt").len(), 96);
    }
}
