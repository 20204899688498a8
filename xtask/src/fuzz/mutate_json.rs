//! Mutations of the JSON configs: hostile values at named fields, broken text, huge pattern maps
//! and hostile regexes, and hostile shard indexes.

use serde_json::{json, Value};

use super::rng::Rng;

/// Placeholder replaced by raw text (values JSON cannot hold: NaN, 1e400, 10⁵-deep nesting).
const RAW: &str = "@@FUZZ-RAW@@";

/// Hostile values as JSON text (`None`: remove the field).
fn hostile(variant: usize) -> (String, Option<String>) {
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let values: Vec<Option<String>> = vec![
        None,
        Some("0".into()),
        Some("-1".into()),
        Some("1".into()),
        Some("2".into()),
        Some("3".into()),
        Some("7".into()),
        Some("0.5".into()),
        Some("-0.0".into()),
        Some("1e-45".into()),
        Some("1e30".into()),
        Some("-1e30".into()),
        Some("1e308".into()),
        Some("1e400".into()),
        Some("NaN".into()),
        Some("Infinity".into()),
        Some("100000000".into()),
        Some("4294967296".into()),
        Some("1000000000000".into()),
        Some("1099511627776".into()),
        Some("9007199254740993".into()),
        Some("18446744073709551615".into()),
        Some("18446744073709551616".into()),
        Some("-9223372036854775808".into()),
        Some("\"nan\"".into()),
        Some("\"inf\"".into()),
        Some("\"8\"".into()),
        Some("\"\"".into()),
        Some("\"all-linear\"".into()),
        Some("true".into()),
        Some("false".into()),
        Some("null".into()),
        Some("[]".into()),
        Some("{}".into()),
        Some("[1,2]".into()),
        Some("[\"q_proj\"]".into()),
        Some("{\"a\":1}".into()),
        Some(deep(20)),
        Some(deep(127)),
        Some(deep(100_000)),
        Some(format!("\"{}\"", "x".repeat(1 << 20))),
    ];
    let v = values[variant % values.len()].clone();
    let shown = match &v {
        None => "removed".to_string(),
        Some(t) if t.len() > 60 => format!("{}… ({} bytes)", &t[..20], t.len()),
        Some(t) => t.clone(),
    };
    (shown, v)
}

/// Set (or remove) `path` ("a.b.0") in `v`, creating objects on the way.
fn set_path(v: &mut Value, path: &str, to: Option<Value>) {
    let (head, rest) = match path.split_once('.') {
        Some((h, r)) => (h, Some(r)),
        None => (path, None),
    };
    if let (Ok(idx), Some(a)) = (head.parse::<usize>(), v.as_array_mut()) {
        if a.is_empty() {
            a.push(json!({}));
        }
        let idx = idx.min(a.len() - 1);
        match (rest, to) {
            (Some(r), to) => set_path(&mut a[idx], r, to),
            (None, Some(t)) => a[idx] = t,
            (None, None) => {
                a.remove(idx);
            }
        }
        return;
    }
    if !v.is_object() {
        *v = json!({});
    }
    let Some(obj) = v.as_object_mut() else { return };
    match (rest, to) {
        (Some(r), to) => set_path(obj.entry(head.to_string()).or_insert_with(|| json!({})), r, to),
        (None, Some(t)) => {
            obj.insert(head.to_string(), t);
        }
        (None, None) => {
            obj.shift_remove(head);
        }
    }
}

/// `v` serialised with the raw placeholder replaced.
fn render(v: &Value, raw: &str) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default().replace(&format!("\"{RAW}\""), raw)
}

/// The fields of a PEFT `adapter_config.json` worth attacking.
const PEFT_FIELDS: &[&str] = &[
    "r",
    "lora_alpha",
    "use_rslora",
    "target_modules",
    "target_modules.0",
    "exclude_modules",
    "rank_pattern",
    "rank_pattern.q_proj",
    "alpha_pattern",
    "alpha_pattern.down_proj",
    "layers_to_transform",
    "layers_to_transform.0",
    "layers_pattern",
    "peft_type",
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "target_parameters",
    "trainable_token_indices",
    "layer_replication",
    "alora_invocation_tokens",
    "use_qalora",
    "bias",
    "task_type",
    "lora_dropout",
];

/// The fields of an MLX adapter config.
const MLX_FIELDS: &[&str] = &[
    "fine_tune_type",
    "lora_parameters",
    "lora_parameters.rank",
    "lora_parameters.scale",
    "lora_parameters.keys",
    "lora_parameters.keys.0",
    "lora_parameters.dropout",
    "num_layers",
];

/// The fields of a model `config.json` (under `text_config` when the file has one).
const MODEL_FIELDS: &[&str] = &[
    "num_hidden_layers",
    "num_hidden_layers+no-layer_types",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "rms_norm_eps",
    "rope_parameters",
    "rope_parameters.rope_theta",
    "rope_parameters.partial_rotary_factor",
    "rope_parameters.mrope_section",
    "rope_theta",
    "layer_types",
    "layer_types.0",
    "tie_word_embeddings",
    "eos_token_id",
    "max_position_embeddings",
    "model_type",
    "@architectures",
    "@text_config",
    "@quantization",
    "@quantization.bits",
    "@quantization.group_size",
    "@quantization_config",
    "@quantization_config.config_groups",
    "dtype",
    "hidden_act",
    "attention_bias",
];

/// Which config a mutation edits.
#[derive(Clone, Copy)]
pub enum Flavor {
    /// `adapter_config.json` of PEFT.
    Peft,
    /// `adapter_config.json` of MLX.
    Mlx,
    /// A model's `config.json`.
    Model,
}

/// Size and count fields of a model config, for [`config_size`].
const SIZE_FIELDS: &[&str] = &[
    "num_hidden_layers+no-layer_types",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "linear_num_value_heads",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "max_position_embeddings",
    "@quantization.group_size",
];

/// Huge values (indices into the hostile list: 1e8, 2^32, 10^12, 2^40, 2^53+1, u64::MAX, 1e30).
const HUGE: &[usize] = &[16, 17, 18, 19, 20, 21, 10];

/// A huge value at a size or count field of a model config (field × value walked diagonally).
pub fn config_size(text: &str, variant: usize) -> (String, String) {
    let field = SIZE_FIELDS[variant % SIZE_FIELDS.len()];
    edit(text, Flavor::Model, field, HUGE[variant % HUGE.len()])
}

/// A hostile value at one field. Field `variant % F` and value `variant % H` (F and H coprime):
/// every (field, value) pair within F·H variants, and a spread of both in any prefix.
pub fn config_value(text: &str, flavor: Flavor, variant: usize) -> (String, String) {
    let fields = match flavor {
        Flavor::Peft => PEFT_FIELDS,
        Flavor::Mlx => MLX_FIELDS,
        Flavor::Model => MODEL_FIELDS,
    };
    edit(text, flavor, fields[variant % fields.len()], variant)
}

fn edit(text: &str, flavor: Flavor, field: &str, value: usize) -> (String, String) {
    let (shown, raw) = hostile(value);
    let mut v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    let (mut path, no_types) = match field.strip_suffix("+no-layer_types") {
        Some(f) => (f.to_string(), true),
        None => (field.to_string(), false),
    };
    let top = path.starts_with('@');
    path = path.trim_start_matches('@').to_string();
    if matches!(flavor, Flavor::Model) && !top && v.get("text_config").is_some_and(Value::is_object) {
        path = format!("text_config.{path}");
    }
    if no_types {
        let types = path.replace("num_hidden_layers", "layer_types");
        set_path(&mut v, &types, None);
    }
    set_path(&mut v, &path, raw.as_ref().map(|_| json!(RAW)));
    (render(&v, raw.as_deref().unwrap_or("null")), format!("{path} = {shown}"))
}

/// Broken JSON text.
pub fn config_text(text: &str, variant: usize) -> (Vec<u8>, String) {
    let structural: Vec<usize> = text.char_indices().filter(|(_, c)| "{}[],:\"".contains(*c)).map(|(i, _)| i).collect();
    let body = text.trim_end().trim_end_matches('}');
    let cases = 16;
    let (bytes, what): (Vec<u8>, String) = match variant % cases {
        0 => (Vec::new(), "empty".into()),
        1 => (b"null".to_vec(), "null".into()),
        2 => (b"[]".to_vec(), "an array".into()),
        3 => (b"\"config\"".to_vec(), "a string".into()),
        4 => {
            let cut = structural[(variant / cases) % structural.len()];
            (text.as_bytes()[..cut].to_vec(), format!("truncated at byte {cut}"))
        }
        5 => (format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(), "10^5-deep array".into()),
        6 => {
            let mut s = String::new();
            for _ in 0..200 {
                s.push_str("{\"a\":");
            }
            s.push('1');
            s.push_str(&"}".repeat(200));
            (s.into_bytes(), "200-deep object".into())
        }
        7 => (format!("\u{feff}{text}").into_bytes(), "UTF-8 BOM".into()),
        8 => {
            let mut b = text.as_bytes().to_vec();
            let at = text.find('"').map_or(0, |i| i + 1);
            b.insert(at, 0xff);
            (b, "invalid UTF-8 in a key".into())
        }
        9 => (
            format!("{body}, \"r\": 0, \"num_hidden_layers\": 0, \"lora_alpha\": 1e30}}").into_bytes(),
            "duplicate keys, hostile last".into(),
        ),
        10 => (format!("{text} trailing").into_bytes(), "trailing garbage".into()),
        11 => (format!("// comment\n{text}").into_bytes(), "a comment".into()),
        12 => (format!("{body}, \"r\": NaN, \"rms_norm_eps\": NaN}}").into_bytes(), "NaN literals".into()),
        13 => (format!("{body}, \"hidden_size\": 1e400, \"r\": 1e400}}").into_bytes(), "1e400".into()),
        14 => (text.replace(": ", ":\u{0}").into_bytes(), "NUL bytes".into()),
        _ => (format!("{body}, \"x\": \"{}\"}}", "y".repeat(8 << 20)).into_bytes(), "an 8 MiB string".into()),
    };
    (bytes, what)
}

/// Regex strings peft users write, and hostile ones.
const REGEXES: &[&str] = &[
    "(",
    ")",
    "[",
    "\\",
    "",
    ".*",
    "^(model\\.language_model(?=\\.).*\\.(q_proj|v_proj))$",
    "a{1000}{1000}",
    "(a*)*b",
    "(?i)Q_PROJ",
    ".*\\.(q|k|v|o)_proj",
    "\\d+",
    "(?P<x>a)(?P<x>b)",
    "\\p{Greek}+",
    ".*layers\\.[0-9]+\\.mlp\\..*",
];

/// Pattern maps of many keys, hostile regexes as target/exclude/pattern keys, huge name lists.
pub fn config_pattern(text: &str, rng: &mut Rng, variant: usize) -> (String, String) {
    let mut v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    let sizes = [1usize, 16, 256, 1000, 4000, 16, 1, 20_000];
    // The 200,000-key rank_pattern (a known 40 s case) once per 256 variants: it hits the
    // timeout, which costs a worker restart.
    let n = if variant % 256 == 56 { 200_000 } else { sizes[(variant / 8) % sizes.len()] };
    let map = |val: Value| -> Value {
        Value::Object((0..n).map(|k| (format!("layers\\.{k}\\.self_attn\\.q_proj"), val.clone())).collect())
    };
    let r = v.get("r").cloned().unwrap_or(json!(8));
    let regex = REGEXES[rng.below(REGEXES.len())];
    let what = match variant % 8 {
        0 => {
            set_path(&mut v, "rank_pattern", Some(map(r)));
            format!("rank_pattern of {n} keys")
        }
        1 => {
            set_path(&mut v, "alpha_pattern", Some(map(json!(16))));
            format!("alpha_pattern of {n} keys")
        }
        2 => {
            set_path(&mut v, "target_modules", Some(json!(regex)));
            format!("target_modules = {regex:?}")
        }
        3 => {
            set_path(&mut v, "exclude_modules", Some(json!(regex)));
            format!("exclude_modules = {regex:?}")
        }
        4 => {
            set_path(&mut v, "rank_pattern", Some(json!({ regex: r })));
            format!("rank_pattern key {regex:?}")
        }
        5 => {
            set_path(&mut v, "alpha_pattern", Some(json!({ regex: 1e30 })));
            format!("alpha_pattern key {regex:?} = 1e30")
        }
        6 => {
            let names: Vec<String> = (0..n * 5).map(|k| format!("proj_{k}")).collect();
            set_path(&mut v, "target_modules", Some(json!(names)));
            format!("target_modules list of {} names", n * 5)
        }
        _ => {
            let alt = (0..n).map(|k| format!("layers\\.{k}\\.mlp")).collect::<Vec<_>>().join("|");
            set_path(&mut v, "target_modules", Some(json!(format!("(?:{alt}).*"))));
            format!("target_modules regex of {n} alternatives")
        }
    };
    (serde_json::to_string(&v).unwrap_or_default(), what)
}
