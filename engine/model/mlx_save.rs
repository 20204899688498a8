//! Writing a 16/32-bit checkpoint quantized as an MLX directory, as `mlx_lm.convert` writes one:
//! `model.safetensors` (metadata `format: mlx`) with the `language_model.model.` names, every
//! matrix the recipe quantizes as `weight` (u32 codes) + `scales` + `biases`, conv weights as
//! `[C, K, 1]`, the RMSNorm weights Qwen 3.5 stores as offsets shifted by +1 in their dtype, no
//! `mtp.*`, vision tensors or tied `lm_head`; `config.json` with `model_type: "qwen3_5"` and the
//! `quantization` / `quantization_config` sections (per-module entries where the recipe departs
//! from its default). The tensors are byte for byte what mlx-lm writes for the same weights.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::{Dtype as StDtype, TensorView};

use crate::error::ModelError;
use crate::gpu::{Dtype, HalfType};
use crate::model::quant::QuantConfig;
use crate::model::quantize::{quantize_bytes, QuantizeRecipe};
use crate::model::{Checkpoint, TextConfig};

/// The RMSNorm weights Qwen 3.5 stores as offsets (`x · (1 + w)`), which MLX files hold as `1 + w`:
/// the final `norm.weight` and these per-layer ones (not `linear_attn.norm`, a plain weight).
const OFFSET_NORMS: [&str; 4] =
    [".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight"];

/// What [`save_mlx`] wrote.
#[derive(Clone, Debug)]
pub struct MlxSaveReport {
    /// Tensors written.
    pub tensors: usize,
    /// Matrices quantized.
    pub quantized: usize,
    /// Bytes of `model.safetensors`' tensor data.
    pub bytes: u64,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ModelError + '_ {
    move |source| ModelError::Io { path: path.to_path_buf(), source }
}

fn st_dtype(name: &str, dtype: &str) -> Result<StDtype, ModelError> {
    Ok(match dtype {
        "F32" => StDtype::F32,
        "BF16" => StDtype::BF16,
        "F16" => StDtype::F16,
        other => return Err(ModelError::UnsupportedDtype { name: name.to_string(), found: other.to_string() }),
    })
}

/// `w + 1` in the tensor's own dtype (MLX adds in f32 and rounds to nearest even).
fn plus_one(dtype: Dtype, bytes: &[u8]) -> Option<Vec<u8>> {
    let values = dtype.to_f32(bytes)?;
    Some(match dtype {
        Dtype::F32 => values.iter().flat_map(|v| (v + 1.0).to_le_bytes()).collect(),
        Dtype::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(v + 1.0).to_bits().to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|v| half::f16::from_f32(v + 1.0).to_bits().to_le_bytes()).collect(),
        Dtype::Affine(_) => return None,
    })
}

/// The recipe's default `{group_size, bits, mode}`.
fn default_spec(recipe: QuantizeRecipe) -> (u32, u32) {
    match recipe {
        QuantizeRecipe::Q8 => (8, 64),
        QuantizeRecipe::Q4 | QuantizeRecipe::Q4Quality => (4, 64),
    }
}

fn spec_json(bits: u32, group: u32) -> serde_json::Value {
    serde_json::json!({"group_size": group, "bits": bits, "mode": "affine"})
}

/// Quantize the checkpoint in `src` with `recipe` and write it to `out` (created if missing) as
/// an MLX directory. The source must be a Hugging Face checkpoint in a float dtype.
pub fn save_mlx(src: &Path, out: &Path, recipe: QuantizeRecipe) -> Result<MlxSaveReport, ModelError> {
    let config_path = src.join("config.json");
    let text = crate::io::read_bounded_text(&config_path, crate::io::MAX_JSON_BYTES, "config.json")?;
    let config = TextConfig::from_json(&text)?;
    let mut top: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::BadJson { file: "config.json".into(), message: e.to_string() })?;
    if QuantConfig::from_config(&top)?.is_some() {
        return Err(ModelError::Unsupported { what: "re-quantizing a checkpoint that is already quantized".into() });
    }
    let ckpt = Checkpoint::open_dir(src)?;
    let prefix = ckpt.text_prefix();
    if prefix == "language_model.model." {
        return Err(ModelError::Unsupported {
            what: "an MLX checkpoint as the source (save from the Hugging Face one)".into(),
        });
    }
    let mut names: Vec<&str> = ckpt.names().collect();
    names.sort_unstable();
    // Everything written is held in memory first: the header's shapes are bounded by what the
    // config describes before any tensor is read (a sparse file cannot fill the host's RAM).
    let limit = config.tensor_elements_bound().unwrap_or(u64::MAX);
    let mut elements = 0u64;
    // (name, dtype, shape, bytes) of every tensor to write.
    let mut tensors: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut modules = serde_json::Map::new();
    let default = default_spec(recipe);
    let mut quantized = 0;
    for name in names {
        let rest = if let Some(r) = name.strip_prefix(prefix) {
            r.to_string()
        } else if name == "lm_head.weight" && !config.tie_word_embeddings {
            "lm_head.weight".to_string()
        } else {
            continue; // vision tower, mtp, a tied lm_head
        };
        let mlx = if rest == "lm_head.weight" {
            "language_model.lm_head.weight".to_string()
        } else {
            format!("language_model.model.{rest}")
        };
        let entry =
            ckpt.get(name).ok_or_else(|| ModelError::MissingTensor { name: name.into(), candidates: vec![] })?;
        elements = elements.saturating_add(entry.numel() as u64);
        if elements > limit {
            return Err(ModelError::TooManyElements { prefix: prefix.into(), limit, found: elements });
        }
        let st = st_dtype(name, &entry.dtype)?;
        let dtype = Dtype::from_safetensors(&entry.dtype)
            .ok_or_else(|| ModelError::UnsupportedDtype { name: name.into(), found: entry.dtype.clone() })?;
        let bytes = ckpt.read(entry)?;
        let module = mlx.strip_suffix(".weight").unwrap_or(&mlx).to_string();
        if entry.shape.len() == 2 {
            let cols = entry.shape[1];
            match recipe.spec(&rest, cols) {
                Some((bits, group)) => {
                    let rows = entry.shape[0];
                    let words =
                        cols.checked_mul(bits as usize).map(|b| b / 32).filter(|_| rows > 0).ok_or_else(|| {
                            ModelError::QuantizeShape {
                                name: name.into(),
                                bits,
                                max_cols: usize::MAX / bits as usize,
                                found: entry.shape.clone(),
                            }
                        })?;
                    let q = quantize_bytes(&bytes, dtype, cols, bits, group).ok_or_else(|| {
                        ModelError::UnsupportedDtype { name: name.into(), found: entry.dtype.clone() }
                    })?;
                    let half = match q.format.scales {
                        HalfType::BF16 => StDtype::BF16,
                        HalfType::F16 => StDtype::F16,
                    };
                    let groups = cols / group as usize;
                    tensors.push((
                        mlx.clone(),
                        StDtype::U32,
                        vec![rows, words],
                        bytemuck::cast_slice(&q.words).to_vec(),
                    ));
                    tensors.push((
                        format!("{module}.scales"),
                        half,
                        vec![rows, groups],
                        bytemuck::cast_slice(&q.scales).to_vec(),
                    ));
                    tensors.push((
                        format!("{module}.biases"),
                        half,
                        vec![rows, groups],
                        bytemuck::cast_slice(&q.biases).to_vec(),
                    ));
                    if (bits, group) != default {
                        modules.insert(module, spec_json(bits, group));
                    }
                    quantized += 1;
                }
                None => {
                    if recipe == QuantizeRecipe::Q4Quality {
                        modules.insert(module, serde_json::Value::Bool(false));
                    }
                    tensors.push((mlx, st, entry.shape.clone(), bytes));
                }
            }
        } else if rest.ends_with("conv1d.weight") && entry.shape.len() == 3 {
            // [C, 1, K] -> [C, K, 1]: the same bytes (only with the middle dimension 1).
            if entry.shape[1] != 1 {
                return Err(ModelError::ShapeMismatch {
                    name: name.into(),
                    expected: vec![entry.shape[0], 1, entry.shape[2]],
                    found: entry.shape.clone(),
                });
            }
            let shape = vec![entry.shape[0], entry.shape[2], entry.shape[1]];
            tensors.push((mlx, st, shape, bytes));
        } else if entry.shape.len() == 1 && (rest == "norm.weight" || OFFSET_NORMS.iter().any(|s| rest.ends_with(s))) {
            let shifted = plus_one(dtype, &bytes)
                .ok_or_else(|| ModelError::UnsupportedDtype { name: name.into(), found: entry.dtype.clone() })?;
            tensors.push((mlx, st, entry.shape.clone(), shifted));
        } else {
            tensors.push((mlx, st, entry.shape.clone(), bytes));
        }
    }
    let mut section = serde_json::Map::new();
    section.insert("group_size".into(), default.1.into());
    section.insert("bits".into(), default.0.into());
    section.insert("mode".into(), "affine".into());
    section.extend(modules);
    let obj = top
        .as_object_mut()
        .ok_or_else(|| ModelError::BadJson { file: "config.json".into(), message: "not an object".into() })?;
    if obj.get("model_type").and_then(|t| t.as_str()) == Some("qwen3_5_text") {
        // mlx-lm reads flat text configs under its qwen3_5 module.
        obj.insert("model_type".into(), "qwen3_5".into());
    }
    obj.insert("quantization".into(), serde_json::Value::Object(section.clone()));
    obj.insert("quantization_config".into(), serde_json::Value::Object(section));
    // Two source tensors may land on one MLX name (a stray `x.scales` beside a quantized
    // `x.weight`, or an lm_head under both prefixes): refused, not one silently dropped.
    let mut seen = std::collections::BTreeSet::new();
    if let Some((name, ..)) = tensors.iter().find(|t| !seen.insert(t.0.as_str())) {
        return Err(ModelError::BadSafetensors {
            path: src.to_path_buf(),
            message: format!("two tensors would both be written as {name}"),
        });
    }
    // An index in `out` would shadow the saved file (loaders prefer it), and saving over the
    // source would destroy it: both refused before anything is written.
    let index = out.join("model.safetensors.index.json");
    if std::fs::symlink_metadata(&index).is_ok() {
        let message = "an index here would shadow the saved model.safetensors (save into another directory)";
        return Err(ModelError::BadSafetensors { path: index, message: message.into() });
    }
    if let (Ok(a), Ok(b)) = (src.canonicalize(), out.canonicalize()) {
        if a == b {
            let message = "the output directory is the source (save into another directory)";
            return Err(ModelError::BadSafetensors { path: out.to_path_buf(), message: message.into() });
        }
    }
    std::fs::create_dir_all(out).map_err(io(out))?;
    let bytes = tensors.iter().map(|t| t.3.len() as u64).sum();
    let views: BTreeMap<String, TensorView> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| ModelError::BadSafetensors { path: out.join("model.safetensors"), message: e.to_string() })
        })
        .collect::<Result<_, _>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "mlx".to_string())]);
    let pretty = serde_json::to_string_pretty(&top)
        .map_err(|e| ModelError::BadJson { file: "config.json".into(), message: e.to_string() })?;
    // Both files are staged under temporary names, then moved into place weights first
    // (`io::install_pair`): a failed save leaves an earlier one in `out` whole.
    let (file, file_tmp) = (out.join("model.safetensors"), out.join("model.safetensors.tmp"));
    let (cfg, cfg_tmp) = (out.join("config.json"), out.join("config.json.tmp"));
    let written = safetensors::serialize_to_file(views, Some(meta), &file_tmp)
        .map_err(|e| ModelError::BadSafetensors { path: file.clone(), message: e.to_string() })
        .and_then(|()| std::fs::write(&cfg_tmp, pretty).map_err(io(&cfg)))
        .and_then(|()| {
            crate::io::install_pair((&file_tmp, &file), (&cfg_tmp, &cfg))
                .map_err(|(path, source)| ModelError::Io { path, source })
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&file_tmp);
        let _ = std::fs::remove_file(&cfg_tmp);
    }
    written.map(|()| MlxSaveReport { tensors: tensors.len(), quantized, bytes })
}
