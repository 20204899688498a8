//! The `quantization` section of an MLX `config.json` (also written as `quantization_config`):
//! a default `{group_size, bits, mode}` and per-module overrides keyed by the module path
//! (`language_model.model.layers.0.mlp.up_proj`), an object or `false` (kept in 16-bit). Other
//! quantization methods (a `quant_method` key: GPTQ, AWQ, FP8, compressed-tensors, bitsandbytes)
//! are recognised and refused by name.

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
            return Err(ModelError::Unsupported {
                what: format!("{field}.quant_method {method} (MLX affine 4/8-bit checkpoints load; GPTQ, AWQ, FP8, compressed-tensors and bitsandbytes do not)"),
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

    /// What the section says of the module at `path`: `Some(spec)` quantized, `None` kept in
    /// 16-bit (an explicit `false`, or no default).
    pub fn module(&self, path: &str) -> Option<QuantSpec> {
        match self.modules.get(path) {
            Some(entry) => *entry,
            None => self.default,
        }
    }
}
