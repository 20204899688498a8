//! PEFT LoRA adapters: `adapter_config.json` semantics and the keys of
//! `adapter_model.safetensors`, validated against one model before anything reaches the GPU.
//!
//! Supported: `r`, `lora_alpha`, `use_rslora`, `rank_pattern`, `alpha_pattern`, `target_modules`
//! (list, regex string, `"all-linear"`), `exclude_modules`, `layers_to_transform` (+
//! `layers_pattern`), keys of adapters saved from the text-only class
//! (`base_model.model.model.layers.N…`) and the VLM class (`…model.language_model.layers.N…`),
//! all twelve projections, A/B in F32, BF16 or F16 (widened to f32 exactly).
//! Typed errors: DoRA, `lora_bias`, embedding / lm_head LoRA, `modules_to_save`,
//! `fan_in_fan_out`, pickle `.bin` files, keys that match no module, untargeted modules,
//! wrong shapes or ranks, layers out of range, NaN/Inf. Vision-tower keys (`model.visual.*`, which
//! `all-linear` adapters saved from the VLM class can carry) cannot affect text generation; they
//! are skipped and listed in [`ParsedAdapter::ignored`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use regex::Regex;

use crate::error::{AdapterError, ModelError};
use crate::lora::Proj;
use crate::model::{Checkpoint, Dtype, TextConfig};

/// Where the adapter's rank and alpha came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigSource {
    /// `adapter_config.json`.
    ConfigFile,
    /// The safetensors header's `__metadata__` (`r`, `lora_alpha` as strings).
    FileMetadata,
    /// Nothing: rank read from the tensors, alpha = r (scaling 1).
    DefaultAlphaEqualsRank,
    /// Created on the GPU for learning (rank and alpha from its `TrainSpec`).
    Trainable,
    /// An MLX adapter's `adapter_config.json` (`lora_parameters.scale`, absolute).
    MlxConfig,
}

#[derive(Clone, Debug)]
enum Targets {
    Names(Vec<String>),
    Regex(Regex),
    AllLinear,
}

impl Targets {
    fn from_json(field: &str, v: &serde_json::Value) -> Result<Option<Self>, AdapterError> {
        Ok(match v {
            serde_json::Value::Null => None,
            serde_json::Value::String(s) if s == "all-linear" => Some(Targets::AllLinear),
            serde_json::Value::String(s) => Some(Targets::Regex(full_regex(field, s)?)),
            serde_json::Value::Array(a) => Some(Targets::Names(
                a.iter()
                    .map(|x| x.as_str().map(String::from))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad(field, "a list of strings", v))?,
            )),
            other => return Err(bad(field, "a list of names, a regex string or \"all-linear\"", other)),
        })
    }

    fn matches(&self, module: &str) -> bool {
        match self {
            Targets::AllLinear => true,
            Targets::Regex(r) => r.is_match(module),
            Targets::Names(names) => names.iter().any(|n| module == n || module.ends_with(&format!(".{n}"))),
        }
    }
}

/// The parts of `adapter_config.json` that change the math or the set of modules.
#[derive(Clone, Debug)]
pub struct PeftConfig {
    /// Default rank (`None` when no config: every module's own tensor rank).
    pub r: Option<usize>,
    /// Default alpha (`None`: alpha = the module's rank).
    pub lora_alpha: Option<f64>,
    /// alpha / √r instead of alpha / r.
    pub use_rslora: bool,
    rank_pattern: Vec<(Regex, String, usize)>,
    alpha_pattern: Vec<(Regex, String, f64)>,
    targets: Option<Targets>,
    exclude: Option<Targets>,
    layers_to_transform: Option<Vec<usize>>,
    layers_pattern: Vec<String>,
    /// Where r and alpha came from.
    pub source: ConfigSource,
}

fn bad(field: &str, expected: &str, found: &serde_json::Value) -> AdapterError {
    AdapterError::BadConfig { field: field.into(), expected: expected.into(), found: found.to_string() }
}

/// Python `re.fullmatch` semantics.
fn full_regex(field: &str, pattern: &str) -> Result<Regex, AdapterError> {
    Regex::new(&format!("^(?:{pattern})$")).map_err(|e| AdapterError::BadConfig {
        field: field.into(),
        expected: "a valid regular expression".into(),
        found: format!("{pattern:?} ({e})"),
    })
}

/// PEFT's `get_pattern_key`: `re.match(rf"(.*\.)?({key})$", module)`.
fn pattern_regex(field: &str, key: &str) -> Result<Regex, AdapterError> {
    Regex::new(&format!("^(?:.*\\.)?(?:{key})$")).map_err(|e| AdapterError::BadConfig {
        field: field.into(),
        expected: "valid regular expressions as keys".into(),
        found: format!("{key:?} ({e})"),
    })
}

impl PeftConfig {
    fn from_json(v: &serde_json::Value) -> Result<Self, AdapterError> {
        let get = |k: &str| v.get(k).unwrap_or(&serde_json::Value::Null);
        let peft_type = get("peft_type");
        if !peft_type.is_null() && peft_type.as_str() != Some("LORA") {
            return Err(bad("peft_type", "\"LORA\"", peft_type));
        }
        for (field, feature) in [
            ("use_dora", "DoRA"),
            ("lora_bias", "lora_bias"),
            ("fan_in_fan_out", "fan_in_fan_out"),
            ("use_qalora", "QA-LoRA"),
        ] {
            if get(field).as_bool() == Some(true) {
                return Err(AdapterError::Unsupported { feature: feature.into(), key: field.into() });
            }
        }
        for (field, feature) in [
            ("modules_to_save", "modules_to_save (full replacement weights)"),
            ("target_parameters", "target_parameters (MoE expert LoRA)"),
            ("trainable_token_indices", "trainable_token_indices"),
            ("layer_replication", "layer_replication"),
            ("alora_invocation_tokens", "aLoRA (activation after invocation tokens)"),
        ] {
            let f = get(field);
            let empty = f.is_null()
                || f.as_array().is_some_and(|a| a.is_empty())
                || f.as_object().is_some_and(|o| o.is_empty());
            if !empty {
                return Err(AdapterError::Unsupported { feature: feature.into(), key: field.into() });
            }
        }
        let r = match get("r") {
            serde_json::Value::Null => None,
            x => Some(x.as_u64().filter(|&r| r > 0).ok_or_else(|| bad("r", "a positive integer", x))? as usize),
        };
        let lora_alpha = match get("lora_alpha") {
            serde_json::Value::Null => None,
            x => Some(x.as_f64().filter(|a| a.is_finite()).ok_or_else(|| bad("lora_alpha", "a number", x))?),
        };
        let use_rslora = get("use_rslora").as_bool().unwrap_or(false);
        let mut rank_pattern = Vec::new();
        if let Some(map) = get("rank_pattern").as_object() {
            for (k, val) in map {
                let rank =
                    val.as_u64().filter(|&r| r > 0).ok_or_else(|| bad("rank_pattern", "positive integers", val))?;
                rank_pattern.push((pattern_regex("rank_pattern", k)?, k.clone(), rank as usize));
            }
        }
        let mut alpha_pattern = Vec::new();
        if let Some(map) = get("alpha_pattern").as_object() {
            for (k, val) in map {
                let alpha =
                    val.as_f64().filter(|a| a.is_finite()).ok_or_else(|| bad("alpha_pattern", "numbers", val))?;
                alpha_pattern.push((pattern_regex("alpha_pattern", k)?, k.clone(), alpha));
            }
        }
        let layers_to_transform = match get("layers_to_transform") {
            serde_json::Value::Null => None,
            x @ serde_json::Value::Number(_) => {
                Some(vec![x.as_u64().ok_or_else(|| bad("layers_to_transform", "layer indices", x))? as usize])
            }
            serde_json::Value::Array(a) => Some(
                a.iter()
                    .map(|i| i.as_u64().map(|i| i as usize))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("layers_to_transform", "layer indices", get("layers_to_transform")))?,
            ),
            other => return Err(bad("layers_to_transform", "an index or a list of indices", other)),
        };
        let layers_pattern = match get("layers_pattern") {
            serde_json::Value::String(s) => vec![s.clone()],
            serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_str().map(String::from)).collect(),
            _ => Vec::new(),
        };
        Ok(Self {
            r,
            lora_alpha,
            use_rslora,
            rank_pattern,
            alpha_pattern,
            targets: Targets::from_json("target_modules", get("target_modules"))?,
            exclude: Targets::from_json("exclude_modules", get("exclude_modules"))?,
            layers_to_transform,
            layers_pattern,
            source: ConfigSource::ConfigFile,
        })
    }

    fn from_metadata(meta: &HashMap<String, String>) -> Result<Option<Self>, AdapterError> {
        if !meta.contains_key("r") && !meta.contains_key("lora_alpha") {
            return Ok(None);
        }
        let num = |k: &str| -> Result<Option<f64>, AdapterError> {
            meta.get(k)
                .map(|s| {
                    s.trim().parse::<f64>().map_err(|_| AdapterError::BadConfig {
                        field: format!("__metadata__.{k}"),
                        expected: "a number as a string".into(),
                        found: format!("{s:?}"),
                    })
                })
                .transpose()
        };
        let r = num("r")?;
        if r.is_some_and(|r| r < 1.0 || r.fract() != 0.0) {
            return Err(AdapterError::BadConfig {
                field: "__metadata__.r".into(),
                expected: "a positive integer".into(),
                found: format!("{:?}", meta.get("r")),
            });
        }
        Ok(Some(Self {
            r: r.map(|r| r as usize),
            lora_alpha: num("lora_alpha")?,
            use_rslora: meta.get("use_rslora").is_some_and(|v| v == "true" || v == "True"),
            source: ConfigSource::FileMetadata,
            ..Self::none()
        }))
    }

    /// No config file: nothing targeted or excluded by name, alpha = r unless `source` says
    /// otherwise.
    pub(crate) fn none() -> Self {
        Self {
            r: None,
            lora_alpha: None,
            use_rslora: false,
            rank_pattern: Vec::new(),
            alpha_pattern: Vec::new(),
            targets: None,
            exclude: None,
            layers_to_transform: None,
            layers_pattern: Vec::new(),
            source: ConfigSource::DefaultAlphaEqualsRank,
        }
    }

    /// The rank the config gives a module (`None`: no config, any rank).
    pub fn rank_for(&self, module: &str) -> Option<usize> {
        self.rank_pattern.iter().find(|(re, ..)| re.is_match(module)).map(|(_, _, r)| *r).or(self.r)
    }

    /// The multiplier of `B·A` for a module of `rank` (before the user's scale).
    pub fn scaling(&self, module: &str, rank: usize) -> f32 {
        let alpha = self
            .alpha_pattern
            .iter()
            .find(|(re, ..)| re.is_match(module))
            .map(|(_, _, a)| *a)
            .or(self.lora_alpha)
            .unwrap_or(rank as f64);
        let denom = if self.use_rslora { (rank as f64).sqrt() } else { rank as f64 };
        (alpha / denom) as f32
    }

    /// Why the config does not target `module` (layer `layer`), if it does not.
    fn excludes(&self, module: &str, layer: usize) -> Option<String> {
        if self.exclude.as_ref().is_some_and(|e| e.matches(module)) {
            return Some("exclude_modules".into());
        }
        if let Some(t) = &self.targets {
            if !t.matches(module) {
                return Some("target_modules".into());
            }
        }
        if let Some(layers) = &self.layers_to_transform {
            let pattern_ok = self.layers_pattern.is_empty()
                || self.layers_pattern.iter().any(|p| module.contains(&format!("{p}.{layer}.")));
            if !layers.contains(&layer) || !pattern_ok {
                return Some(format!("layers_to_transform {layers:?}"));
            }
        }
        None
    }
}

/// One adapted projection, validated, in f32.
#[derive(Clone, Debug)]
pub struct ModuleDelta {
    /// Layer index.
    pub layer: usize,
    /// The projection.
    pub proj: Proj,
    /// Rank r.
    pub rank: usize,
    /// alpha / r (or alpha / √r).
    pub scaling: f32,
    /// `lora_A` `[r, in]`.
    pub a: Vec<f32>,
    /// `lora_B` `[out, r]`.
    pub b: Vec<f32>,
}

/// An adapter file read and checked against one model.
#[derive(Clone, Debug)]
pub struct ParsedAdapter {
    /// The adapter directory or file.
    pub path: PathBuf,
    /// Its name (directory name or file stem).
    pub name: String,
    /// The config.
    pub config: PeftConfig,
    /// Adapted projections, ordered by (layer, projection).
    pub deltas: Vec<ModuleDelta>,
    /// Keys skipped because they cannot affect text generation (vision tower).
    pub ignored: Vec<String>,
}

impl From<ModelError> for AdapterError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Io { path, source } => AdapterError::Io { path, source },
            ModelError::BadSafetensors { path, message } => AdapterError::BadSafetensors { path, message },
            ModelError::Gpu(g) => AdapterError::Gpu(g),
            other => AdapterError::BadSafetensors { path: PathBuf::new(), message: other.to_string() },
        }
    }
}

fn locate(path: &Path) -> Result<(PathBuf, Option<PathBuf>), AdapterError> {
    let not_peft = |reason: &str| AdapterError::NotPeft { path: path.to_path_buf(), reason: reason.into() };
    if path.is_dir() {
        let weights = path.join("adapter_model.safetensors");
        let config = path.join("adapter_config.json");
        if !weights.is_file() {
            if path.join("adapter_model.bin").is_file() {
                return Err(AdapterError::Unsupported {
                    feature: "pickle adapter_model.bin (convert it to safetensors)".into(),
                    key: path.join("adapter_model.bin").display().to_string(),
                });
            }
            return Err(not_peft("no adapter_model.safetensors in the directory"));
        }
        if !config.is_file() {
            return Err(not_peft("no adapter_config.json in the directory"));
        }
        Ok((weights, Some(config)))
    } else if path.is_file() {
        match path.extension().and_then(|e| e.to_str()) {
            Some("safetensors") => {}
            Some("bin") | Some("pt") | Some("pth") => {
                return Err(AdapterError::Unsupported {
                    feature: "pickle adapter files (convert to safetensors)".into(),
                    key: path.display().to_string(),
                })
            }
            _ => return Err(not_peft("expected a directory or a .safetensors file")),
        }
        let beside = path.parent().map(|d| d.join("adapter_config.json")).filter(|c| c.is_file());
        Ok((path.to_path_buf(), beside))
    } else {
        Err(AdapterError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        })
    }
}

fn read_config(path: &Path) -> Result<PeftConfig, AdapterError> {
    let text = std::fs::read_to_string(path).map_err(|source| AdapterError::Io { path: path.to_path_buf(), source })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| AdapterError::NotPeft {
        path: path.to_path_buf(),
        reason: format!("adapter_config.json is not JSON: {e}"),
    })?;
    PeftConfig::from_json(&json)
}

fn key_regex() -> Regex {
    Regex::new(
        r"^base_model\.model\.(?P<module>model\.(?:language_model\.)?layers\.(?P<layer>\d+)\.(?P<path>[A-Za-z0-9_.]+?))\.lora_(?P<ab>[AB])\.weight$",
    )
    .unwrap_or_else(|_| unreachable!("constant regex"))
}

/// Why a key that is not a projection's `lora_A`/`lora_B` weight is rejected (`None`: skip it).
fn classify_other(key: &str) -> Option<AdapterError> {
    let unsupported = |feature: &str| AdapterError::Unsupported { feature: feature.into(), key: key.into() };
    if key.contains(".visual.") {
        return None;
    }
    Some(if key.contains("lora_magnitude_vector") {
        unsupported("DoRA")
    } else if key.ends_with("lora_B.bias") || key.ends_with("lora_A.bias") {
        unsupported("lora_bias")
    } else if key.contains("lora_embedding_") || key.contains("embed_tokens") {
        unsupported("embedding LoRA")
    } else if key.contains("lm_head") {
        unsupported("lm_head LoRA")
    } else if !key.contains("lora_") {
        unsupported("modules_to_save (full replacement weights)")
    } else {
        AdapterError::UnknownKey {
            key: key.into(),
            why: "not a decoder-layer projection's lora_A/lora_B weight".into(),
        }
    })
}

/// The layer and projection a LoRA key names (its layer index and module path as captured),
/// checked against the model: a layer it has, a projection that layer type has.
pub(crate) fn layer_projection(
    key: &str,
    layer: &str,
    path: &str,
    model: &TextConfig,
) -> Result<(usize, Proj), AdapterError> {
    let layer: usize = layer
        .parse()
        .map_err(|_| AdapterError::UnknownKey { key: key.into(), why: "layer index is not a number".into() })?;
    let proj = Proj::from_path(path).ok_or_else(|| AdapterError::UnknownKey {
        key: key.into(),
        why: format!("Qwen 3.5 has no projection {path:?}"),
    })?;
    if layer >= model.num_layers() {
        return Err(AdapterError::LayerOutOfRange { key: key.into(), layer, layers: model.num_layers() });
    }
    let ty = model.layer_types[layer];
    if proj.layer_type().is_some_and(|t| t != ty) {
        return Err(AdapterError::WrongTarget {
            key: key.into(),
            layer,
            layer_type: format!("{ty:?}"),
            projection: proj.path().into(),
        });
    }
    Ok((layer, proj))
}

/// Both keys of a pair (`names`: how the A and B keys spell their factor), or the one missing.
pub(crate) fn both_keys(
    a: Option<String>,
    b: Option<String>,
    [a_name, b_name]: [&str; 2],
) -> Result<(String, String), AdapterError> {
    match (a, b) {
        (Some(a), Some(b)) => Ok((a, b)),
        (Some(a), None) => Err(AdapterError::MissingPair { missing: a.replace(a_name, b_name), key: a }),
        (None, Some(b)) => Err(AdapterError::MissingPair { missing: b.replace(b_name, a_name), key: b }),
        (None, None) => Err(AdapterError::Empty { path: PathBuf::new() }),
    }
}

/// A module's name and its `[lora_A, lora_B]` keys as found.
type KeyPair = (String, [Option<String>; 2]);

/// Read and validate the adapter at `path` (a PEFT directory or a `.safetensors` file, or an MLX
/// adapter: [`crate::lora::mlx`]) for a model with config `model`.
pub fn parse(path: &Path, model: &TextConfig) -> Result<ParsedAdapter, AdapterError> {
    if crate::lora::mlx::is_mlx(path) {
        return crate::lora::mlx::parse(path, model);
    }
    let (weights, config_path) = locate(path)?;
    let ckpt = Checkpoint::open_files(std::slice::from_ref(&weights))?;
    let config = match &config_path {
        Some(c) => read_config(c)?,
        None => PeftConfig::from_metadata(ckpt.metadata())?.unwrap_or_else(PeftConfig::none),
    };
    let re = key_regex();
    let mut pairs: BTreeMap<(usize, Proj), KeyPair> = BTreeMap::new();
    let mut ignored = Vec::new();
    let mut names: Vec<&str> = ckpt.names().collect();
    names.sort();
    for key in names {
        let Some(cap) = re.captures(key) else {
            match classify_other(key) {
                Some(err) => return Err(err),
                None => {
                    ignored.push(key.to_string());
                    continue;
                }
            }
        };
        let module = &cap["module"];
        let (layer, proj) = layer_projection(key, &cap["layer"], &cap["path"], model)?;
        if let Some(why) = config.excludes(module, layer) {
            return Err(AdapterError::NotTargeted { key: key.into(), why });
        }
        let slot = if &cap["ab"] == "A" { 0 } else { 1 };
        let entry = pairs.entry((layer, proj)).or_insert_with(|| (module.to_string(), [None, None]));
        entry.1[slot] = Some(key.to_string());
    }
    let mut deltas = Vec::with_capacity(pairs.len());
    for ((layer, proj), (module, [a_key, b_key])) in pairs {
        let (a_key, b_key) = both_keys(a_key, b_key, ["lora_A", "lora_B"])?;
        let (fan_in, fan_out) = proj.dims(model);
        let a_entry =
            ckpt.get(&a_key).ok_or_else(|| AdapterError::MissingPair { key: b_key.clone(), missing: a_key.clone() })?;
        let rank = a_entry.shape.first().copied().unwrap_or(0);
        if a_entry.shape.len() != 2 || a_entry.shape[1] != fan_in || rank == 0 {
            return Err(AdapterError::ShapeMismatch {
                key: a_key,
                expected: vec![config.rank_for(&module).unwrap_or(rank.max(1)), fan_in],
                found: a_entry.shape.clone(),
            });
        }
        if let Some(want) = config.rank_for(&module) {
            if want != rank {
                return Err(AdapterError::RankMismatch { key: a_key, expected: want, found: rank });
            }
        }
        let b_entry =
            ckpt.get(&b_key).ok_or_else(|| AdapterError::MissingPair { key: a_key.clone(), missing: b_key.clone() })?;
        if b_entry.shape != [fan_out, rank] {
            return Err(AdapterError::ShapeMismatch {
                key: b_key,
                expected: vec![fan_out, rank],
                found: b_entry.shape.clone(),
            });
        }
        let a = read_values(&ckpt, &a_key)?;
        let b = read_values(&ckpt, &b_key)?;
        deltas.push(ModuleDelta { layer, proj, rank, scaling: config.scaling(&module, rank), a, b });
    }
    if deltas.is_empty() {
        return Err(AdapterError::Empty { path: weights });
    }
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "adapter".into());
    Ok(ParsedAdapter { path: path.to_path_buf(), name, config, deltas, ignored })
}

pub(crate) fn read_values(ckpt: &Checkpoint, key: &str) -> Result<Vec<f32>, AdapterError> {
    let entry = ckpt.get(key).ok_or_else(|| AdapterError::UnknownKey { key: key.into(), why: "vanished".into() })?;
    let dtype = Dtype::from_safetensors(&entry.dtype)
        .ok_or_else(|| AdapterError::UnsupportedDtype { key: key.into(), found: entry.dtype.clone() })?;
    let values = dtype
        .to_f32(&ckpt.read(entry)?)
        .ok_or_else(|| AdapterError::UnsupportedDtype { key: key.into(), found: entry.dtype.clone() })?;
    if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(AdapterError::NonFinite { key: key.into(), index, value });
    }
    Ok(values)
}
