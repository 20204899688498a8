//! The model's weights on the GPU, as a typed tree that mirrors the Hugging Face names.
//!
//! Checkpoint conventions handled here, each in one place:
//! * tensor prefix `model.language_model.` (VLM checkpoints), `model.` (text-only) or
//!   `language_model.model.` (MLX);
//! * `model.visual.*` and `mtp.*` are never read;
//! * tied embeddings: no `lm_head.weight` means lm_head reuses `embed_tokens.weight`;
//! * `conv1d.weight` `[C, 1, K]` (Hugging Face) or `[C, K, 1]` (MLX) is read as `[C, K]`; the
//!   MLX layout (detected from that shape, never from names) also stores the RMSNorm weights
//!   that Qwen 3.5 keeps as offsets already shifted by +1 (every norm but `linear_attn.norm`),
//!   which the loader shifts back;
//! * affine-quantized matrices (MLX: `weight` u32 codes, `scales`, `biases`; bits and group
//!   from `config.json` `quantization`, checked against the shapes; compressed-tensors
//!   `weight_packed` + `weight_scale`, the affine form with a bias of `−2^(bits−1)·scale`) stay
//!   quantized on the GPU;
//! * `A_log` and `dt_bias` are packed into one `[2, Hv]` f32 vector;
//! * matrices keep their dtype; small vectors are widened to f32 (exact);
//! * projections that read the same input are stored as one weight, rows concatenated in a fixed
//!   order (`q|k|v`, `in_proj_qkv|z|b|a`, `gate|up`): a decode step runs each in one dispatch,
//!   a prefill step runs the row range of each projection.

use std::path::Path;
use std::sync::Arc;

use crate::error::ModelError;
use crate::gpu::{Affine, AffineData, GpuContext, GpuVector, GpuWeight, HalfType};
use crate::io::{read_bounded_text, MAX_JSON_BYTES};
use crate::model::quant::QuantConfig;
use crate::model::quantize::{quantize_bytes, QuantizeRecipe};
use crate::model::{Checkpoint, Dtype, LayerType, TextConfig};

/// Loader knobs.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Upper bound for one weight buffer, below the device's binding limit; matrices larger than
    /// this are split by rows (tests use it to force the split that real checkpoints hit).
    pub max_chunk_bytes: u64,
    /// Quantize the checkpoint's 16/32-bit matrices while loading (MLX's affine layout, as
    /// `mlx_lm.convert` would); matrices already quantized stay as they are.
    pub quantize: Option<QuantizeRecipe>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { max_chunk_bytes: u64::MAX, quantize: None }
    }
}

/// Weights of a gated attention layer.
pub struct AttnWeights {
    /// `q_proj.weight` `[2·Hq·hd, H]` (query and gate interleaved per head), `k_proj.weight`
    /// `[Hkv·hd, H]` and `v_proj.weight` `[Hkv·hd, H]`, rows concatenated.
    pub qkv: GpuWeight,
    /// `o_proj.weight` `[H, Hq·hd]`.
    pub o_proj: GpuWeight,
    /// `q_norm.weight` `[hd]`.
    pub q_norm: GpuVector,
    /// `k_norm.weight` `[hd]`.
    pub k_norm: GpuVector,
    /// `[q_norm | k_norm]` in one vector (the single-token kernel's; the same values).
    pub qk_norm: GpuVector,
}

/// Weights of a Gated DeltaNet layer.
pub struct GdnWeights {
    /// `in_proj_qkv.weight` `[C, H]`, `in_proj_z.weight` `[Vd, H]`, `in_proj_b.weight` `[Hv, H]`
    /// and `in_proj_a.weight` `[Hv, H]`, rows concatenated.
    pub in_proj: GpuWeight,
    /// `out_proj.weight` `[H, Vd]`.
    pub out_proj: GpuWeight,
    /// `conv1d.weight` as `[C, K]` f32.
    pub conv_w: GpuVector,
    /// `[A_log; dt_bias]` as `[2, Hv]` f32.
    pub gate_p: GpuVector,
    /// `norm.weight` `[Dv]` f32 (gated RMSNorm, plain w).
    pub norm: GpuVector,
    /// The single-token kernel's parameters in one vector: conv taps, A_log, dt_bias, norm
    /// weight (the same values as the three above).
    pub step_params: GpuVector,
}

/// The token mixer of a layer.
pub enum Mixer {
    /// Gated softmax attention.
    Attention(AttnWeights),
    /// Gated DeltaNet.
    Gdn(GdnWeights),
}

impl Mixer {
    /// The concatenated weight of the projections that read the block's input (attention's
    /// q|gate, k, v; GDN's qkv, z, b, a).
    pub fn input_weight(&self) -> &GpuWeight {
        match self {
            Mixer::Attention(w) => &w.qkv,
            Mixer::Gdn(w) => &w.in_proj,
        }
    }
}

/// SwiGLU MLP weights.
pub struct Mlp {
    /// `gate_proj.weight` `[I, H]` and `up_proj.weight` `[I, H]`, rows concatenated.
    pub gate_up: GpuWeight,
    /// `down_proj.weight` `[H, I]`.
    pub down_proj: GpuWeight,
}

/// One decoder layer.
pub struct Layer {
    /// `input_layernorm.weight` `[H]`.
    pub input_norm: GpuVector,
    /// `post_attention_layernorm.weight` `[H]`.
    pub post_norm: GpuVector,
    /// Attention or GDN.
    pub mixer: Mixer,
    /// The MLP.
    pub mlp: Mlp,
}

/// A loaded Qwen 3.5 text model.
pub struct Model {
    /// The device it lives on.
    pub ctx: Arc<GpuContext>,
    /// Its configuration.
    pub config: TextConfig,
    /// End-of-sequence ids (generation_config.json, else config.json).
    pub eos_token_ids: Vec<u32>,
    /// `embed_tokens.weight` `[V, H]`.
    pub embed: GpuWeight,
    /// `lm_head.weight` `[V, H]`; `None` when tied to `embed`.
    pub lm_head: Option<GpuWeight>,
    /// Final `norm.weight` `[H]`.
    pub norm: GpuVector,
    /// The decoder layers.
    pub layers: Vec<Layer>,
    /// The decoder layers' module prefix inside a PEFT model of the checkpoint's class:
    /// `model.language_model.` for a Hugging Face VLM save (and an MLX conversion whose
    /// `config.json` `architectures` names `Qwen3_5ForConditionalGeneration`), `model.` for a
    /// text-only save or another MLX checkpoint. An adapter the engine exports names its modules
    /// with it, as peft would on that class.
    pub module_prefix: &'static str,
}

struct Loader<'a> {
    ctx: &'a GpuContext,
    ckpt: &'a Checkpoint,
    prefix: &'static str,
    /// MLX layout: conv weights `[C, K, 1]`, offset norms stored shifted by +1.
    mlx: bool,
    quant: Option<&'a QuantConfig>,
    opts: &'a LoadOptions,
}

/// One matrix as read from the checkpoint: its dtype and the data of its rows.
enum MatrixData {
    /// A float dtype: raw little-endian bytes.
    Float(Dtype, Vec<u8>),
    /// Affine codes, scales and biases.
    Affine(AffineData),
}

impl MatrixData {
    fn dtype(&self) -> Dtype {
        match self {
            MatrixData::Float(d, _) => *d,
            MatrixData::Affine(a) => Dtype::Affine(a.format),
        }
    }

    /// Append `other`'s rows (same dtype, checked by the caller).
    fn extend(&mut self, other: MatrixData) {
        match (self, other) {
            (MatrixData::Float(_, b), MatrixData::Float(_, o)) => b.extend_from_slice(&o),
            (MatrixData::Affine(a), MatrixData::Affine(o)) => {
                a.words.extend_from_slice(&o.words);
                a.scales.extend_from_slice(&o.scales);
                a.biases.extend_from_slice(&o.biases);
            }
            _ => {}
        }
    }
}

impl Loader<'_> {
    fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn entry(&self, full: &str) -> Result<&crate::model::TensorEntry, ModelError> {
        self.ckpt
            .get(full)
            .ok_or_else(|| ModelError::MissingTensor { name: full.to_string(), candidates: vec![full.to_string()] })
    }

    fn checked(&self, full: &str, shape: &[usize]) -> Result<&crate::model::TensorEntry, ModelError> {
        let entry = self.entry(full)?;
        if entry.shape != shape {
            return Err(ModelError::ShapeMismatch {
                name: full.to_string(),
                expected: shape.to_vec(),
                found: entry.shape.clone(),
            });
        }
        Ok(entry)
    }

    /// The affine format of the module whose weight is `full` (`….weight`), if it is quantized:
    /// its `scales` tensor exists. Bits and group come from the config and must match the
    /// shapes; the scale dtype from the tensors.
    fn affine(&self, full: &str, cols: usize) -> Result<Option<Affine>, ModelError> {
        let module = full.strip_suffix(".weight").unwrap_or(full);
        let (scales, biases) = (format!("{module}.scales"), format!("{module}.biases"));
        let Some(s) = self.ckpt.get(&scales) else {
            return Ok(None);
        };
        let spec = self.quant.and_then(|q| q.module(module)).ok_or_else(|| ModelError::BadConfig {
            field: format!("quantization.{module}"),
            expected: format!("bits and group_size ({scales} is in the checkpoint)"),
            found: if self.quant.is_some() { "false / no default".into() } else { "no quantization section".into() },
        })?;
        if !cols.is_multiple_of(spec.group as usize) {
            return Err(ModelError::BadConfig {
                field: format!("quantization.{module}.group_size"),
                expected: format!("a divisor of the input width {cols}"),
                found: spec.group.to_string(),
            });
        }
        let scale_type = HalfType::from_safetensors(&s.dtype)
            .ok_or_else(|| ModelError::UnsupportedDtype { name: scales.clone(), found: s.dtype.clone() })?;
        let b = self.entry(&biases)?;
        if b.dtype != s.dtype {
            return Err(ModelError::DtypeMismatch {
                name: biases,
                first: scales,
                expected: s.dtype.clone(),
                found: b.dtype.clone(),
            });
        }
        Ok(Some(Affine { bits: spec.bits, group: spec.group, scales: scale_type }))
    }

    /// A compressed-tensors `pack-quantized` matrix (`weight_packed`, `weight_scale`): codes
    /// `u = q + 2^(bits−1)` packed like MLX's, so `w = s·(u − 2^(bits−1))` is the affine form with
    /// `bias = −2^(bits−1)·s` (exact in the scale's dtype).
    fn read_compressed(&self, module: &str, rows: usize, cols: usize) -> Result<Option<MatrixData>, ModelError> {
        let packed = format!("{module}.weight_packed");
        if self.ckpt.get(&packed).is_none() {
            return Ok(None);
        }
        let spec = self.quant.and_then(|q| q.compressed()).ok_or_else(|| ModelError::BadConfig {
            field: "quantization_config".into(),
            expected: format!("a compressed-tensors weight scheme ({packed} is in the checkpoint)"),
            found: "none".into(),
        })?;
        if !cols.is_multiple_of(spec.group as usize) {
            return Err(ModelError::BadConfig {
                field: "quantization_config.config_groups.weights.group_size".into(),
                expected: format!("a divisor of the input width {cols} of {module}"),
                found: spec.group.to_string(),
            });
        }
        if self.ckpt.get(&format!("{module}.weight_g_idx")).is_some() {
            return Err(ModelError::Unsupported {
                what: format!("{module}.weight_g_idx (group activation ordering: columns not in contiguous groups)"),
            });
        }
        if self.ckpt.get(&format!("{module}.weight_zero_point")).is_some() {
            return Err(ModelError::Unsupported { what: format!("{module}.weight_zero_point (asymmetric weights)") });
        }
        let w = self.checked(&packed, &[rows, cols * spec.bits as usize / 32])?;
        if w.dtype != "I32" && w.dtype != "U32" {
            return Err(ModelError::UnsupportedDtype { name: packed, found: w.dtype.clone() });
        }
        let scale_name = format!("{module}.weight_scale");
        let s = self.checked(&scale_name, &[rows, cols / spec.group as usize])?;
        let half = HalfType::from_safetensors(&s.dtype)
            .ok_or_else(|| ModelError::UnsupportedDtype { name: scale_name.clone(), found: s.dtype.clone() })?;
        if let Some(shape) = self.ckpt.get(&format!("{module}.weight_shape")) {
            // Two integers: checked before reading, since the header sizes the read. A negative
            // dimension is reported as 0.
            let name = format!("{module}.weight_shape");
            let clamp = |d: i128| usize::try_from(d).unwrap_or(0);
            if !matches!(shape.dtype.as_str(), "I32" | "I64") {
                return Err(ModelError::UnsupportedDtype { name, found: shape.dtype.clone() });
            }
            if shape.shape != [2] {
                return Err(ModelError::ShapeMismatch { name, expected: vec![2], found: shape.shape.clone() });
            }
            let dims = self.ckpt.read(shape)?;
            let want: Vec<u8> = [rows as i64, cols as i64].iter().flat_map(|d| d.to_le_bytes()).collect();
            let want32: Vec<u8> = [rows as i32, cols as i32].iter().flat_map(|d| d.to_le_bytes()).collect();
            if dims != want && dims != want32 {
                let found: Vec<usize> = if shape.dtype == "I64" {
                    dims.chunks_exact(8)
                        .map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as i128)
                        .map(clamp)
                        .collect()
                } else {
                    dims.chunks_exact(4)
                        .map(|b| i32::from_le_bytes(b.try_into().unwrap_or([0; 4])) as i128)
                        .map(clamp)
                        .collect()
                };
                return Err(ModelError::ShapeMismatch { name, expected: vec![rows, cols], found });
            }
        }
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(&self.ckpt.read(w)?);
        let scales: Vec<u16> = bytemuck::pod_collect_to_vec(&self.ckpt.read(s)?);
        let offset = -((1u32 << (spec.bits - 1)) as f32);
        let biases = scales
            .iter()
            .map(|&v| match half {
                HalfType::BF16 => half::bf16::from_f32(offset * half::bf16::from_bits(v).to_f32()).to_bits(),
                HalfType::F16 => half::f16::from_f32(offset * half::f16::from_bits(v).to_f32()).to_bits(),
            })
            .collect::<Vec<u16>>();
        // -2^(bits-1) * scale rounds back to the scale's type: an F16 scale above 65504 / 2^(bits-1)
        // would give an infinite bias, and NaN logits from a model that loaded.
        let infinite = |b: u16| match half {
            HalfType::BF16 => !half::bf16::from_bits(b).is_finite(),
            HalfType::F16 => !half::f16::from_bits(b).is_finite(),
        };
        if let Some(index) = biases.iter().position(|&b| infinite(b)) {
            let max = match half {
                HalfType::BF16 => half::bf16::MAX.to_f32(),
                HalfType::F16 => half::f16::MAX.to_f32(),
            };
            return Err(ModelError::WeightOutOfRange { tensor: scale_name, index, limit: max / -offset });
        }
        let format = Affine { bits: spec.bits, group: spec.group, scales: half };
        Ok(Some(MatrixData::Affine(AffineData { format, words, scales, biases })))
    }

    /// The `[rows, cols]` matrix `full` in its dtype, shapes checked.
    fn read_matrix(&self, full: &str, rows: usize, cols: usize) -> Result<MatrixData, ModelError> {
        let module = full.strip_suffix(".weight").unwrap_or(full);
        if let Some(data) = self.read_compressed(module, rows, cols)? {
            return Ok(data);
        }
        if let Some(a) = self.affine(full, cols)? {
            let groups = cols / a.group as usize;
            let w = self.checked(full, &[rows, cols * a.bits as usize / 32])?;
            if w.dtype != "U32" {
                return Err(ModelError::UnsupportedDtype { name: full.to_string(), found: w.dtype.clone() });
            }
            let s = self.checked(&format!("{module}.scales"), &[rows, groups])?;
            let b = self.checked(&format!("{module}.biases"), &[rows, groups])?;
            let words: Vec<u32> = bytemuck::pod_collect_to_vec(&self.ckpt.read(w)?);
            let scales: Vec<u16> = bytemuck::pod_collect_to_vec(&self.ckpt.read(s)?);
            let biases: Vec<u16> = bytemuck::pod_collect_to_vec(&self.ckpt.read(b)?);
            return Ok(MatrixData::Affine(AffineData { format: a, words, scales, biases }));
        }
        let entry = self.checked(full, &[rows, cols])?;
        let dtype = Dtype::from_safetensors(&entry.dtype)
            .ok_or_else(|| ModelError::UnsupportedDtype { name: full.to_string(), found: entry.dtype.clone() })?;
        let bytes = self.ckpt.read(entry)?;
        if let Some((bits, group)) = self.opts.quantize.and_then(|r| r.spec(full, cols)) {
            if let Some(q) = quantize_bytes(&bytes, dtype, cols, bits, group) {
                return Ok(MatrixData::Affine(q));
            }
        }
        Ok(MatrixData::Float(dtype, bytes))
    }

    fn upload(&self, name: &str, data: MatrixData, rows: usize, cols: usize) -> Result<GpuWeight, ModelError> {
        let max = self.opts.max_chunk_bytes;
        Ok(match data {
            MatrixData::Float(dtype, bytes) => GpuWeight::upload(self.ctx, name, dtype, rows, cols, &bytes, max)?,
            MatrixData::Affine(a) => GpuWeight::upload_affine(self.ctx, name, rows, cols, &a, max)?,
        })
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<GpuWeight, ModelError> {
        let full = self.full(name);
        self.matrix_full(&full, rows, cols)
    }

    fn matrix_full(&self, full: &str, rows: usize, cols: usize) -> Result<GpuWeight, ModelError> {
        let data = self.read_matrix(full, rows, cols)?;
        self.upload(full, data, rows, cols)
    }

    /// Several `[rows, cols]` matrices as one weight, rows concatenated in order; consecutive
    /// parts of one dtype share chunks, a part of another dtype starts new ones.
    fn concat(&self, parts: &[(String, usize)], cols: usize) -> Result<GpuWeight, ModelError> {
        let mut runs: Vec<(String, usize, MatrixData)> = Vec::new();
        for (name, rows) in parts {
            let full = self.full(name);
            let data = self.read_matrix(&full, *rows, cols)?;
            match runs.last_mut() {
                Some((_, run_rows, acc)) if acc.dtype() == data.dtype() => {
                    acc.extend(data);
                    *run_rows += rows;
                }
                _ => runs.push((full, *rows, data)),
            }
        }
        let weights = runs
            .into_iter()
            .map(|(name, rows, data)| self.upload(&name, data, rows, cols))
            .collect::<Result<Vec<_>, _>>()?;
        GpuWeight::concat(weights)
            .ok_or_else(|| ModelError::MissingTensor { name: "(no projection)".into(), candidates: Vec::new() })
    }

    fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.ckpt.read_f32(&self.full(name), shape)
    }

    /// A Qwen 3.5 RMSNorm weight stored as an offset (`x · (1 + w)`): MLX files hold `1 + w`.
    fn offset_norm(&self, name: &str, n: usize) -> Result<GpuVector, ModelError> {
        Ok(GpuVector::upload(self.ctx, &self.full(name), &self.offset_norm_values(name, n)?)?)
    }

    /// An RMSNorm1p weight as the kernels take it (`1 + w`: MLX stores the sum, minus one here).
    fn offset_norm_values(&self, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
        let mut v = self.values(name, &[n])?;
        if self.mlx {
            v.iter_mut().for_each(|x| *x -= 1.0);
        }
        Ok(v)
    }
}

impl Model {
    /// Load a checkpoint directory onto `ctx`.
    pub fn load(ctx: Arc<GpuContext>, dir: &Path) -> Result<Self, ModelError> {
        Self::load_with(ctx, dir, &LoadOptions::default())
    }

    /// Load with explicit [`LoadOptions`].
    pub fn load_with(ctx: Arc<GpuContext>, dir: &Path, opts: &LoadOptions) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = read_bounded_text(&path, MAX_JSON_BYTES, "config.json")?;
        let config = TextConfig::from_json(&text)?;
        let top: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::BadJson { file: "config.json".into(), message: e.to_string() })?;
        let quant = QuantConfig::from_config(&top)?;
        let ckpt = Checkpoint::open_dir(dir)?;
        let prefix = ckpt.text_prefix();
        // The MLX layout shows in the conv weights' shape ([C, K, 1]); with K = 1 both layouts
        // read alike and the MLX prefix decides.
        let c = &config;
        let k = c.conv_kernel;
        let first_gdn = c.layer_types.iter().position(|t| *t == LayerType::Linear);
        let mlx = match first_gdn.and_then(|i| ckpt.get(&format!("{prefix}layers.{i}.linear_attn.conv1d.weight"))) {
            Some(e) if k > 1 => e.shape == [c.conv_dim(), k, 1],
            _ => prefix == "language_model.model.",
        };
        let eos_token_ids =
            read_generation_eos(dir, config.vocab_size)?.unwrap_or_else(|| config.eos_token_ids.clone());
        let l = Loader { ctx: &ctx, ckpt: &ckpt, prefix, mlx, quant: quant.as_ref(), opts };
        let (h, v) = (c.hidden_size, c.vocab_size);
        let embed = l.matrix("embed_tokens.weight", v, h)?;
        let head_name =
            if prefix == "language_model.model." { "language_model.lm_head.weight" } else { "lm_head.weight" };
        let lm_head = match ckpt.get(head_name) {
            Some(_) => Some(l.matrix_full(head_name, v, h)?),
            None if c.tie_word_embeddings => None,
            None => {
                return Err(ModelError::MissingTensor {
                    name: head_name.into(),
                    candidates: vec![format!("{head_name} (tie_word_embeddings is false)")],
                })
            }
        };
        let norm = l.offset_norm("norm.weight", h)?;
        let mut layers = Vec::with_capacity(c.num_layers());
        for (i, ty) in c.layer_types.iter().enumerate() {
            let p = format!("layers.{i}.");
            let mixer = match ty {
                LayerType::Full => {
                    let (hq, hkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
                    let qkv = [
                        (format!("{p}self_attn.q_proj.weight"), 2 * hq * hd),
                        (format!("{p}self_attn.k_proj.weight"), hkv * hd),
                        (format!("{p}self_attn.v_proj.weight"), hkv * hd),
                    ];
                    let (qn, kn) = (format!("{p}self_attn.q_norm.weight"), format!("{p}self_attn.k_norm.weight"));
                    let (q_norm, k_norm) = (l.offset_norm_values(&qn, hd)?, l.offset_norm_values(&kn, hd)?);
                    let qk: Vec<f32> = q_norm.iter().chain(&k_norm).copied().collect();
                    Mixer::Attention(AttnWeights {
                        qkv: l.concat(&qkv, h)?,
                        o_proj: l.matrix(&format!("{p}self_attn.o_proj.weight"), h, hq * hd)?,
                        q_norm: GpuVector::upload(&ctx, &l.full(&qn), &q_norm)?,
                        k_norm: GpuVector::upload(&ctx, &l.full(&kn), &k_norm)?,
                        qk_norm: GpuVector::upload(&ctx, &l.full(&format!("{p}self_attn.qk_norm")), &qk)?,
                    })
                }
                LayerType::Linear => {
                    let (cd, vd, hv) = (c.conv_dim(), c.value_dim(), c.linear_value_heads);
                    let a = format!("{p}linear_attn.");
                    let conv_shape = if mlx { [cd, c.conv_kernel, 1] } else { [cd, 1, c.conv_kernel] };
                    let conv = l.values(&format!("{a}conv1d.weight"), &conv_shape)?;
                    let mut gate = l.values(&format!("{a}A_log"), &[hv])?;
                    gate.extend(l.values(&format!("{a}dt_bias"), &[hv])?);
                    let norm = l.values(&format!("{a}norm.weight"), &[c.linear_value_dim])?;
                    let step: Vec<f32> = conv.iter().chain(&gate).chain(&norm).copied().collect();
                    let in_proj = [
                        (format!("{a}in_proj_qkv.weight"), cd),
                        (format!("{a}in_proj_z.weight"), vd),
                        (format!("{a}in_proj_b.weight"), hv),
                        (format!("{a}in_proj_a.weight"), hv),
                    ];
                    Mixer::Gdn(GdnWeights {
                        in_proj: l.concat(&in_proj, h)?,
                        out_proj: l.matrix(&format!("{a}out_proj.weight"), h, vd)?,
                        conv_w: GpuVector::upload(&ctx, &format!("{a}conv1d"), &conv)?,
                        gate_p: GpuVector::upload(&ctx, &format!("{a}gates"), &gate)?,
                        norm: GpuVector::upload(&ctx, &format!("{a}norm.weight"), &norm)?,
                        step_params: GpuVector::upload(&ctx, &format!("{a}step params"), &step)?,
                    })
                }
            };
            layers.push(Layer {
                input_norm: l.offset_norm(&format!("{p}input_layernorm.weight"), h)?,
                post_norm: l.offset_norm(&format!("{p}post_attention_layernorm.weight"), h)?,
                mixer,
                mlp: Mlp {
                    gate_up: l.concat(
                        &[
                            (format!("{p}mlp.gate_proj.weight"), c.intermediate_size),
                            (format!("{p}mlp.up_proj.weight"), c.intermediate_size),
                        ],
                        h,
                    )?,
                    down_proj: l.matrix(&format!("{p}mlp.down_proj.weight"), h, c.intermediate_size)?,
                },
            });
        }
        // A Hugging Face save's tensors show its class; an MLX conversion keeps the source's
        // `architectures`, which names the class peft would load the adapter on.
        let vlm_source = top["architectures"]
            .as_array()
            .is_some_and(|a| a.first().and_then(serde_json::Value::as_str) == Some("Qwen3_5ForConditionalGeneration"));
        let module_prefix = match prefix {
            "model.language_model." => prefix,
            "language_model.model." if vlm_source => "model.language_model.",
            _ => "model.",
        };
        Ok(Self { ctx, config, eos_token_ids, embed, lm_head, norm, layers, module_prefix })
    }

    /// Whether the model is one the engine can run: its config within [`TextConfig::check`]'s
    /// bounds, one layer per `layer_types` entry of that entry's kind, and every matrix of the
    /// shape the config gives (its row chunks covering its rows in order). [`Model::load`] builds
    /// such a model; sessions, batches and adapter uploads check it first, so a hand-built or
    /// edited model (every field is public) gives this error instead of a step past its buffers.
    pub fn check(&self) -> Result<(), ModelError> {
        let c = &self.config;
        c.check()?;
        if !["model.", "model.language_model."].contains(&self.module_prefix) {
            return Err(ModelError::BadConfig {
                field: "module_prefix".into(),
                expected: "\"model.\" or \"model.language_model.\"".into(),
                found: format!("{:?}", self.module_prefix),
            });
        }
        if self.layers.len() != c.num_layers() {
            return Err(ModelError::BadConfig {
                field: "num_hidden_layers".into(),
                expected: format!("{} (the model's layers)", self.layers.len()),
                found: format!("{} layer_types", c.num_layers()),
            });
        }
        let (h, v) = (c.hidden_size, c.vocab_size);
        let shape = |name: String, w: &GpuWeight, rows: usize, cols: usize| {
            let covered = w.chunks.iter().try_fold(0, |at, ch| (ch.row_start == at).then_some(at + ch.rows));
            if w.rows != rows || w.cols != cols || covered != Some(w.rows) {
                let chunked: usize = w.chunks.iter().map(|ch| ch.rows).sum();
                return Err(ModelError::ShapeMismatch {
                    name,
                    expected: vec![rows, cols],
                    found: vec![chunked, w.cols],
                });
            }
            Ok(())
        };
        shape("embed_tokens.weight".into(), &self.embed, v, h)?;
        if let Some(head) = &self.lm_head {
            shape("lm_head.weight".into(), head, v, h)?;
        }
        let attn = c.num_heads * c.head_dim;
        for (i, (layer, ty)) in self.layers.iter().zip(&c.layer_types).enumerate() {
            let at = |what: &str| format!("layers.{i}.{what}");
            match (&layer.mixer, ty) {
                (Mixer::Attention(w), LayerType::Full) => {
                    shape(at("self_attn.q_proj|k_proj|v_proj"), &w.qkv, 2 * attn + 2 * c.num_kv_heads * c.head_dim, h)?;
                    shape(at("self_attn.o_proj"), &w.o_proj, h, attn)?;
                }
                (Mixer::Gdn(w), LayerType::Linear) => {
                    let rows = c.conv_dim() + c.value_dim() + 2 * c.linear_value_heads;
                    shape(at("linear_attn.in_proj_qkv|z|b|a"), &w.in_proj, rows, h)?;
                    shape(at("linear_attn.out_proj"), &w.out_proj, h, c.value_dim())?;
                }
                (mixer, _) => {
                    let name = |attention: bool| if attention { "full_attention" } else { "linear_attention" };
                    let attention = matches!(mixer, Mixer::Attention(_));
                    return Err(ModelError::BadConfig {
                        field: format!("layer_types[{i}]"),
                        expected: format!("{} (the model's layer {i})", name(attention)),
                        found: name(*ty == LayerType::Full).into(),
                    });
                }
            }
            shape(at("mlp.gate_proj|up_proj"), &layer.mlp.gate_up, 2 * c.intermediate_size, h)?;
            shape(at("mlp.down_proj"), &layer.mlp.down_proj, h, c.intermediate_size)?;
        }
        Ok(())
    }

    /// The output projection (lm_head, or the tied embedding).
    pub fn output(&self) -> &GpuWeight {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Weight bytes a decode step must read: every projection of every layer and the output
    /// projection (the embedding gather reads one row).
    pub fn decode_weight_bytes(&self) -> u64 {
        let mut total = self.output().bytes();
        for l in &self.layers {
            total += l.mlp.gate_up.bytes() + l.mlp.down_proj.bytes();
            total += match &l.mixer {
                Mixer::Attention(a) => a.qkv.bytes() + a.o_proj.bytes(),
                Mixer::Gdn(g) => g.in_proj.bytes() + g.out_proj.bytes(),
            };
        }
        total
    }
}

fn read_generation_eos(dir: &Path, vocab: usize) -> Result<Option<Vec<u32>>, ModelError> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(None);
    }
    let text = read_bounded_text(&path, MAX_JSON_BYTES, "generation_config.json")?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::BadJson { file: path.display().to_string(), message: e.to_string() })?;
    match json.get("eos_token_id") {
        Some(v) => crate::model::config::parse_ids("generation_config.json", v, vocab),
        None => Ok(None),
    }
}
