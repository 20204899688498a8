//! `config.json`: the VLM form (`model_type: "qwen3_5"` with `text_config`), the text-only form
//! (`qwen3_5_text`) and mlx-lm's flat `qwen3_5` form, validated into the dimensions the kernels
//! need.

use std::path::Path;

use serde::Deserialize;

use crate::error::ModelError;
use crate::io::{read_bounded_text, MAX_JSON_BYTES};

/// Largest head_dim the engine runs: `WG × MAX_DIMS` of `attention.wgsl` (the shader's limit,
/// stated here so the config check needs nothing from the kernels).
pub const MAX_HEAD_DIM: usize = 512;

/// Largest GDN conv kernel width the engine runs: `MAX_K` of `gdn_conv.wgsl`.
pub const MAX_CONV_K: usize = 8;

/// Most decoder layers (Qwen 3.5 checkpoints have 24 to 64). Every bound below is checked before
/// anything is allocated from the config, so a hostile `config.json` gives a typed error, not an
/// allocation abort.
pub const MAX_LAYERS: usize = 1024;

/// Largest hidden size (Qwen 3.5: 1,024 to 5,120).
pub const MAX_HIDDEN: usize = 65_536;

/// Largest vocabulary (Qwen 3.5: 248,320); token ids then also fit the GPU kernels' indices.
pub const MAX_VOCAB: usize = 1 << 24;

/// Largest MLP width (Qwen 3.5: 3,584 to 17,408).
pub const MAX_INTERMEDIATE: usize = 1 << 20;

/// Most heads of any kind (attention, KV, GDN key and value heads).
pub const MAX_HEADS: usize = 1024;

/// Largest GDN key or value head dim (Qwen 3.5: 128).
pub const MAX_LINEAR_HEAD_DIM: usize = 1024;

/// Most weight elements the config may describe (2^40, a trillion: far above any dense model
/// this engine runs, far below what overflows a byte count).
pub const MAX_PARAMS: u64 = 1 << 40;

/// The token mixer of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// Gated DeltaNet (`"linear_attention"`).
    Linear,
    /// Gated softmax attention (`"full_attention"`).
    Full,
}

#[derive(Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    // mlx-lm writes the key as `type`; transformers re-saves such a config with both.
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
}

#[derive(Deserialize)]
struct RawText {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    hidden_act: Option<String>,
    rms_norm_eps: Option<f64>,
    tie_word_embeddings: Option<bool>,
    rope_parameters: Option<RawRope>,
    rope_theta: Option<f64>,
    partial_rotary_factor: Option<f64>,
    linear_conv_kernel_dim: usize,
    linear_key_head_dim: usize,
    linear_value_head_dim: usize,
    linear_num_key_heads: usize,
    linear_num_value_heads: usize,
    layer_types: Option<Vec<String>>,
    full_attention_interval: Option<usize>,
    eos_token_id: Option<serde_json::Value>,
    attention_bias: Option<bool>,
    /// The legacy name of `rope_parameters`: transformers lets a non-null one replace them.
    rope_scaling: Option<serde_json::Value>,
}

/// The validated text-decoder configuration.
#[derive(Clone, Debug)]
pub struct TextConfig {
    /// Vocabulary size V.
    pub vocab_size: usize,
    /// Hidden size H.
    pub hidden_size: usize,
    /// MLP width I.
    pub intermediate_size: usize,
    /// Layer types, one per layer.
    pub layer_types: Vec<LayerType>,
    /// Query heads Hq.
    pub num_heads: usize,
    /// KV heads Hkv.
    pub num_kv_heads: usize,
    /// Attention head dim hd.
    pub head_dim: usize,
    /// Rotary dims R (even, ≤ hd).
    pub rotary_dim: usize,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// Epsilon of every RMSNorm.
    pub rms_norm_eps: f32,
    /// Conv kernel width K.
    pub conv_kernel: usize,
    /// GDN key heads Hk.
    pub linear_key_heads: usize,
    /// GDN value heads Hv.
    pub linear_value_heads: usize,
    /// GDN key head dim Dk.
    pub linear_key_dim: usize,
    /// GDN value head dim Dv.
    pub linear_value_dim: usize,
    /// Whether lm_head shares the embedding (config's word; the loader also looks at the files).
    pub tie_word_embeddings: bool,
    /// End-of-sequence ids from config.json (generation_config.json takes precedence).
    pub eos_token_ids: Vec<u32>,
}

impl TextConfig {
    /// Read and validate `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        Self::from_json(&read_bounded_text(&path, MAX_JSON_BYTES, "config.json")?)
    }

    /// Parse and validate the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let bad_json =
            |e: serde_json::Error| ModelError::BadJson { file: "config.json".into(), message: e.to_string() };
        let top: serde_json::Value = serde_json::from_str(text).map_err(bad_json)?;
        let model_type = top.get("model_type").and_then(|v| v.as_str()).unwrap_or("").to_string();
        let (mut text_value, top_tie) = match model_type.as_str() {
            // The VLM form nests the text model; mlx-lm writes it flat under the same model_type.
            "qwen3_5" => match top.get("text_config") {
                Some(inner) => (inner.clone(), top.get("tie_word_embeddings").and_then(|v| v.as_bool())),
                None => (top.clone(), None),
            },
            "qwen3_5_text" => (top.clone(), None),
            t if t.starts_with("qwen3_5_moe") => {
                return Err(ModelError::Unsupported { what: format!("mixture-of-experts model_type {t:?}") })
            }
            other => {
                return Err(ModelError::BadConfig {
                    field: "model_type".into(),
                    expected: "\"qwen3_5\" or \"qwen3_5_text\"".into(),
                    found: format!("{other:?}"),
                })
            }
        };
        // transformers' generation config takes the VLM form's top-level end ids first.
        if let (Some(eos), Some(_)) = (top.get("eos_token_id").filter(|v| !v.is_null()), top.get("text_config")) {
            if let Some(text) = text_value.as_object_mut() {
                text.insert("eos_token_id".into(), eos.clone());
            }
        }
        let raw: RawText = serde_json::from_value(text_value).map_err(bad_json)?;
        if let Some(t) = &raw.model_type {
            if t.starts_with("qwen3_5_moe") {
                return Err(ModelError::Unsupported { what: format!("mixture-of-experts model_type {t:?}") });
            }
        }
        Self::validate(raw, top_tie)
    }

    fn validate(raw: RawText, top_tie: Option<bool>) -> Result<Self, ModelError> {
        let bad = |field: &str, expected: &str, found: String| ModelError::BadConfig {
            field: field.into(),
            expected: expected.into(),
            found,
        };
        let act = raw.hidden_act.clone().unwrap_or_else(|| "silu".into());
        if act != "silu" {
            return Err(bad("hidden_act", "\"silu\"", format!("{act:?}")));
        }
        // Bounded before layer_types is built from it.
        if raw.num_hidden_layers == 0 || raw.num_hidden_layers > MAX_LAYERS {
            return Err(bad("num_hidden_layers", &format!("1..={MAX_LAYERS}"), raw.num_hidden_layers.to_string()));
        }
        if raw.attention_bias == Some(true) {
            return Err(ModelError::Unsupported {
                what: "attention_bias: true (biases on q/k/v/o_proj, which Qwen 3.5 does not have)".into(),
            });
        }
        // transformers: `rope_parameters = rope_scaling or rope_parameters` (an empty object is
        // falsy), its type "default" when it names none. Only plain RoPE runs.
        let scaling = raw.rope_scaling.as_ref().filter(|v| !v.is_null() && v.as_object().is_none_or(|o| !o.is_empty()));
        let replaced = match scaling {
            Some(v) => {
                let kind = v.get("rope_type").or_else(|| v.get("type")).map(|t| t.as_str());
                if !matches!(kind, None | Some(Some("default"))) {
                    return Err(bad("rope_scaling", "null or plain RoPE (rope_type \"default\")", v.to_string()));
                }
                Some(
                    serde_json::from_value::<RawRope>(v.clone())
                        .map_err(|e| bad("rope_scaling", "an object of rope parameters", format!("{v} ({e})")))?,
                )
            }
            None => None,
        };
        let rope = replaced.as_ref().or(raw.rope_parameters.as_ref());
        if let Some(r) = rope {
            if let (Some(a), Some(b)) = (&r.rope_type, &r.legacy_type) {
                if a != b {
                    return Err(bad("rope_parameters.type", &format!("{a:?} (as rope_type)"), format!("{b:?}")));
                }
            }
        }
        if let Some(t) = rope.and_then(|r| r.rope_type.as_deref().or(r.legacy_type.as_deref())) {
            if t != "default" {
                return Err(bad("rope_parameters.rope_type", "\"default\"", format!("{t:?}")));
            }
        }
        let rope_theta = rope
            .and_then(|r| r.rope_theta)
            .or(raw.rope_theta)
            .ok_or_else(|| bad("rope_parameters.rope_theta", "a number", "nothing".into()))?;
        let factor = rope.and_then(|r| r.partial_rotary_factor).or(raw.partial_rotary_factor).unwrap_or(0.25);
        // 0 is no rotary dims at all (the kernels run that); NaN fails both comparisons.
        if !(0.0..=1.0).contains(&factor) {
            return Err(bad("partial_rotary_factor", "a number in [0, 1]", factor.to_string()));
        }
        // Checked by `check` as the f32 the kernels use: 1e-50 is positive in f64 and 0 in f32.
        let rms_norm_eps = raw.rms_norm_eps.unwrap_or(1e-6);
        let rotary_dim = (raw.head_dim as f64 * factor) as usize;
        let layer_types = match &raw.layer_types {
            Some(list) => {
                if list.len() != raw.num_hidden_layers {
                    return Err(bad(
                        "layer_types",
                        &format!("{} entries (num_hidden_layers)", raw.num_hidden_layers),
                        list.len().to_string(),
                    ));
                }
                list.iter()
                    .map(|t| match t.as_str() {
                        "linear_attention" => Ok(LayerType::Linear),
                        "full_attention" => Ok(LayerType::Full),
                        other => {
                            Err(bad("layer_types", "\"linear_attention\" or \"full_attention\"", format!("{other:?}")))
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            None => {
                let interval = raw.full_attention_interval.unwrap_or(4);
                if interval == 0 {
                    // transformers and mlx-lm divide by it.
                    return Err(bad("full_attention_interval", "a positive integer", "0".into()));
                }
                (0..raw.num_hidden_layers)
                    .map(|i| if (i + 1) % interval == 0 { LayerType::Full } else { LayerType::Linear })
                    .collect()
            }
        };
        let config = Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            layer_types,
            num_heads: raw.num_attention_heads,
            num_kv_heads: raw.num_key_value_heads,
            head_dim: raw.head_dim,
            rotary_dim,
            rope_theta,
            rms_norm_eps: rms_norm_eps as f32,
            conv_kernel: raw.linear_conv_kernel_dim,
            linear_key_heads: raw.linear_num_key_heads,
            linear_value_heads: raw.linear_num_value_heads,
            linear_key_dim: raw.linear_key_head_dim,
            linear_value_dim: raw.linear_value_head_dim,
            tie_word_embeddings: top_tie.or(raw.tie_word_embeddings).unwrap_or(false),
            eos_token_ids: match &raw.eos_token_id {
                Some(v) => parse_ids("config.json", v, raw.vocab_size)?.unwrap_or_default(),
                None => Vec::new(),
            },
        };
        config.check()?;
        Ok(config)
    }

    /// Check the bounds the engine runs within (what [`Self::from_json`] checks of the numbers).
    /// The fields are public, so a config built or changed by hand reaches the functions that
    /// take one ([`crate::runtime::rope_table`], the adapter parsers) through this check.
    pub fn check(&self) -> Result<(), ModelError> {
        let bad = |field: &str, expected: &str, found: String| ModelError::BadConfig {
            field: field.into(),
            expected: expected.into(),
            found,
        };
        let layers = self.layer_types.len();
        for (name, v, max) in [
            ("vocab_size", self.vocab_size, MAX_VOCAB),
            ("hidden_size", self.hidden_size, MAX_HIDDEN),
            ("intermediate_size", self.intermediate_size, MAX_INTERMEDIATE),
            ("num_hidden_layers", layers, MAX_LAYERS),
            ("num_attention_heads", self.num_heads, MAX_HEADS),
            ("num_key_value_heads", self.num_kv_heads, MAX_HEADS),
            ("head_dim", self.head_dim, MAX_HEAD_DIM),
            ("linear_num_key_heads", self.linear_key_heads, MAX_HEADS),
            ("linear_num_value_heads", self.linear_value_heads, MAX_HEADS),
            ("linear_key_head_dim", self.linear_key_dim, MAX_LINEAR_HEAD_DIM),
            ("linear_value_head_dim", self.linear_value_dim, MAX_LINEAR_HEAD_DIM),
            ("linear_conv_kernel_dim", self.conv_kernel, MAX_CONV_K),
        ] {
            if v == 0 {
                return Err(bad(name, "a positive integer", "0".into()));
            }
            if v > max {
                return Err(bad(name, &format!("at most {max}"), v.to_string()));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(bad(
                "num_key_value_heads",
                "a divisor of num_attention_heads",
                format!("{} (num_attention_heads {})", self.num_kv_heads, self.num_heads),
            ));
        }
        if !self.linear_value_heads.is_multiple_of(self.linear_key_heads) {
            return Err(bad(
                "linear_num_key_heads",
                "a divisor of linear_num_value_heads",
                format!("{} (linear_num_value_heads {})", self.linear_key_heads, self.linear_value_heads),
            ));
        }
        // As an f32 it must be a normal number: 1e-300 becomes 0 and makes the RoPE table NaN.
        let theta = self.rope_theta;
        if !(theta.is_finite() && theta > 0.0 && (theta as f32).is_normal()) {
            return Err(bad("rope_theta", "a finite number > 0 that is a normal f32", theta.to_string()));
        }
        let eps = self.rms_norm_eps;
        if !(eps.is_finite() && eps > 0.0) {
            return Err(bad("rms_norm_eps", "a finite number > 0 (as f32)", eps.to_string()));
        }
        if !self.rotary_dim.is_multiple_of(2) || self.rotary_dim > self.head_dim {
            return Err(bad(
                "partial_rotary_factor",
                "a factor giving an even rotary dim <= head_dim",
                format!("rotary dim {} (head_dim {})", self.rotary_dim, self.head_dim),
            ));
        }
        if let Some(id) = self.eos_token_ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(bad("eos_token_id", &format!("ids below vocab_size {}", self.vocab_size), id.to_string()));
        }
        let params = self.weight_elements();
        if params.is_none_or(|p| p > MAX_PARAMS) {
            let found = params.map_or("more than 2^64".to_string(), |p| p.to_string());
            return Err(bad("(parameter count)", &format!("at most {MAX_PARAMS} weight elements"), found));
        }
        Ok(())
    }

    /// Weight elements of the text model (embedding, lm_head counted even when tied, every
    /// projection), with checked arithmetic: `None` on overflow.
    pub fn weight_elements(&self) -> Option<u64> {
        let m = |a: usize, b: usize| (a as u64).checked_mul(b as u64);
        let h = self.hidden_size;
        let embed = m(self.vocab_size, h)?.checked_mul(2)?;
        let mlp = m(self.intermediate_size, h)?.checked_mul(3)?;
        let attn_width = m(self.num_heads, self.head_dim)?;
        let kv_width = m(self.num_kv_heads, self.head_dim)?;
        // q (with its gate), k, v and o.
        let attn = attn_width.checked_mul(3)?.checked_add(kv_width.checked_mul(2)?)?.checked_mul(h as u64)?;
        let key = m(self.linear_key_heads, self.linear_key_dim)?;
        let value = m(self.linear_value_heads, self.linear_value_dim)?;
        // in_proj_qkv (2·Kd + Vd), z (Vd), b and a (Hv each), out_proj (Vd).
        let gdn_rows =
            key.checked_mul(2)?.checked_add(value.checked_mul(3)?)?.checked_add(2 * self.linear_value_heads as u64)?;
        let gdn = gdn_rows.checked_mul(h as u64)?;
        let mut total = embed;
        for t in &self.layer_types {
            let mixer = if *t == LayerType::Full { attn } else { gdn };
            total = total.checked_add(mixer)?.checked_add(mlp)?;
        }
        Some(total)
    }

    /// Most elements the text model's tensors may hold: [`Self::weight_elements`] plus every
    /// layer's vectors (two norms, the GDN conv with a bias, `A_log`, `dt_bias` and gated norm,
    /// the attention's q/k norms) and the final norm, with checked arithmetic. `save_mlx` bounds
    /// what it reads by it: a checkpoint holding more under the text prefix is not this model.
    pub fn tensor_elements_bound(&self) -> Option<u64> {
        let h = self.hidden_size as u64;
        let conv = (self.conv_dim() as u64).checked_mul(self.conv_kernel as u64 + 1)?;
        let per_layer = h
            .checked_mul(2)?
            .checked_add(conv)?
            .checked_add(2 * self.linear_value_heads as u64 + self.linear_value_dim as u64)?
            .checked_add(2 * self.head_dim as u64)?;
        let layers = (self.layer_types.len() as u64).checked_mul(per_layer)?;
        self.weight_elements()?.checked_add(layers)?.checked_add(h)
    }

    /// Layers.
    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// GDN key width Kd = Hk·Dk.
    pub fn key_dim(&self) -> usize {
        self.linear_key_heads * self.linear_key_dim
    }

    /// GDN value width Vd = Hv·Dv.
    pub fn value_dim(&self) -> usize {
        self.linear_value_heads * self.linear_value_dim
    }

    /// GDN conv channels C = 2·Kd + Vd.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// An `eos_token_id` value of `file`: an integer or a list of integers, each below `vocab`;
/// `null` is no value (`None`). Anything else is an error naming the field: a dropped id would
/// let generation run past the end of every answer.
pub fn parse_ids(file: &str, v: &serde_json::Value, vocab: usize) -> Result<Option<Vec<u32>>, ModelError> {
    let bad = |found: &serde_json::Value| ModelError::BadConfig {
        field: format!("{file} eos_token_id"),
        expected: format!("a token id below the vocabulary size {vocab}, or a list of them"),
        found: found.to_string().chars().take(80).collect(),
    };
    let id = |x: &serde_json::Value| {
        x.as_u64().filter(|&x| x < vocab as u64).and_then(|x| u32::try_from(x).ok()).ok_or_else(|| bad(x))
    };
    match v {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::Array(a) => a.iter().map(id).collect::<Result<_, _>>().map(Some),
        _ => id(v).map(|x| Some(vec![x])),
    }
}
