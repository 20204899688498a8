//! MLX LoRA adapters as `mlx_lm.lora` writes them: a directory with `adapters.safetensors` and
//! an `adapter_config.json` holding `fine_tune_type`, `num_layers` and `lora_parameters {rank,
//! scale, dropout, keys}`. Tensors are `….layers.N.<path>.lora_a` `[in, r]` and `.lora_b`
//! `[r, out]` (transposed against PEFT), and `scale` multiplies `B·A` as it is (not alpha / r).
//! They become the same [`ParsedAdapter`] a PEFT adapter does, with the same checks and typed
//! errors; DoRA (`fine_tune_type: "dora"`, `.m` magnitudes) and full fine-tunes are refused.
//!
//! The config is read as mlx-lm 0.32's `load_adapters` reads it: `num_layers`,
//! `lora_parameters`, its `scale` and `rank` are required (mlx-lm raises without them; `dropout`,
//! which it also requires, does not change inference and may be left out); LoRA layers exist only
//! in the last `num_layers` layers (all of them when `num_layers` ≤ 0, as `layers[-0:]`) on the
//! module paths `keys` names within a layer, or on any layer's module whose full path `keys`
//! names (mlx-lm's model-level pass); a tensor of another module is refused (mlx-lm: "not an
//! adapter parameter in the model"). Unlike mlx-lm, either key prefix (`model.layers.N` or
//! `language_model.model.layers.N`) is read on any base, as for PEFT adapters.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use regex::Regex;

use crate::error::AdapterError;
use crate::lora::peft::{
    both_keys, check_rank, check_total, layer_projection, read_json, read_values, record_pair, ConfigSource, KeyPair,
    ModuleDelta, ParsedAdapter, PeftConfig,
};
use crate::lora::{Proj, MAX_PATTERN_KEYS, MAX_RANK, MAX_SCALING};
use crate::model::{Checkpoint, TextConfig};

/// The weights file of an MLX adapter directory.
const WEIGHTS: &str = "adapters.safetensors";

/// Whether `path` is an MLX adapter: a directory with `adapters.safetensors`, or that file.
pub fn is_mlx(path: &Path) -> bool {
    if path.is_dir() {
        path.join(WEIGHTS).is_file() && !path.join("adapter_model.safetensors").is_file()
    } else {
        path.file_name().is_some_and(|n| n == WEIGHTS)
    }
}

/// What the config decides.
struct MlxConfig {
    /// `lora_parameters.rank`.
    rank: usize,
    /// `lora_parameters.scale`.
    scale: f32,
    /// `lora_parameters.keys`: the module paths (within a layer) that get LoRA; `None` is all.
    keys: Option<Vec<String>>,
    /// `num_layers`: LoRA layers are the last ones (all when ≤ 0).
    num_layers: i64,
}

impl MlxConfig {
    /// The first layer mlx-lm gives LoRA layers: `model.layers[-max(num_layers, 0):]`.
    fn first_layer(&self, layers: usize) -> usize {
        match usize::try_from(self.num_layers) {
            Ok(n) if n > 0 => layers.saturating_sub(n),
            _ => 0,
        }
    }
}

fn bad(field: &str, expected: &str, found: &serde_json::Value) -> AdapterError {
    AdapterError::BadConfig { field: field.into(), expected: expected.into(), found: found.to_string() }
}

fn read_config(path: &Path) -> Result<MlxConfig, AdapterError> {
    let json = read_json(path)?;
    let ty = json.get("fine_tune_type").and_then(|t| t.as_str()).unwrap_or("lora");
    match ty {
        "lora" => {}
        "dora" => return Err(AdapterError::Unsupported { feature: "DoRA".into(), key: "fine_tune_type".into() }),
        other => {
            return Err(AdapterError::Unsupported {
                feature: format!("fine_tune_type {other:?} (only LoRA adapters apply)"),
                key: "fine_tune_type".into(),
            })
        }
    }
    let null = serde_json::Value::Null;
    let num_layers = json.get("num_layers").unwrap_or(&null);
    let num_layers =
        num_layers.as_i64().ok_or_else(|| bad("num_layers", "an integer (mlx-lm requires it)", num_layers))?;
    let params = json.get("lora_parameters").unwrap_or(&null);
    if !params.is_object() {
        return Err(bad("lora_parameters", "an object with rank and scale (mlx-lm requires it)", params));
    }
    let get = |k: &str| params.get(k).unwrap_or(&null);
    let rank = get("rank");
    let rank = rank
        .as_u64()
        .filter(|&r| r > 0 && r <= MAX_RANK as u64)
        .ok_or_else(|| bad("lora_parameters.rank", &format!("a positive integer ≤ {MAX_RANK}"), rank))?
        as usize;
    let scale = get("scale");
    let expected = if scale.is_null() && !get("alpha").is_null() {
        format!("a number of magnitude ≤ {MAX_SCALING} (mlx-lm's LoRA config has scale, not alpha)")
    } else {
        format!("a number of magnitude ≤ {MAX_SCALING}")
    };
    let scale = scale
        .as_f64()
        .filter(|s| s.is_finite() && s.abs() <= MAX_SCALING)
        .ok_or_else(|| bad("lora_parameters.scale", &expected, scale))? as f32;
    let keys = match get("keys") {
        serde_json::Value::Null => None,
        x => Some(
            x.as_array()
                .filter(|a| a.len() <= MAX_PATTERN_KEYS)
                .and_then(|a| a.iter().map(|k| k.as_str().map(String::from)).collect::<Option<Vec<_>>>())
                .ok_or_else(|| bad("lora_parameters.keys", "a list of module paths", x))?,
        ),
    };
    Ok(MlxConfig { rank, scale, keys, num_layers })
}

fn key_regex() -> Regex {
    Regex::new(
        r"^(?P<module>(?:language_model\.)?model\.layers\.(?P<layer>\d+)\.(?P<path>[A-Za-z0-9_.]+?))\.lora_(?P<ab>[ab])$",
    )
        .unwrap_or_else(|_| unreachable!("constant regex"))
}

/// Read and validate the MLX adapter at `path` for a model with config `model`.
pub fn parse(path: &Path, model: &TextConfig) -> Result<ParsedAdapter, AdapterError> {
    model.check().map_err(|e| AdapterError::ModelConfig(Box::new(e)))?;
    let dir = if path.is_dir() { path.to_path_buf() } else { path.parent().map(Path::to_path_buf).unwrap_or_default() };
    let weights = if path.is_dir() { path.join(WEIGHTS) } else { path.to_path_buf() };
    if !weights.is_file() {
        return Err(AdapterError::NotPeft {
            path: weights,
            reason: "not a regular file (a FIFO or device would block the read)".into(),
        });
    }
    let config_path = dir.join("adapter_config.json");
    if !config_path.is_file() {
        return Err(AdapterError::NotPeft {
            path: path.to_path_buf(),
            reason: "an MLX adapter needs its adapter_config.json (num_layers, lora_parameters.rank and .scale)".into(),
        });
    }
    let config = read_config(&config_path)?;
    let ckpt = Checkpoint::open_files(std::slice::from_ref(&weights))?;
    let re = key_regex();
    let mut pairs: BTreeMap<(usize, Proj), KeyPair> = BTreeMap::new();
    let mut names: Vec<&str> = ckpt.names().collect();
    names.sort_unstable();
    for key in names {
        let Some(cap) = re.captures(key) else {
            let feature = if key.ends_with(".m") { "DoRA" } else { "" };
            return Err(if feature.is_empty() {
                AdapterError::UnknownKey {
                    key: key.into(),
                    why: "not a decoder-layer projection's lora_a/lora_b".into(),
                }
            } else {
                AdapterError::Unsupported { feature: feature.into(), key: key.into() }
            });
        };
        let path = &cap["path"];
        let (layer, proj) = layer_projection(key, &cap["layer"], path, model)?;
        // mlx-lm's model-level pass converts a module whose full path `keys` names, in any layer.
        let named_in_full = config.keys.as_ref().is_some_and(|keys| keys.iter().any(|k| k == &cap["module"]));
        if !named_in_full {
            if layer < config.first_layer(model.num_layers()) {
                return Err(AdapterError::NotTargeted {
                    key: key.into(),
                    why: format!("num_layers {} (LoRA layers are the last ones)", config.num_layers),
                });
            }
            if let Some(keys) = &config.keys {
                if !keys.iter().any(|k| k == path) {
                    return Err(AdapterError::NotTargeted { key: key.into(), why: "lora_parameters.keys".into() });
                }
            }
        }
        record_pair(&mut pairs, (layer, proj), &cap["module"], usize::from(&cap["ab"] == "b"), key)?;
    }
    check_total(&ckpt, &pairs)?;
    let mut deltas = Vec::with_capacity(pairs.len());
    for ((layer, proj), (_, [a_key, b_key])) in pairs {
        let (a_key, b_key) = both_keys(a_key, b_key, ["lora_a", "lora_b"])?;
        let (fan_in, fan_out) = proj.dims(model);
        let shape = |k: &str| ckpt.get(k).map(|e| e.shape.clone()).unwrap_or_default();
        let a_shape = shape(&a_key);
        let rank = a_shape.get(1).copied().unwrap_or(0);
        check_rank(&a_key, &a_shape, rank)?;
        if a_shape.len() != 2 || a_shape[0] != fan_in || rank == 0 {
            return Err(AdapterError::ShapeMismatch {
                key: a_key,
                expected: vec![fan_in, config.rank],
                found: a_shape,
            });
        }
        if config.rank != rank {
            return Err(AdapterError::RankMismatch { key: a_key, expected: config.rank, found: rank });
        }
        if shape(&b_key) != [rank, fan_out] {
            return Err(AdapterError::ShapeMismatch {
                key: b_key.clone(),
                expected: vec![rank, fan_out],
                found: shape(&b_key),
            });
        }
        // PEFT's orientation: A [r, in], B [out, r].
        let a_t = read_values(&ckpt, &a_key)?;
        let b_t = read_values(&ckpt, &b_key)?;
        let a = (0..rank).flat_map(|r| (0..fan_in).map(move |i| (r, i))).map(|(r, i)| a_t[i * rank + r]).collect();
        let b = (0..fan_out).flat_map(|o| (0..rank).map(move |r| (o, r))).map(|(o, r)| b_t[r * fan_out + o]).collect();
        deltas.push(ModuleDelta { layer, proj, rank, scaling: config.scale, a, b });
    }
    if deltas.is_empty() {
        return Err(AdapterError::Empty { path: weights });
    }
    let name = dir.file_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "adapter".into());
    let mut peft = PeftConfig::none();
    peft.source = ConfigSource::MlxConfig;
    Ok(ParsedAdapter { path: PathBuf::from(path), name, config: peft, deltas, ignored: Vec::new(), ignored_count: 0 })
}
