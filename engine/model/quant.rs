//! The quantization section of a `config.json`:
//! * MLX (`quantization`, also written as `quantization_config`): a default `{group_size, bits,
//!   mode}` and per-module overrides keyed by the module path
//!   (`language_model.model.layers.0.mlp.up_proj`), an object or `false` (kept in 16-bit);
//! * compressed-tensors `pack-quantized` integer weights, symmetric, grouped, no activation
//!   quantization (W4A16/W8A16 as llm-compressor writes them): `quantization_config` with
//!   `quant_method: "compressed-tensors"` and one weight scheme in `config_groups`; the modules
//!   that carry `weight_packed` are quantized, the rest (`ignore`) are not.
//!
//! Other methods (GPTQ, AWQ, FP8, bitsandbytes, other compressed-tensors formats) are refused by
//! name.

use std::collections::HashMap;

use crate::error::ModelError;
use crate::gpu::Affine;

/// Bits and group size of one quantized module (the scale dtype comes from its tensors).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantSpec {
    /// Bits per weight.
    pub bits: u32,
    /// Inputs per scale/bias pair.
    pub group: u32,
}

/// The parsed section.
#[derive(Clone, Debug, Default)]
pub struct QuantConfig {
    default: Option<QuantSpec>,
    modules: HashMap<String, Option<QuantSpec>>,
    /// compressed-tensors: the weight scheme of every module with `weight_packed`.
    compressed: Option<QuantSpec>,
}

/// compressed-tensors' `quantization_config`: one symmetric, grouped integer weight scheme.
fn compressed_tensors(obj: &serde_json::Map<String, serde_json::Value>) -> Result<QuantSpec, ModelError> {
    let field = "quantization_config";
    let format = obj.get("format").and_then(|f| f.as_str()).unwrap_or("");
    if format != "pack-quantized" {
        return Err(ModelError::Unsupported {
            what: format!("{field}.format {format:?} of compressed-tensors (pack-quantized integer weights load)"),
        });
    }
    let groups = obj.get("config_groups").and_then(|g| g.as_object()).filter(|g| !g.is_empty()).ok_or_else(|| {
        bad(format!("{field}.config_groups"), "an object of schemes", format!("{:?}", obj.get("config_groups")))
    })?;
    // Sections that change the math when present: online rotations (vLLM applies them), a
    // quantized KV cache, quantized outputs.
    let present = |v: &serde_json::Value| !(v.is_null() || v.as_object().is_some_and(|o| o.is_empty()));
    // llm-compressor's "dense" sparsity format stores ordinary dense tensors.
    let dense = |v: &serde_json::Value| v["format"].as_str().is_some_and(|f| f.eq_ignore_ascii_case("dense"));
    for (key, what) in [
        ("transform_config", "online rotations (Hadamard / SpinQuant transforms)"),
        ("kv_cache_scheme", "a quantized KV cache"),
        ("sparsity_config", "sparse compression"),
    ] {
        if obj.get(key).is_some_and(|v| present(v) && !dense(v)) {
            return Err(ModelError::Unsupported { what: format!("{field}.{key}: {what}") });
        }
    }
    let mut found: Option<QuantSpec> = None;
    for (name, g) in groups {
        let at = format!("{field}.config_groups.{name}");
        for key in ["input_activations", "output_activations"] {
            if g.get(key).is_some_and(|a| !a.is_null()) {
                return Err(ModelError::Unsupported { what: format!("{at}.{key} (activation quantization)") });
            }
        }
        let w = g
            .get("weights")
            .and_then(|w| w.as_object())
            .ok_or_else(|| bad(format!("{at}.weights"), "an object", "nothing".into()))?;
        let text = |k: &str| w.get(k).and_then(|v| v.as_str()).unwrap_or("").to_string();
        if text("type") != "int" {
            return Err(ModelError::Unsupported {
                what: format!("{at}.weights.type {:?} (integer weights load)", text("type")),
            });
        }
        if w.get("symmetric").and_then(|v| v.as_bool()) != Some(true) {
            return Err(ModelError::Unsupported { what: format!("{at}.weights.symmetric false (zero points)") });
        }
        // compressed-tensors 0.20 refuses these (their g_idx maps columns to groups out of order);
        // "weight" / "static" only reorder calibration and keep the format.
        let actorder = w.get("actorder").unwrap_or(&serde_json::Value::Null);
        let removed = actorder.as_bool() == Some(true)
            || actorder.as_str().is_some_and(|a| a.eq_ignore_ascii_case("group") || a.eq_ignore_ascii_case("dynamic"));
        if removed {
            return Err(ModelError::Unsupported {
                what: format!("{at}.weights.actorder {actorder} (group activation ordering)"),
            });
        }
        if text("strategy") != "group" {
            return Err(ModelError::Unsupported {
                what: format!("{at}.weights.strategy {:?} (groups of 32, 64 or 128 load)", text("strategy")),
            });
        }
        let int = |k: &str| w.get(k).and_then(|v| v.as_u64()).and_then(|v| u32::try_from(v).ok());
        let (bits, group) = match (int("num_bits"), int("group_size")) {
            (Some(b), Some(g)) => (b, g),
            _ => return Err(bad(format!("{at}.weights"), "num_bits and group_size", format!("{w:?}"))),
        };
        if !Affine::BITS.contains(&bits) {
            return Err(bad(format!("{at}.weights.num_bits"), &format!("one of {:?}", Affine::BITS), bits.to_string()));
        }
        if !Affine::GROUPS.contains(&group) {
            return Err(bad(
                format!("{at}.weights.group_size"),
                &format!("one of {:?}", Affine::GROUPS),
                group.to_string(),
            ));
        }
        let spec = QuantSpec { bits, group };
        if found.is_some_and(|f| f != spec) {
            return Err(ModelError::Unsupported {
                what: format!("{field}.config_groups with different weight schemes"),
            });
        }
        found = Some(spec);
    }
    found.ok_or_else(|| bad(format!("{field}.config_groups"), "a weight scheme", "none".into()))
}

fn bad(field: String, expected: &str, found: String) -> ModelError {
    ModelError::BadConfig { field, expected: expected.to_string(), found }
}

/// `{group_size, bits, mode}` at `field`, checked against what the kernels decode.
fn spec(field: &str, v: &serde_json::Map<String, serde_json::Value>) -> Result<QuantSpec, ModelError> {
    let mode = v.get("mode").and_then(|m| m.as_str()).unwrap_or("affine");
    if mode != "affine" {
        return Err(ModelError::Unsupported { what: format!("{field}.mode {mode:?} (affine loads)") });
    }
    let int = |key: &str| -> Result<u32, ModelError> {
        let found = v.get(key);
        found
            .and_then(|x| x.as_u64())
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| bad(format!("{field}.{key}"), "an integer", format!("{found:?}")))
    };
    let (bits, group) = (int("bits")?, int("group_size")?);
    if !Affine::BITS.contains(&bits) {
        return Err(bad(format!("{field}.bits"), &format!("one of {:?}", Affine::BITS), bits.to_string()));
    }
    if !Affine::GROUPS.contains(&group) {
        return Err(bad(format!("{field}.group_size"), &format!("one of {:?}", Affine::GROUPS), group.to_string()));
    }
    Ok(QuantSpec { bits, group })
}

impl QuantConfig {
    /// The section of a parsed `config.json`, if it has one.
    pub fn from_config(top: &serde_json::Value) -> Result<Option<Self>, ModelError> {
        let (field, section) = match (top.get("quantization"), top.get("quantization_config")) {
            (Some(q), _) => ("quantization", q),
            (None, Some(q)) => ("quantization_config", q),
            (None, None) => return Ok(None),
        };
        let obj = section.as_object().ok_or_else(|| bad(field.to_string(), "an object", section.to_string()))?;
        if let Some(method) = obj.get("quant_method") {
            if method.as_str() == Some("compressed-tensors") {
                return Ok(Some(QuantConfig { compressed: Some(compressed_tensors(obj)?), ..Default::default() }));
            }
            return Err(ModelError::Unsupported {
                what: format!("{field}.quant_method {method} (MLX affine and compressed-tensors pack-quantized checkpoints load; GPTQ, AWQ, FP8 and bitsandbytes do not)"),
            });
        }
        let mut out = QuantConfig::default();
        if obj.contains_key("bits") || obj.contains_key("group_size") {
            out.default = Some(spec(field, obj)?);
        }
        for (key, v) in obj {
            let module_field = format!("{field}.{key}");
            match v {
                serde_json::Value::Object(m) => {
                    out.modules.insert(key.clone(), Some(spec(&module_field, m)?));
                }
                serde_json::Value::Bool(false) => {
                    out.modules.insert(key.clone(), None);
                }
                serde_json::Value::Bool(true) => {
                    out.modules.insert(key.clone(), out.default);
                }
                _ => {}
            }
        }
        Ok(Some(out))
    }

    /// The compressed-tensors weight scheme, for a checkpoint of that format.
    pub fn compressed(&self) -> Option<QuantSpec> {
        self.compressed
    }

    /// What the section says of the module at `path`: `Some(spec)` quantized, `None` kept in
    /// 16-bit (an explicit `false`, or no default).
    pub fn module(&self, path: &str) -> Option<QuantSpec> {
        match self.modules.get(path) {
            Some(entry) => *entry,
            None => self.default,
        }
    }
}
