//! Mutations of a safetensors file: each takes the valid bytes, the generator and the variant
//! number and returns the new bytes, a description, and whether the result is invalid by the
//! safetensors format (so a load that succeeds is itself a fault).

use serde_json::{json, Value};

use super::rng::Rng;
use super::st::{assemble, dtype_size, encode, Entry, St};

/// A mutated file.
pub struct Mutated {
    /// The new bytes.
    pub bytes: Vec<u8>,
    /// What was done.
    pub detail: String,
    /// The format forbids the result (truncated, overlapping, holes, wrong length field…).
    pub must_fail: bool,
}

fn out(bytes: Vec<u8>, detail: String, must_fail: bool) -> Mutated {
    Mutated { bytes, detail, must_fail }
}

/// Flip 1–8 bits, mostly in the header.
pub fn bitflip(bytes: &[u8], st: &St, rng: &mut Rng) -> Mutated {
    let mut b = bytes.to_vec();
    let header_end = (8 + st.header_len as usize).min(b.len());
    let n = 1 + rng.below(8);
    let mut at = Vec::new();
    for _ in 0..n {
        let pos = if rng.chance(7, 10) { rng.below(header_end) } else { rng.below(b.len()) };
        let bit = rng.below(8);
        b[pos] ^= 1 << bit;
        at.push(format!("{pos}:{bit}"));
    }
    out(b, format!("flip bits [{}]", at.join(", ")), false)
}

/// Every place a reader changes state: the length field, the header's structure, each tensor's
/// begin and end (±1).
fn boundaries(bytes: &[u8], st: &St) -> Vec<usize> {
    let h = 8 + st.header_len as usize;
    let mut b: Vec<usize> = vec![0, 1, 4, 7, 8, 9, h - 1, h, h + 1, bytes.len() - 1];
    let text = &bytes[8..h];
    let structural: Vec<usize> =
        text.iter().enumerate().filter(|(_, c)| b"{}[],:\"".contains(c)).map(|(i, _)| 8 + i).collect();
    let step = (structural.len() / 64).max(1);
    b.extend(structural.iter().step_by(step).flat_map(|&i| [i, i + 1]));
    for e in st.entries().iter().take(24) {
        for o in [e.begin, e.end] {
            let o = h + o as usize;
            b.extend([o.saturating_sub(1), o, o + 1]);
        }
    }
    b.retain(|&x| x < bytes.len());
    b.sort_unstable();
    b.dedup();
    b
}

/// Cut the file at one of its boundaries (variant-th).
pub fn truncate(bytes: &[u8], st: &St, variant: usize) -> Mutated {
    let b = boundaries(bytes, st);
    let at = b[variant % b.len()];
    out(bytes[..at].to_vec(), format!("truncate at byte {at} of {} ({} boundaries)", bytes.len(), b.len()), true)
}

/// Rewrite the 8-byte header length.
pub fn header_len(bytes: &[u8], st: &St, variant: usize) -> Mutated {
    let hl = st.header_len;
    let len = bytes.len() as u64;
    let values = [
        ("zero", 0),
        ("one", 1),
        ("one short", hl - 1),
        ("one long", hl + 1),
        ("seven long", hl + 7),
        ("odd", hl | 1),
        ("double", hl * 2),
        ("file minus 8", len - 8),
        ("file minus 7", len - 7),
        ("file length", len),
        ("at the 100 MB bound", 100_000_000),
        ("one past the 100 MB bound", 100_000_001),
        ("2^32", 1 << 32),
        ("2^32 + len", (1 << 32) + hl),
        ("2^63", 1 << 63),
        ("high bit + len", (1 << 63) | hl),
        ("i64::MAX", i64::MAX as u64),
        ("u64::MAX", u64::MAX),
        ("two short", hl - 2),
        ("eight short", hl - 8),
    ];
    let (name, v) = values[variant % values.len()];
    let mut b = bytes.to_vec();
    b[..8].copy_from_slice(&v.to_le_bytes());
    out(b, format!("header length {name}: {v} (was {hl})"), v != hl)
}

fn set_offsets(st: &mut St, name: &str, v: Value) {
    if let Some(e) = st.header.get_mut(name).and_then(Value::as_object_mut) {
        e.insert("data_offsets".into(), v);
    }
}

fn pick_entry<'a>(entries: &'a [Entry], rng: &mut Rng) -> &'a Entry {
    rng.pick(entries)
}

/// Edit one tensor's `data_offsets`.
pub fn offsets(bytes: &[u8], rng: &mut Rng, variant: usize) -> Mutated {
    let mut st = St::parse(bytes).unwrap_or_else(|| unreachable!("fixture parsed before"));
    let entries = st.entries();
    let e = pick_entry(&entries, rng);
    let o = pick_entry(&entries, rng);
    let data_len = st.data.len() as u64;
    let size = e.end - e.begin;
    let same_size = entries.iter().find(|x| x.name != e.name && x.end - x.begin == size);
    let (what, v, must_fail): (&str, Value, bool) = match variant % 17 {
        0 => ("begin > end", json!([e.end + 1, e.end]), true),
        1 => ("end past the data", json!([e.begin, data_len + 1]), true),
        2 => ("end u64::MAX", json!([e.begin, u64::MAX]), true),
        3 => ("both u64::MAX", json!([u64::MAX, u64::MAX]), true),
        4 => ("shifted +1", json!([e.begin + 1, e.end + 1]), true),
        5 => ("shifted -1", json!([e.begin.saturating_sub(1), e.end.saturating_sub(1)]), e.begin > 0),
        6 => ("another tensor's offsets", json!([o.begin, o.end]), o.name != e.name),
        7 => match same_size {
            Some(x) => ("aliasing a same-size tensor", json!([x.begin, x.end]), true),
            None => ("begin at the other's begin", json!([o.begin, o.begin + size]), o.begin != e.begin),
        },
        8 => ("negative begin", json!([-1, e.end]), true),
        9 => ("float begin", json!([e.begin as f64 + 0.5, e.end]), true),
        10 => ("string begin", json!([e.begin.to_string(), e.end]), true),
        11 => ("one element", json!([e.begin]), true),
        12 => ("three elements", json!([e.begin, e.end, e.end]), true),
        13 => ("null", Value::Null, true),
        14 => ("beyond 2^53", json!([(1u64 << 53) + 1, (1u64 << 53) + 1 + size]), true),
        15 => {
            // Swap with a same-size tensor: still a valid file, with other values.
            if let Some(x) = same_size {
                let (xb, xe) = (x.begin, x.end);
                let xn = x.name.clone();
                set_offsets(&mut st, &xn, json!([e.begin, e.end]));
                ("swapped with a same-size tensor", json!([xb, xe]), false)
            } else {
                ("unchanged (no same-size tensor)", json!([e.begin, e.end]), false)
            }
        }
        _ => {
            for x in &entries {
                set_offsets(&mut st, &x.name, json!([0, x.end - x.begin]));
            }
            ("every tensor at offset 0", json!([0, size]), entries.len() > 1)
        }
    };
    set_offsets(&mut st, &e.name, v);
    out(st.to_bytes(), format!("{}: data_offsets {what}", e.name), must_fail)
}

/// Change one tensor's dtype (with the end offset kept, or resized to the new element size).
pub fn dtype(bytes: &[u8], rng: &mut Rng, variant: usize) -> Mutated {
    let mut st = St::parse(bytes).unwrap_or_else(|| unreachable!("fixture parsed before"));
    let entries = st.entries();
    let e = pick_entry(&entries, rng);
    let dtypes: [Value; 21] = [
        json!("F16"),
        json!("BF16"),
        json!("F32"),
        json!("F64"),
        json!("I8"),
        json!("U8"),
        json!("I16"),
        json!("U32"),
        json!("I64"),
        json!("BOOL"),
        json!("F8_E4M3"),
        json!("F8_E5M2"),
        json!("F4"),
        json!("Q4_0"),
        json!(""),
        json!("f32"),
        json!("float32"),
        Value::Null,
        json!(7),
        json!(["F32"]),
        json!({}),
    ];
    let d = &dtypes[variant % dtypes.len()];
    let resize = (variant / dtypes.len()) % 2 == 1;
    let numel: u64 = e.shape.iter().product();
    let new = d.as_str().and_then(dtype_size);
    let mut end = e.end;
    if let (true, Some(n)) = (resize, new) {
        end = e.begin + numel * n;
    }
    let entry = st.header.get_mut(&e.name).and_then(Value::as_object_mut);
    if let Some(entry) = entry {
        entry.insert("dtype".into(), d.clone());
        entry.insert("data_offsets".into(), json!([e.begin, end]));
    }
    // Valid only with a known dtype whose byte count matches the unchanged offsets.
    let must_fail = !new.is_some_and(|n| n * numel == e.end - e.begin && end == e.end);
    out(
        st.to_bytes(),
        format!("{}: dtype {} -> {d}{}", e.name, e.dtype, if resize { ", end resized" } else { "" }),
        must_fail,
    )
}

/// Change one tensor's shape.
pub fn shape(bytes: &[u8], rng: &mut Rng, variant: usize) -> Mutated {
    let mut st = St::parse(bytes).unwrap_or_else(|| unreachable!("fixture parsed before"));
    let entries: Vec<Entry> = st.entries().into_iter().filter(|e| !e.shape.is_empty()).collect();
    let e = pick_entry(&entries, rng);
    let s = &e.shape;
    let last = s.len() - 1;
    let with0 = |v: u64| {
        let mut x = s.clone();
        x[0] = v;
        json!(x)
    };
    let (what, v): (&str, Value) = match variant % 16 {
        0 => ("dim 0 = 0", with0(0)),
        1 => ("dim 0 + 1", with0(s[0] + 1)),
        2 => ("dim 0 - 1", with0(s[0].saturating_sub(1))),
        3 => ("dim 0 = 2^63", with0(1 << 63)),
        4 => ("dim 0 = u64::MAX", with0(u64::MAX)),
        5 => ("product overflows", json!([1u64 << 32, 1u64 << 32, 16])),
        6 => ("reversed (same bytes)", json!(s.iter().rev().collect::<Vec<_>>())),
        7 => ("trailing 1 (same bytes)", json!(s.iter().chain([&1]).collect::<Vec<_>>())),
        8 => ("last dim dropped", json!(s[..last].to_vec())),
        9 => ("scalar []", json!([])),
        10 => ("negative", json!([-1, s[last]])),
        11 => ("float", json!([s[0] as f64 + 0.5, s[last]])),
        12 => ("string", json!([s[0].to_string()])),
        13 => ("null", Value::Null),
        14 if s.len() == 2 && s[1].is_multiple_of(2) => {
            ("reshaped [2a, b/2] (same bytes)", json!([s[0] * 2, s[1] / 2]))
        }
        14 => ("dim 0 doubled", with0(s[0] * 2)),
        _ => ("flattened (same bytes)", json!([s.iter().product::<u64>()])),
    };
    let same_bytes = v
        .as_array()
        .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
        .is_some_and(|d| d.iter().try_fold(1u64, |a, &x| a.checked_mul(x)) == Some(s.iter().product()));
    if let Some(entry) = st.header.get_mut(&e.name).and_then(Value::as_object_mut) {
        entry.insert("shape".into(), v.clone());
    }
    out(st.to_bytes(), format!("{}: shape {s:?} -> {v} ({what})", e.name), !same_bytes)
}

/// The same key twice in the header text, or one module under both key prefixes.
pub fn dup_key(bytes: &[u8], rng: &mut Rng, variant: usize) -> Mutated {
    let mut st = St::parse(bytes).unwrap_or_else(|| unreachable!("fixture parsed before"));
    let entries = st.entries();
    let e = pick_entry(&entries, rng);
    let o = pick_entry(&entries, rng);
    let text = st.header_text();
    let value = |name: &str| serde_json::to_string(&st.header[name]).unwrap_or_default();
    let key = serde_json::to_string(&e.name).unwrap_or_default();
    let body = &text[1..];
    let (what, header, must_fail) = match variant % 5 {
        0 => ("duplicate, same value", format!("{{{key}:{},{body}", value(&e.name)), false),
        1 => {
            let t = text.trim_end_matches('}');
            ("duplicate last with another tensor's entry", format!("{t},{key}:{}}}", value(&o.name)), false)
        }
        2 => {
            let t = text.trim_end_matches('}');
            ("duplicate __metadata__", format!("{t},\"__metadata__\":{{\"r\":\"2\",\"lora_alpha\":\"nan\"}}}}"), false)
        }
        3 => ("duplicate, first copy invalid", format!("{{{key}:{{\"dtype\":7}},{body}"), false),
        _ => {
            // The same module (its A and B) under the other text prefix, at the same bytes.
            let swaps = [
                ("model.language_model.layers.", "model.layers."),
                ("language_model.model.layers.", "model.layers."),
                ("model.layers.", "model.language_model.layers."),
            ];
            let twin = |n: &str| match swaps.iter().find(|(a, _)| n.contains(a)) {
                Some((a, b)) => n.replacen(a, b, 1),
                None => format!("{n}.twin"),
            };
            let module = e.name.split(".lora_").next().unwrap_or(&e.name).to_string();
            let twins: Vec<(String, Value)> = entries
                .iter()
                .filter(|x| x.name == e.name || x.name.starts_with(&format!("{module}.lora_")))
                .map(|x| (twin(&x.name), st.header[&x.name].clone()))
                .collect();
            for (k, v) in twins {
                st.header.insert(k, v);
            }
            ("module under both key prefixes", st.header_text(), true)
        }
    };
    out(assemble(&header, &st.data), format!("{}: {what}", e.name), must_fail)
}

/// Rename, remove or add a key.
pub fn key_edit(bytes: &[u8], rng: &mut Rng, variant: usize) -> Mutated {
    let mut st = St::parse(bytes).unwrap_or_else(|| unreachable!("fixture parsed before"));
    let entries = st.entries();
    let e = pick_entry(&entries, rng);
    let layer_of = |name: &str, to: &str| -> String {
        match name.find("layers.") {
            Some(i) => {
                let rest = &name[i + 7..];
                let digits = rest.find('.').unwrap_or(rest.len());
                format!("{}layers.{to}{}", &name[..i], &rest[digits..])
            }
            None => format!("{name}.layers.{to}"),
        }
    };
    let renames: Vec<(&str, String)> = vec![
        ("layer = 8", layer_of(&e.name, "8")),
        ("layer = 64", layer_of(&e.name, "64")),
        ("layer = 2^32", layer_of(&e.name, "4294967296")),
        ("layer overflows u64", layer_of(&e.name, "18446744073709551616")),
        ("layer = 10^23", layer_of(&e.name, "99999999999999999999999")),
        ("layer = -1", layer_of(&e.name, "-1")),
        ("layer = 01", layer_of(&e.name, "01")),
        ("layer empty", layer_of(&e.name, "")),
        ("unknown projection", e.name.replace("_proj", "_prof").replace("in_proj", "in_prof")),
        ("base_layer inserted", e.name.replace(".lora_", ".base_layer.lora_")),
        ("lora_A -> lora_C", e.name.replace("lora_A", "lora_C").replace("lora_a", "lora_c")),
        ("lora bias", e.name.replace(".weight", ".bias")),
        ("DoRA magnitude", e.name.replace("lora_A.weight", "lora_magnitude_vector").replace("lora_a", "m")),
        (
            "vision tower",
            format!("base_model.model.model.visual.blocks.0.attn.qkv.{}", e.name.rsplit('.').next().unwrap_or("")),
        ),
        ("lm_head", "base_model.model.lm_head.lora_A.weight".into()),
        ("embed_tokens", "base_model.model.model.embed_tokens.lora_embedding_A".into()),
        ("full weight (modules_to_save)", "base_model.model.model.layers.0.mlp.down_proj.weight".into()),
        ("empty key", String::new()),
        ("64 KiB key", format!("{}{}", e.name, "x".repeat(65536))),
        ("non-ASCII", e.name.replace("layers", "läyers")),
        ("renamed __metadata__", "__metadata__".into()),
    ];
    let n = renames.len() + 2;
    let v = variant % n;
    let (what, must_fail) = if v < renames.len() {
        let (what, to) = &renames[v];
        if let Some(val) = st.header.shift_remove(&e.name) {
            st.header.insert(to.clone(), val);
        }
        (format!("renamed to {:?} ({what})", truncated(to)), false)
    } else if v == renames.len() {
        st.header.shift_remove(&e.name);
        ("removed".to_string(), false)
    } else {
        for x in &entries {
            st.header.shift_remove(&x.name);
        }
        ("every tensor removed".to_string(), true)
    };
    out(st.to_bytes(), format!("{}: {what}", e.name), must_fail)
}

fn truncated(s: &str) -> String {
    if s.len() > 120 {
        format!("{}…", &s[..s.char_indices().nth(120).map_or(s.len(), |(i, _)| i)])
    } else {
        s.to_string()
    }
}

/// Replace `__metadata__` (a lone adapter file's config) with hostile values.
pub fn metadata(bytes: &[u8], variant: usize) -> Mutated {
    let mut st = St::parse(bytes).unwrap_or_else(|| unreachable!("fixture parsed before"));
    let many: serde_json::Map<String, Value> = (0..10_000).map(|i| (format!("k{i}"), json!("v"))).collect();
    let values = [
        Value::Null,
        json!([]),
        json!("x"),
        json!({}),
        json!({"r": "nan"}),
        json!({"r": "8", "lora_alpha": "nan"}),
        json!({"r": "8", "lora_alpha": "inf"}),
        json!({"r": "8", "lora_alpha": "-inf"}),
        json!({"r": "8", "lora_alpha": "1e30"}),
        json!({"r": "8", "lora_alpha": "-16"}),
        json!({"r": "8", "lora_alpha": "0"}),
        json!({"r": "8", "lora_alpha": "abc"}),
        json!({"r": "8", "lora_alpha": ""}),
        json!({"r": "8", "lora_alpha": "1e-45"}),
        json!({"r": "8", "lora_alpha": "  32  "}),
        json!({"r": "0"}),
        json!({"r": "-8"}),
        json!({"r": "8.5"}),
        json!({"r": "1e20"}),
        json!({"r": "18446744073709551616"}),
        json!({"r": "4"}),
        json!({"r": 8}),
        json!({"r": {"a": "b"}}),
        json!({"r": "8", "use_rslora": "True"}),
        json!({"lora_alpha": "16"}),
        Value::Object(many),
    ];
    let v = &values[variant % values.len()];
    st.header.insert("__metadata__".into(), v.clone());
    let shown = if v.as_object().is_some_and(|o| o.len() > 100) { "10000 keys".to_string() } else { v.to_string() };
    out(st.to_bytes(), format!("__metadata__ = {shown}"), false)
}

/// Write hostile values into one tensor's data.
pub fn values(bytes: &[u8], rng: &mut Rng, variant: usize) -> Mutated {
    let mut st = St::parse(bytes).unwrap_or_else(|| unreachable!("fixture parsed before"));
    let entries: Vec<Entry> = st.entries().into_iter().filter(|e| e.end > e.begin).collect();
    let floats: Vec<&Entry> =
        entries.iter().filter(|e| ["F32", "F16", "BF16", "F64"].contains(&e.dtype.as_str())).collect();
    let e = if floats.is_empty() || rng.chance(1, 10) { pick_entry(&entries, rng) } else { *rng.pick(&floats) };
    let size = dtype_size(&e.dtype).unwrap_or(1) as usize;
    let n = (e.end - e.begin) as usize / size;
    let (what, value, all): (&str, f32, bool) = match variant % 10 {
        0 => ("one NaN", f32::NAN, false),
        1 => ("one +Inf", f32::INFINITY, false),
        2 => ("one -Inf", f32::NEG_INFINITY, false),
        3 => ("all 1e38", 1e38, true),
        4 => ("all -1e38", -1e38, true),
        5 => ("all 1e30", 1e30, true),
        6 => ("all 1e-40 (subnormal)", 1e-40, true),
        7 => ("all zero", 0.0, true),
        8 => ("all 65504", 65504.0, true),
        _ => ("one 3e38", 3e38, false),
    };
    let enc = encode(&e.dtype, value);
    let at = rng.below(n.max(1));
    let range = if all { 0..n } else { at..at + 1 };
    for i in range {
        let p = e.begin as usize + i * size;
        let w = enc.len().min(size);
        st.data[p..p + w].copy_from_slice(&enc[..w]);
    }
    out(st.to_bytes(), format!("{} ({}): {what}", e.name, e.dtype), false)
}

/// A header of `target` bytes: the file plus that many zero-size vision-tower entries, which a
/// loader skips.
pub fn header_bloat(bytes: &[u8], prefix: &str, variant: usize) -> Mutated {
    let st = St::parse(bytes).unwrap_or_else(|| unreachable!("fixture parsed before"));
    let target = [1usize << 20, 4 << 20, 16 << 20][variant % 3];
    let mut text = st.header_text();
    text.pop();
    let mut k = 0usize;
    while text.len() < target {
        text.push_str(&format!(
            ",\"{prefix}visual.blocks.{k}.attn.qkv.weight\":{{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}"
        ));
        k += 1;
    }
    text.push('}');
    out(assemble(&text, &st.data), format!("header of {} bytes: {k} zero-size vision entries", text.len()), false)
}
