//! The model's weights on the GPU, as a typed tree that mirrors the Hugging Face names.
//!
//! Checkpoint conventions handled here, each in one place:
//! * tensor prefix `model.language_model.` (VLM checkpoints) or `model.` (text-only);
//! * `model.visual.*` and `mtp.*` are never read;
//! * tied embeddings: no `lm_head.weight` means lm_head reuses `embed_tokens.weight`;
//! * `conv1d.weight` `[C, 1, K]` is read as `[C, K]`;
//! * `A_log` and `dt_bias` are packed into one `[2, Hv]` f32 vector;
//! * matrices keep their dtype; small vectors are widened to f32 (exact);
//! * projections that read the same input are stored as one weight, rows concatenated in a fixed
//!   order (`q|k|v`, `in_proj_qkv|z|b|a`, `gate|up`): a decode step runs each in one dispatch,
//!   a prefill step runs the row range of each projection.

use std::path::Path;
use std::sync::Arc;

use crate::error::ModelError;
use crate::gpu::{GpuContext, GpuVector, GpuWeight};
use crate::model::{Checkpoint, Dtype, LayerType, TextConfig};

/// Loader knobs (tests use them to force code paths that real checkpoints hit).
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Upper bound for one weight buffer, below the device's binding limit; matrices larger than
    /// this are split by rows.
    pub max_chunk_bytes: u64,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { max_chunk_bytes: u64::MAX }
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
}

struct Loader<'a> {
    ctx: &'a GpuContext,
    ckpt: &'a Checkpoint,
    prefix: &'static str,
    opts: &'a LoadOptions,
}

impl Loader<'_> {
    fn full(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<GpuWeight, ModelError> {
        let full = self.full(name);
        self.matrix_full(&full, rows, cols)
    }

    fn matrix_full(&self, full: &str, rows: usize, cols: usize) -> Result<GpuWeight, ModelError> {
        let entry = self
            .ckpt
            .get(full)
            .ok_or_else(|| ModelError::MissingTensor { name: full.to_string(), candidates: vec![full.to_string()] })?;
        if entry.shape != [rows, cols] {
            return Err(ModelError::ShapeMismatch {
                name: full.to_string(),
                expected: vec![rows, cols],
                found: entry.shape.clone(),
            });
        }
        let dtype = Dtype::from_safetensors(&entry.dtype)
            .ok_or_else(|| ModelError::UnsupportedDtype { name: full.to_string(), found: entry.dtype.clone() })?;
        let bytes = self.ckpt.read(entry)?;
        Ok(GpuWeight::upload(self.ctx, full, dtype, rows, cols, &bytes, self.opts.max_chunk_bytes)?)
    }

    /// Several `[rows, cols]` matrices of one dtype as one weight, rows concatenated in order.
    fn concat(&self, parts: &[(String, usize)], cols: usize) -> Result<GpuWeight, ModelError> {
        let mut bytes = Vec::new();
        let mut first: Option<(String, Dtype, String)> = None;
        for (name, rows) in parts {
            let full = self.full(name);
            let entry = self
                .ckpt
                .get(&full)
                .ok_or_else(|| ModelError::MissingTensor { name: full.clone(), candidates: vec![full.clone()] })?;
            if entry.shape != [*rows, cols] {
                return Err(ModelError::ShapeMismatch {
                    name: full,
                    expected: vec![*rows, cols],
                    found: entry.shape.clone(),
                });
            }
            let dtype = Dtype::from_safetensors(&entry.dtype)
                .ok_or_else(|| ModelError::UnsupportedDtype { name: full.clone(), found: entry.dtype.clone() })?;
            match &first {
                Some((name0, d0, s0)) if *d0 != dtype => {
                    return Err(ModelError::DtypeMismatch {
                        name: full,
                        first: name0.clone(),
                        expected: s0.clone(),
                        found: entry.dtype.clone(),
                    })
                }
                Some(_) => {}
                None => first = Some((full.clone(), dtype, entry.dtype.clone())),
            }
            bytes.extend_from_slice(&self.ckpt.read(entry)?);
        }
        let Some((name0, dtype, _)) = first else {
            return Err(ModelError::MissingTensor { name: "(no projection)".into(), candidates: Vec::new() });
        };
        let rows = parts.iter().map(|(_, r)| r).sum();
        Ok(GpuWeight::upload(self.ctx, &name0, dtype, rows, cols, &bytes, self.opts.max_chunk_bytes)?)
    }

    fn values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        self.ckpt.read_f32(&self.full(name), shape)
    }

    fn vector(&self, name: &str, n: usize) -> Result<GpuVector, ModelError> {
        let v = self.values(name, &[n])?;
        Ok(GpuVector::upload(self.ctx, &self.full(name), &v)?)
    }
}

impl Model {
    /// Load a checkpoint directory onto `ctx`.
    pub fn load(ctx: Arc<GpuContext>, dir: &Path) -> Result<Self, ModelError> {
        Self::load_with(ctx, dir, &LoadOptions::default())
    }

    /// Load with explicit [`LoadOptions`].
    pub fn load_with(ctx: Arc<GpuContext>, dir: &Path, opts: &LoadOptions) -> Result<Self, ModelError> {
        let config = TextConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open_dir(dir)?;
        let prefix = if ckpt.names().any(|n| n.starts_with("model.language_model.")) {
            "model.language_model."
        } else {
            "model."
        };
        let eos_token_ids = read_generation_eos(dir)?.unwrap_or_else(|| config.eos_token_ids.clone());
        let l = Loader { ctx: &ctx, ckpt: &ckpt, prefix, opts };
        let c = &config;
        let (h, v) = (c.hidden_size, c.vocab_size);
        let embed = l.matrix("embed_tokens.weight", v, h)?;
        let lm_head = match ckpt.get("lm_head.weight") {
            Some(_) => Some(l.matrix_full("lm_head.weight", v, h)?),
            None if c.tie_word_embeddings => None,
            None => {
                return Err(ModelError::MissingTensor {
                    name: "lm_head.weight".into(),
                    candidates: vec!["lm_head.weight (tie_word_embeddings is false)".into()],
                })
            }
        };
        let norm = l.vector("norm.weight", h)?;
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
                    Mixer::Attention(AttnWeights {
                        qkv: l.concat(&qkv, h)?,
                        o_proj: l.matrix(&format!("{p}self_attn.o_proj.weight"), h, hq * hd)?,
                        q_norm: l.vector(&format!("{p}self_attn.q_norm.weight"), hd)?,
                        k_norm: l.vector(&format!("{p}self_attn.k_norm.weight"), hd)?,
                    })
                }
                LayerType::Linear => {
                    let (cd, vd, hv) = (c.conv_dim(), c.value_dim(), c.linear_value_heads);
                    let a = format!("{p}linear_attn.");
                    let conv = l.values(&format!("{a}conv1d.weight"), &[cd, 1, c.conv_kernel])?;
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
                input_norm: l.vector(&format!("{p}input_layernorm.weight"), h)?,
                post_norm: l.vector(&format!("{p}post_attention_layernorm.weight"), h)?,
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
        Ok(Self { ctx, config, eos_token_ids, embed, lm_head, norm, layers })
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

fn read_generation_eos(dir: &Path) -> Result<Option<Vec<u32>>, ModelError> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::BadJson { file: path.display().to_string(), message: e.to_string() })?;
    Ok(json.get("eos_token_id").map(crate::model::config::parse_ids))
}
