//! PEFT LoRA adapters: `adapter_config.json` semantics and the keys of
//! `adapter_model.safetensors`, validated against one model before anything reaches the GPU.
//!
//! Supported: `r`, `lora_alpha`, `use_rslora`, `rank_pattern`, `alpha_pattern`, `target_modules`
//! (list, regex string, `"all-linear"`), `exclude_modules`, `layers_to_transform` (+
//! `layers_pattern`), keys of adapters saved from the text-only class
//! (`base_model.model.model.layers.N…`) and the VLM class (`…model.language_model.layers.N…`),
//! all twelve projections, A/B in F32, BF16 or F16 (widened to f32 exactly).
//!
//! Config semantics are peft 0.21's, tested against the module's full name inside the PEFT
//! model (`model.layers.0.self_attn.q_proj` for the text class,
//! `model.language_model.layers.0.self_attn.q_proj` for the VLM class), as peft names it:
//! `check_target_module_exists` for targets, excludes and layers (a regex string is
//! `re.fullmatch`; a list entry matches the name or a `.`-suffix of it; `layers_to_transform`
//! applies only to list entries matched by suffix), `get_pattern_key` for rank / alpha patterns
//! (first key in file order with `re.match(rf"(.*\.)?({key})$", name)`), Python `re` syntax
//! with look-around ([`crate::lora::pattern`]). Fields that do not change the math are ignored.
//!
//! A missing `r` or `lora_alpha` in `adapter_config.json` is `LoraConfig`'s default, 8.
//! `fan_in_fan_out: true` is what peft makes of it on an `nn.Linear` (every Qwen 3.5 projection):
//! it warns, sets the flag to false and applies A and B as saved; so does the engine.
//!
//! Typed errors: DoRA, `lora_bias`, embedding / lm_head LoRA, `modules_to_save`,
//! an `init_lora_weights` that makes peft rewrite the base weights on load
//! (PiSSA, OLoRA, LoftQ, CorDA, LoRA-GA: the adapter was trained against residual weights this
//! engine does not have), pickle `.bin` files, keys that match no module, untargeted modules, a
//! module present twice (both prefixes), wrong shapes or ranks, layers out of range, NaN/Inf,
//! and the bounds of [`crate::lora`] (rank, alpha / r, weight magnitude, pattern-map size).
//! Vision-tower keys (`model.visual.*`, which `all-linear` adapters saved from the VLM class can
//! carry) cannot affect text generation; they are skipped and counted in
//! [`ParsedAdapter::ignored_count`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use regex::Regex;

use crate::error::{AdapterError, FileError, ModelError};
use crate::lora::pattern::{is_plain, PatternKey, PyRegex};
use crate::lora::{
    Proj, MAX_ADAPTER_ELEMENTS, MAX_COMPILED_PATTERNS, MAX_CONFIG_BYTES, MAX_PATTERN_KEYS, MAX_RANK, MAX_SCALING,
    MAX_WEIGHT,
};
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
    /// A stack of resident adapters (an adapter set of several): each part keeps its source's
    /// alpha / r.
    Stacked,
}

/// `target_modules` / `exclude_modules`.
#[derive(Clone, Debug)]
enum Targets {
    /// A list: a module is named when it equals an entry or ends with `.entry`.
    Names(Vec<String>),
    /// A string: `re.fullmatch`.
    Regex(PyRegex),
    /// `"all-linear"` (any case): every linear layer but the output head, so every projection.
    AllLinear,
}

/// How a module name meets `target_modules`, as peft's `check_target_module_exists` decides.
enum Hit {
    /// Not targeted.
    No,
    /// Targeted regardless of `layers_to_transform` (exact list entry, regex, all-linear).
    Always,
    /// Targeted by a list entry's suffix: `layers_to_transform` applies.
    Suffix,
}

impl Targets {
    fn from_json(field: &str, v: &serde_json::Value, all_linear: bool) -> Result<Option<Self>, AdapterError> {
        Ok(match v {
            serde_json::Value::Null => None,
            serde_json::Value::String(s) if all_linear && s.eq_ignore_ascii_case("all-linear") => {
                Some(Targets::AllLinear)
            }
            serde_json::Value::String(s) => Some(Targets::Regex(PyRegex::fullmatch(field, s)?)),
            serde_json::Value::Array(a) => {
                if a.len() > MAX_PATTERN_KEYS {
                    return Err(too_many(field, a.len()));
                }
                let names = a
                    .iter()
                    .map(|x| x.as_str().map(String::from))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad(field, "a list of strings", v))?;
                Some(Targets::Names(names))
            }
            other => return Err(bad(field, "a list of names, a regex string or \"all-linear\"", other)),
        })
    }

    fn hit(&self, module: &str) -> Result<Hit, AdapterError> {
        Ok(match self {
            Targets::AllLinear => Hit::Always,
            Targets::Regex(r) if r.is_match(module)? => Hit::Always,
            Targets::Regex(_) => Hit::No,
            Targets::Names(names) if names.iter().any(|n| n == module) => Hit::Always,
            Targets::Names(names) if names.iter().any(|n| suffix_of(module, n)) => Hit::Suffix,
            Targets::Names(_) => Hit::No,
        })
    }
}

/// `module.endswith(f".{name}")`.
fn suffix_of(module: &str, name: &str) -> bool {
    module.strip_suffix(name).is_some_and(|head| head.ends_with('.'))
}

/// A pattern map (`rank_pattern`, `alpha_pattern`) in the config's key order, which is the
/// order peft tries the keys in (first match wins).
type PatternMap<T> = Vec<(PatternKey, T)>;

/// `layers_to_transform`: one index or a list (an empty list restricts nothing, as in peft).
#[derive(Clone, Debug)]
struct LayerFilter {
    layers: Vec<usize>,
    /// One peft layer-index regex per `layers_pattern` entry, or the default one.
    patterns: Vec<PyRegex>,
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
    rank_pattern: PatternMap<usize>,
    alpha_pattern: PatternMap<f64>,
    targets: Option<Targets>,
    exclude: Option<Targets>,
    layers: Option<LayerFilter>,
    /// Where r and alpha came from.
    pub source: ConfigSource,
}

fn bad(field: &str, expected: &str, found: &serde_json::Value) -> AdapterError {
    let mut found = found.to_string();
    if found.len() > 200 {
        let cut = (0..=200).rev().find(|&i| found.is_char_boundary(i)).unwrap_or(0);
        found.truncate(cut);
        found.push('…');
    }
    AdapterError::BadConfig { field: field.into(), expected: expected.into(), found }
}

fn too_many(field: &str, n: usize) -> AdapterError {
    AdapterError::BadConfig {
        field: field.into(),
        expected: format!("at most {MAX_PATTERN_KEYS} entries"),
        found: format!("{n} entries"),
    }
}

/// `LoraConfig`'s `r` and `lora_alpha` when `adapter_config.json` leaves them out.
const PEFT_DEFAULT_R: usize = 8;
const PEFT_DEFAULT_ALPHA: f64 = 8.0;

/// Whether an `init_lora_weights` value makes peft change the base layer's weights when it
/// creates the adapter, also when loading a saved one (`LoraLayer.update_layer`).
fn rewrites_base(init: &str) -> bool {
    ["pissa", "corda", "lora_ga"].iter().any(|p| init.starts_with(p)) || init == "olora" || init == "loftq"
}

/// A rank from a config: a positive integer up to [`MAX_RANK`].
fn rank_value(field: &str, v: &serde_json::Value) -> Result<usize, AdapterError> {
    v.as_u64()
        .filter(|&r| r > 0 && r <= MAX_RANK as u64)
        .map(|r| r as usize)
        .ok_or_else(|| bad(field, &format!("a positive integer ≤ {MAX_RANK}"), v))
}

/// An alpha from a config: a finite number (its ratio to r is bounded in [`PeftConfig::scaling`]).
fn alpha_value(field: &str, v: &serde_json::Value) -> Result<f64, AdapterError> {
    v.as_f64().filter(|a| a.is_finite()).ok_or_else(|| bad(field, "a finite number", v))
}

fn pattern_map<T>(
    field: &str,
    v: &serde_json::Value,
    value: impl Fn(&str, &serde_json::Value) -> Result<T, AdapterError>,
) -> Result<PatternMap<T>, AdapterError> {
    let map = match v {
        serde_json::Value::Null => return Ok(Vec::new()),
        serde_json::Value::Object(map) => map,
        other => return Err(bad(field, "an object of pattern: value", other)),
    };
    // Counted before anything is compiled: a 200,000-key map is refused at once.
    if map.len() > MAX_PATTERN_KEYS {
        return Err(too_many(field, map.len()));
    }
    map.iter().map(|(k, val)| Ok((PatternKey::new(field, k)?, value(field, val)?))).collect()
}

fn too_many_regexes(found: usize) -> AdapterError {
    AdapterError::BadConfig {
        field: "target_modules / exclude_modules / rank_pattern / alpha_pattern / layers_pattern".into(),
        expected: format!("at most {MAX_COMPILED_PATTERNS} regular expressions (keys that are module names need none)"),
        found: format!("{found}"),
    }
}

impl PeftConfig {
    /// Parse `adapter_config.json`'s JSON. Fields that do not change the math are ignored.
    pub fn from_json(v: &serde_json::Value) -> Result<Self, AdapterError> {
        let get = |k: &str| v.get(k).unwrap_or(&serde_json::Value::Null);
        if !v.is_object() {
            return Err(bad("adapter_config.json", "a JSON object", v));
        }
        let peft_type = get("peft_type");
        if !peft_type.is_null() && peft_type.as_str() != Some("LORA") {
            return Err(bad("peft_type", "\"LORA\"", peft_type));
        }
        for (field, feature) in [("use_dora", "DoRA"), ("lora_bias", "lora_bias"), ("use_qalora", "QA-LoRA")] {
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
        if let Some(init) = get("init_lora_weights").as_str().filter(|i| rewrites_base(i)) {
            return Err(AdapterError::Unsupported {
                feature: format!(
                    "init_lora_weights = {init:?} (peft rewrites the base weights when it loads this adapter: \
                     convert it to a plain LoRA with peft's path_initial_model_for_weight_conversion)"
                ),
                key: "init_lora_weights".into(),
            });
        }
        // LoraConfig's defaults where the file leaves them out.
        let r = match get("r") {
            serde_json::Value::Null => Some(PEFT_DEFAULT_R),
            x => Some(rank_value("r", x)?),
        };
        let lora_alpha = match get("lora_alpha") {
            serde_json::Value::Null => Some(PEFT_DEFAULT_ALPHA),
            x => Some(alpha_value("lora_alpha", x)?),
        };
        let use_rslora = get("use_rslora").as_bool().unwrap_or(false);
        // Counted from the JSON before any is compiled (each may take up to 256 KiB).
        let keys = |f: &str| get(f).as_object().map_or(0, |m| m.keys().filter(|k| !is_plain(k)).count());
        let string = |f: &str| usize::from(get(f).as_str().is_some_and(|t| t != "all-linear"));
        let layer_patterns = match get("layers_pattern") {
            serde_json::Value::String(_) => 1,
            serde_json::Value::Array(a) => a.len(),
            _ => 0,
        };
        let planned = keys("rank_pattern")
            + keys("alpha_pattern")
            + string("target_modules")
            + string("exclude_modules")
            + layer_patterns;
        if planned > MAX_COMPILED_PATTERNS {
            return Err(too_many_regexes(planned));
        }
        let rank_pattern = pattern_map("rank_pattern", get("rank_pattern"), rank_value)?;
        let alpha_pattern = pattern_map("alpha_pattern", get("alpha_pattern"), alpha_value)?;
        let targets = Targets::from_json("target_modules", get("target_modules"), true)?;
        let exclude = Targets::from_json("exclude_modules", get("exclude_modules"), false)?;
        let layers = Self::layer_filter(get("layers_to_transform"), get("layers_pattern"))?;
        // peft's LoraConfig.__post_init__ raises for these.
        if layers.is_some() && matches!(targets, Some(Targets::Regex(_) | Targets::AllLinear)) {
            return Err(bad(
                "layers_to_transform",
                "null when target_modules is a string (peft refuses the combination)",
                get("layers_to_transform"),
            ));
        }
        let config = Self {
            r,
            lora_alpha,
            use_rslora,
            rank_pattern,
            alpha_pattern,
            targets,
            exclude,
            layers,
            source: ConfigSource::ConfigFile,
        };
        let compiled = config.regexes().count();
        if compiled > MAX_COMPILED_PATTERNS {
            return Err(too_many_regexes(compiled));
        }
        let backtracking = config.regexes().filter(|r| r.backtracks()).count();
        if backtracking > MAX_BACKTRACKING_PATTERNS {
            return Err(AdapterError::BadConfig {
                field: "target_modules / exclude_modules / rank_pattern / alpha_pattern / layers_pattern".into(),
                expected: format!("at most {MAX_BACKTRACKING_PATTERNS} patterns with look-around or back-references"),
                found: format!("{backtracking}"),
            });
        }
        Ok(config)
    }

    /// Every compiled regex of the config.
    fn regexes(&self) -> impl Iterator<Item = &PyRegex> {
        let targets = [&self.targets, &self.exclude].into_iter().flatten().filter_map(|t| match t {
            Targets::Regex(r) => Some(r),
            _ => None,
        });
        let keys = self.rank_pattern.iter().map(|(k, _)| k).chain(self.alpha_pattern.iter().map(|(k, _)| k));
        let keys = keys.filter_map(|k| match k {
            PatternKey::Regex(r) => Some(r),
            PatternKey::Plain(_) => None,
        });
        targets.chain(keys).chain(self.layers.iter().flat_map(|l| l.patterns.iter()))
    }

    fn layer_filter(
        indices: &serde_json::Value,
        pattern: &serde_json::Value,
    ) -> Result<Option<LayerFilter>, AdapterError> {
        let index = |i: &serde_json::Value| {
            i.as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .ok_or_else(|| bad("layers_to_transform", "layer indices", indices))
        };
        let layers = match indices {
            serde_json::Value::Null => None,
            x @ serde_json::Value::Number(_) => Some(vec![index(x)?]),
            serde_json::Value::Array(a) if a.len() > MAX_PATTERN_KEYS => {
                return Err(too_many("layers_to_transform", a.len()))
            }
            serde_json::Value::Array(a) => Some(a.iter().map(index).collect::<Result<Vec<_>, _>>()?),
            other => return Err(bad("layers_to_transform", "an index or a list of indices", other)),
        };
        let patterns: Vec<String> = match pattern {
            serde_json::Value::Null => Vec::new(),
            serde_json::Value::String(s) if s.is_empty() => Vec::new(),
            serde_json::Value::String(s) => vec![s.clone()],
            serde_json::Value::Array(a) if a.len() > MAX_PATTERN_KEYS => {
                return Err(too_many("layers_pattern", a.len()))
            }
            serde_json::Value::Array(a) => {
                a.iter()
                    .map(|x| x.as_str().map(String::from))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| bad("layers_pattern", "a string or a list of strings", pattern))?
            }
            other => return Err(bad("layers_pattern", "a string or a list of strings", other)),
        };
        let Some(layers) = layers.filter(|l| !l.is_empty()) else {
            if !patterns.is_empty() && indices.is_null() {
                return Err(bad("layers_pattern", "null unless layers_to_transform is given (as in peft)", pattern));
            }
            return Ok(None);
        };
        let patterns = if patterns.is_empty() {
            vec![PyRegex::any_layer()?]
        } else {
            patterns.iter().map(|p| PyRegex::layers_pattern("layers_pattern", p)).collect::<Result<_, _>>()?
        };
        Ok(Some(LayerFilter { layers, patterns }))
    }

    fn from_metadata(meta: &HashMap<String, String>) -> Result<Option<Self>, AdapterError> {
        if !meta.contains_key("r") && !meta.contains_key("lora_alpha") {
            return Ok(None);
        }
        // The same rules as the config file: a finite alpha, a rank in 1..=MAX_RANK.
        let num = |k: &str, expected: &str, ok: &dyn Fn(f64) -> bool| -> Result<Option<f64>, AdapterError> {
            meta.get(k)
                .map(|s| {
                    s.trim().parse::<f64>().ok().filter(|&x| ok(x)).ok_or_else(|| AdapterError::BadConfig {
                        field: format!("__metadata__.{k}"),
                        expected: expected.into(),
                        found: format!("{:?}", s.chars().take(64).collect::<String>()),
                    })
                })
                .transpose()
        };
        let r = num("r", &format!("a positive integer ≤ {MAX_RANK} as a string"), &|r| {
            r.is_finite() && r >= 1.0 && r.fract() == 0.0 && r <= MAX_RANK as f64
        })?;
        let lora_alpha = num("lora_alpha", "a finite number as a string", &|a| a.is_finite())?;
        Ok(Some(Self {
            r: r.map(|r| r as usize),
            lora_alpha,
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
            layers: None,
            source: ConfigSource::DefaultAlphaEqualsRank,
        }
    }

    /// peft's `get_pattern_key`: the value of the first key (in config order) matching `module`.
    fn pattern_value<T: Copy>(map: &PatternMap<T>, module: &str) -> Result<Option<T>, AdapterError> {
        for (key, value) in map {
            if key.matches(module)? {
                return Ok(Some(*value));
            }
        }
        Ok(None)
    }

    /// The rank the config gives module `module` (its full name in the PEFT model, e.g.
    /// `model.layers.0.self_attn.q_proj`; `None`: no config, any rank).
    pub fn rank_for(&self, module: &str) -> Result<Option<usize>, AdapterError> {
        Ok(Self::pattern_value(&self.rank_pattern, module)?.or(self.r))
    }

    /// The multiplier of `B·A` for `module` of `rank` (before the user's scale): alpha / r, or
    /// alpha / √r with rsLoRA; `|scaling| ≤` [`MAX_SCALING`].
    pub fn scaling(&self, module: &str, rank: usize) -> Result<f32, AdapterError> {
        let pattern = Self::pattern_value(&self.alpha_pattern, module)?;
        let alpha = pattern.or(self.lora_alpha).unwrap_or(rank as f64);
        let denom = if self.use_rslora { (rank as f64).sqrt() } else { rank as f64 };
        let scaling = alpha / denom;
        if !(scaling.is_finite() && scaling.abs() <= MAX_SCALING) {
            let field = if pattern.is_some() { "alpha_pattern" } else { "lora_alpha" };
            return Err(AdapterError::BadConfig {
                field: field.into(),
                expected: format!(
                    "alpha / {} of at most {MAX_SCALING} in magnitude",
                    if self.use_rslora { "√r" } else { "r" }
                ),
                found: format!("alpha {alpha} at rank {rank} for {module} (scaling {scaling:e})"),
            });
        }
        Ok(scaling as f32)
    }

    /// Why the config does not target `module` (its full name in the PEFT model), if it does
    /// not: peft's `check_target_module_exists`.
    pub fn excludes(&self, module: &str) -> Result<Option<String>, AdapterError> {
        let excluded = match &self.exclude {
            None => false,
            Some(e) => !matches!(e.hit(module)?, Hit::No),
        };
        if excluded {
            return Ok(Some("exclude_modules".into()));
        }
        let hit = match &self.targets {
            // No list to test against (the adapter holds what was targeted).
            None => Hit::Suffix,
            Some(t) => t.hit(module)?,
        };
        match (hit, &self.layers) {
            (Hit::No, _) => Ok(Some("target_modules".into())),
            (Hit::Suffix, Some(filter)) => {
                let mut index = None;
                for p in &filter.patterns {
                    index = p.layer_index(module)?;
                    if index.is_some() {
                        break;
                    }
                }
                Ok(match index {
                    Some(i) if filter.layers.contains(&i) => None,
                    _ => Some(format!("layers_to_transform {:?}", filter.layers)),
                })
            }
            _ => Ok(None),
        }
    }
}

/// Most patterns of one config that need the backtracking engine: each match of one is bounded
/// (~0.2 ms at the backtracking limit), and a 64-layer model tests 768 module names.
const MAX_BACKTRACKING_PATTERNS: usize = 16;

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
    /// Keys skipped because they cannot affect text generation (vision tower): the first
    /// [`IGNORED_KEPT`] by name (a header of a million such keys costs no more than that).
    pub ignored: Vec<String>,
    /// How many keys were skipped in all.
    pub ignored_count: usize,
}

impl From<ModelError> for AdapterError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::Io { path, source } => AdapterError::Io { path, source },
            ModelError::BadSafetensors { path, message } => AdapterError::BadSafetensors { path, message },
            ModelError::Gpu(g) => AdapterError::Gpu(g),
            ModelError::File(f) => AdapterError::File(f),
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
    } else if std::fs::metadata(path).is_ok() {
        Err(not_peft("not a regular file or a directory (a device, FIFO or socket)"))
    } else {
        Err(AdapterError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        })
    }
}

/// Read a small text file an adapter names: a regular file (not a FIFO or a device) of at most
/// `limit` bytes, read through a bound so a file that grows while read cannot exceed it.
pub(crate) fn read_small_text(path: &Path, limit: u64) -> Result<String, AdapterError> {
    // Checked as a regular file before and after opening (a FIFO swapped in between must not
    // block the read), its size before reading and while reading.
    crate::io::read_bounded_text(path, limit, "adapter config").map_err(|e| match e {
        FileError::Io { source, .. } => AdapterError::Io { path: path.to_path_buf(), source },
        FileError::NotRegular { .. } => {
            AdapterError::NotPeft { path: path.to_path_buf(), reason: "not a regular file".into() }
        }
        FileError::TooLarge { size, .. } => AdapterError::NotPeft {
            path: path.to_path_buf(),
            reason: format!("{size} bytes, more than the {limit} a config may have"),
        },
    })
}

/// Parse the JSON of an adapter's config file.
pub(crate) fn read_json(path: &Path) -> Result<serde_json::Value, AdapterError> {
    let text = read_small_text(path, MAX_CONFIG_BYTES)?;
    serde_json::from_str(&text).map_err(|e| AdapterError::NotPeft {
        path: path.to_path_buf(),
        reason: format!("adapter_config.json is not JSON: {e}"),
    })
}

fn read_config(path: &Path) -> Result<PeftConfig, AdapterError> {
    PeftConfig::from_json(&read_json(path)?)
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
pub(crate) type KeyPair = (String, [Option<String>; 2]);

/// Refuse an adapter whose factors hold more than [`MAX_ADAPTER_ELEMENTS`] in all, from the
/// header's shapes of every key in `pairs`, before any value is read.
pub(crate) fn check_total(ckpt: &Checkpoint, pairs: &BTreeMap<(usize, Proj), KeyPair>) -> Result<(), AdapterError> {
    let keys = pairs.values().flat_map(|(_, keys)| keys.iter().flatten());
    let numel =
        |k: &String| ckpt.get(k).map_or(Some(0), |e| e.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)));
    let total = keys.map(numel).try_fold(0usize, |acc, n| n.and_then(|n| acc.checked_add(n)));
    if total.is_none_or(|t| t > MAX_ADAPTER_ELEMENTS) {
        return Err(AdapterError::BadConfig {
            field: "adapter size".into(),
            expected: format!("at most {MAX_ADAPTER_ELEMENTS} elements over every lora_A and lora_B"),
            found: total.map_or("more than 2^64".into(), |t| t.to_string()),
        });
    }
    Ok(())
}

/// Record `key` (factor `slot`) of `module` for (layer, proj): a second module name for the same
/// projection (the text-class and the VLM-class prefix both present) is refused, never merged.
pub(crate) fn record_pair(
    pairs: &mut BTreeMap<(usize, Proj), KeyPair>,
    at: (usize, Proj),
    module: &str,
    slot: usize,
    key: &str,
) -> Result<(), AdapterError> {
    let entry = pairs.entry(at).or_insert_with(|| (module.to_string(), [None, None]));
    if entry.0 != module || entry.1[slot].is_some() {
        let other = entry.1.iter().flatten().next().cloned().unwrap_or_else(|| entry.0.clone());
        return Err(AdapterError::DuplicateModule { key: key.into(), other });
    }
    entry.1[slot] = Some(key.to_string());
    Ok(())
}

/// At most this many ignored keys are kept by name in [`ParsedAdapter::ignored`].
const IGNORED_KEPT: usize = 32;

/// Check a factor's rank (`rank_at` of `shape`) and its element count against [`MAX_RANK`] with
/// checked arithmetic, before anything is read.
pub(crate) fn check_rank(key: &str, shape: &[usize], rank: usize) -> Result<(), AdapterError> {
    let numel = shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
    if rank > MAX_RANK || numel.is_none() {
        return Err(AdapterError::BadConfig {
            field: key.into(),
            expected: format!("a rank of at most {MAX_RANK}"),
            found: format!("shape {shape:?}"),
        });
    }
    Ok(())
}

/// Read and validate the adapter at `path` (a PEFT directory or a `.safetensors` file, or an MLX
/// adapter: [`crate::lora::mlx`]) for a model with config `model`. Pure CPU: nothing touches a
/// GPU until [`crate::lora::LoraAdapter::upload`].
pub fn parse(path: &Path, model: &TextConfig) -> Result<ParsedAdapter, AdapterError> {
    if crate::lora::mlx::is_mlx(path) {
        return crate::lora::mlx::parse(path, model);
    }
    model.check().map_err(|e| AdapterError::ModelConfig(Box::new(e)))?;
    let (weights, config_path) = locate(path)?;
    let ckpt = Checkpoint::open_files(std::slice::from_ref(&weights))?;
    let config = match &config_path {
        Some(c) => read_config(c)?,
        None => PeftConfig::from_metadata(ckpt.metadata())?.unwrap_or_else(PeftConfig::none),
    };
    let re = key_regex();
    let mut pairs: BTreeMap<(usize, Proj), KeyPair> = BTreeMap::new();
    let mut ignored = Vec::new();
    let mut ignored_count = 0;
    let mut names: Vec<&str> = ckpt.names().collect();
    names.sort_unstable();
    for key in names {
        let Some(cap) = re.captures(key) else {
            match classify_other(key) {
                Some(err) => return Err(err),
                None => {
                    ignored_count += 1;
                    if ignored.len() < IGNORED_KEPT {
                        ignored.push(key.to_string());
                    }
                    continue;
                }
            }
        };
        let module = &cap["module"];
        let at = layer_projection(key, &cap["layer"], &cap["path"], model)?;
        if let Some(why) = config.excludes(module)? {
            return Err(AdapterError::NotTargeted { key: key.into(), why });
        }
        let slot = if &cap["ab"] == "A" { 0 } else { 1 };
        record_pair(&mut pairs, at, module, slot, key)?;
    }
    check_total(&ckpt, &pairs)?;
    let mut deltas = Vec::with_capacity(pairs.len());
    for ((layer, proj), (module, [a_key, b_key])) in pairs {
        let (a_key, b_key) = both_keys(a_key, b_key, ["lora_A", "lora_B"])?;
        let (fan_in, fan_out) = proj.dims(model);
        let a_entry =
            ckpt.get(&a_key).ok_or_else(|| AdapterError::MissingPair { key: b_key.clone(), missing: a_key.clone() })?;
        let rank = a_entry.shape.first().copied().unwrap_or(0);
        check_rank(&a_key, &a_entry.shape, rank)?;
        let want_rank = config.rank_for(&module)?;
        if a_entry.shape.len() != 2 || a_entry.shape[1] != fan_in || rank == 0 {
            return Err(AdapterError::ShapeMismatch {
                key: a_key,
                expected: vec![want_rank.unwrap_or(rank.max(1)), fan_in],
                found: a_entry.shape.clone(),
            });
        }
        if let Some(want) = want_rank {
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
        let scaling = config.scaling(&module, rank)?;
        let a = read_values(&ckpt, &a_key)?;
        let b = read_values(&ckpt, &b_key)?;
        deltas.push(ModuleDelta { layer, proj, rank, scaling, a, b });
    }
    if deltas.is_empty() {
        return Err(AdapterError::Empty { path: weights });
    }
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "adapter".into());
    Ok(ParsedAdapter { path: path.to_path_buf(), name, config, deltas, ignored, ignored_count })
}

/// A factor's values in f32: finite, `|w| ≤` [`MAX_WEIGHT`], as many as its shape says.
pub(crate) fn read_values(ckpt: &Checkpoint, key: &str) -> Result<Vec<f32>, AdapterError> {
    let entry = ckpt.get(key).ok_or_else(|| AdapterError::UnknownKey { key: key.into(), why: "vanished".into() })?;
    let dtype = Dtype::from_safetensors(&entry.dtype)
        .ok_or_else(|| AdapterError::UnsupportedDtype { key: key.into(), found: entry.dtype.clone() })?;
    let values = dtype
        .to_f32(&ckpt.read_raw(entry)?)
        .ok_or_else(|| AdapterError::UnsupportedDtype { key: key.into(), found: entry.dtype.clone() })?;
    if Some(values.len()) != entry.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d)) {
        return Err(AdapterError::ShapeMismatch {
            key: key.into(),
            expected: entry.shape.clone(),
            found: vec![values.len()],
        });
    }
    if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| !v.is_finite()) {
        return Err(AdapterError::NonFinite { key: key.into(), index, value });
    }
    if let Some((index, &value)) = values.iter().enumerate().find(|(_, v)| v.abs() > MAX_WEIGHT) {
        return Err(AdapterError::WeightTooLarge { key: key.into(), index, value, limit: MAX_WEIGHT });
    }
    Ok(values)
}
