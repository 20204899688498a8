//! Per-session state: the KV cache of attention layers, the conv and recurrent state of GDN
//! layers, and the scratch activations of one step.

use crate::error::{GpuError, RunError};
use crate::gpu::GpuContext;
use crate::kernels::attention::{ATTN_MAX_ROWS, ATTN_MAX_SPLITS};
use crate::kernels::matmul::{shrink_out_parts, BATCH_SPLIT_SHRINK_FLOATS, MAX_BATCH_TOKENS, SPLIT_SHRINK_MAX_RANK};
use crate::model::{LayerType, TextConfig};
use crate::runtime::forward::{norm_out_layout, parts_end};
use crate::runtime::session::MAX_CONTEXT;

/// The state one layer carries between steps.
pub enum LayerState {
    /// Attention: `[Hkv, S, hd]` keys (normed and rotated) and values.
    Attention {
        /// Keys.
        k: wgpu::Buffer,
        /// Values.
        v: wgpu::Buffer,
    },
    /// GDN: `[C, K-1]` pre-conv history and `[Hv, Dk, Dv]` recurrent state, two of each: a step
    /// reads the pair at the session's parity and writes the other, so a step that is not
    /// committed (a run-ahead token that was not needed) leaves the state as it was.
    Gdn {
        /// Conv history.
        conv: [wgpu::Buffer; 2],
        /// Recurrent state.
        state: [wgpu::Buffer; 2],
    },
}

/// Scratch activations for up to `rows` tokens per step (shapes in elements, f32).
pub struct Scratch {
    /// `[rows, H]` residual stream; at least room after one row for what a single-token residual
    /// projection writes for the next block (`forward::residual_out`).
    pub hidden: wgpu::Buffer,
    /// `[rows, H]` normalised input of a block.
    pub xnorm: wgpu::Buffer,
    /// `[rows, max(C, 2·Hq·hd)]`: GDN qkv before the conv, or attention q_proj output.
    pub wide_a: wgpu::Buffer,
    /// `[rows, max(C, Hq·hd)]`: GDN conv output, or rotated queries.
    pub wide_b: wgpu::Buffer,
    /// `[rows, max(Vd, Hkv·hd)]`: GDN z, or attention keys.
    pub mid_a: wgpu::Buffer,
    /// `[rows, max(Vd, Hkv·hd, Hq·hd)]`: GDN core output, or attention output; at least room
    /// after one row, and after the rows of a batched step, for their shrink split by head
    /// (`forward::head_split`).
    pub mid_b: wgpu::Buffer,
    /// `[rows, Hkv·hd]` attention values.
    pub mid_c: wgpu::Buffer,
    /// `[rows, Hv]` GDN beta logits.
    pub beta: wgpu::Buffer,
    /// `[rows, Hv]` GDN decay logits.
    pub decay: wgpu::Buffer,
    /// `[rows, I]` MLP gate (then the SwiGLU product); at least room after one row for down_proj's
    /// shrink split by workgroup.
    pub mlp_g: wgpu::Buffer,
    /// `[rows, I]` MLP up.
    pub mlp_u: wgpu::Buffer,
    /// `[mixer_rows, max(C + Vd + 2·Hv, 2·Hq·hd + 2·Hkv·hd)]`: a single token's concatenated
    /// mixer input projections (GDN qkv|z|b|a, or attention q|k|v), a row per session of a batch.
    pub mixer_in: wgpu::Buffer,
    /// `[min(mixer_rows, ATTN_MAX_ROWS), Hq, ATTN_MAX_SPLITS, hd + 2]`: the split parts of a
    /// single-token attention step, for each row of a batched one.
    pub attn_part: wgpu::Buffer,
}

/// Width of a [`Scratch::mixer_in`] row: the wider of a GDN layer's and an attention layer's
/// concatenated input projections.
fn mixer_width(c: &TextConfig) -> usize {
    let q_out = 2 * c.num_heads * c.head_dim;
    let kv = c.num_kv_heads * c.head_dim;
    (c.conv_dim() + c.value_dim() + 2 * c.linear_value_heads).max(q_out + 2 * kv)
}

/// Floats of a [`Scratch::attn_part`]: every query head's largest number of split parts.
fn attn_part_floats(c: &TextConfig) -> u64 {
    c.num_heads as u64 * u64::from(ATTN_MAX_SPLITS) * (c.head_dim as u64 + 2)
}

impl Scratch {
    /// Allocate scratch for `rows` tokens, with `mixer_rows` rows of single-token mixer input
    /// (1 for a session, a batch's sessions for a batch).
    pub fn new(ctx: &GpuContext, c: &TextConfig, rows: usize, mixer_rows: usize) -> Result<Self, GpuError> {
        // u64 products: the session bounds rows and the config every width, so none overflows.
        let at_least = |name: &str, width: usize, floats: u64| {
            ctx.storage_buffer(name, (rows as u64 * width as u64).max(floats) * 4, true)
        };
        let f = |name: &str, width: usize| at_least(name, width, 0);
        let q_out = 2 * c.num_heads * c.head_dim;
        let attn = c.num_heads * c.head_dim;
        let kv = c.num_kv_heads * c.head_dim;
        let (h, i) = (c.hidden_size, c.intermediate_size);
        // Room after one row for what a single-token step writes there for the projections that
        // read it, at the largest split-shrink rank, so those writes never fall back to dispatches
        // of their own when a session steps few tokens at a time (`max_batch`): after the
        // residual row the next block's input shrink and the norm out, after the mixer output its
        // head split, after the SwiGLU product down_proj's shrink.
        let most = SPLIT_SHRINK_MAX_RANK;
        let hidden = norm_out_layout(h, shrink_out_parts(ctx, h, false), most).2 as u64;
        let one = parts_end(c.value_dim(), c.linear_value_heads, most).max(parts_end(attn, c.num_heads, most));
        // A batch's rows (2 to 8 sessions' mixer outputs) and their head splits: per head, rows
        // times rank at most what the batched matvec stages, each row's rank rounded up to 4.
        let rows_split = parts_end(
            mixer_rows.min(MAX_BATCH_TOKENS) * c.value_dim().max(attn),
            c.linear_value_heads.max(c.num_heads),
            BATCH_SPLIT_SHRINK_FLOATS + 3 * MAX_BATCH_TOKENS,
        );
        let mixer_out = one.max(if mixer_rows > 1 { rows_split } else { 0 }) as u64;
        let swiglu = parts_end(i, shrink_out_parts(ctx, 2 * i, true), most) as u64;
        Ok(Self {
            hidden: at_least("hidden", h, hidden)?,
            xnorm: f("xnorm", c.hidden_size)?,
            wide_a: f("wide_a", c.conv_dim().max(q_out))?,
            wide_b: f("wide_b", c.conv_dim().max(attn))?,
            mid_a: f("mid_a", c.value_dim().max(kv))?,
            mid_b: at_least("mid_b", c.value_dim().max(kv).max(attn), mixer_out)?,
            mid_c: f("mid_c", kv)?,
            beta: f("beta", c.linear_value_heads)?,
            decay: f("decay", c.linear_value_heads)?,
            mlp_g: at_least("mlp_g", i, swiglu)?,
            mlp_u: f("mlp_u", c.intermediate_size)?,
            mixer_in: ctx.storage_buffer("mixer_in", mixer_rows as u64 * mixer_width(c) as u64 * 4, true)?,
            attn_part: ctx.storage_buffer(
                "attn_part",
                mixer_rows.min(ATTN_MAX_ROWS) as u64 * attn_part_floats(c) * 4,
                true,
            )?,
        })
    }
}

/// Bytes of one session's (conv history, recurrent state) of a GDN layer.
pub fn gdn_state_bytes(c: &TextConfig) -> (u64, u64) {
    let conv = c.conv_dim() as u64 * (c.conv_kernel as u64 - 1) * 4;
    let state = c.linear_value_heads as u64 * c.linear_key_dim as u64 * c.linear_value_dim as u64 * 4;
    (conv, state)
}

/// Bytes of one attention layer's keys (or values) for `positions` tokens: `[Hkv, positions,
/// hd]` f32.
pub fn kv_cache_bytes(c: &TextConfig, positions: usize) -> u64 {
    c.num_kv_heads as u64 * positions as u64 * c.head_dim as u64 * 4
}

/// Allocate every layer's state for a context of `positions` tokens.
pub fn layer_states(ctx: &GpuContext, c: &TextConfig, positions: usize) -> Result<Vec<LayerState>, GpuError> {
    c.layer_types
        .iter()
        .enumerate()
        .map(|(i, ty)| {
            Ok(match ty {
                LayerType::Full => {
                    let bytes = kv_cache_bytes(c, positions);
                    LayerState::Attention {
                        k: ctx.storage_buffer(&format!("layers.{i}.k_cache"), bytes, true)?,
                        v: ctx.storage_buffer(&format!("layers.{i}.v_cache"), bytes, true)?,
                    }
                }
                LayerType::Linear => {
                    let (conv, state) = gdn_state_bytes(c);
                    let buf = |what: &str, p: usize, bytes: u64| {
                        ctx.storage_buffer(&format!("layers.{i}.{what}[{p}]"), bytes, true)
                    };
                    LayerState::Gdn {
                        conv: [buf("conv_state", 0, conv)?, buf("conv_state", 1, conv)?],
                        state: [buf("recurrent_state", 0, state)?, buf("recurrent_state", 1, state)?],
                    }
                }
            })
        })
        .collect()
}

/// Bytes of [`rope_table`] for `positions` (at least one vec2).
pub fn rope_table_bytes(c: &TextConfig, positions: usize) -> u64 {
    (positions as u64).saturating_mul((c.rotary_dim / 2) as u64 * 8).max(8)
}

/// The RoPE table `[positions, R/2]` of (cos, sin), computed like transformers: f32 inverse
/// frequencies, f32 angle `pos · inv_freq`, then cos/sin of that f32 angle. At most
/// [`MAX_CONTEXT`] positions (a `BadParam` error past it), for a config within
/// [`TextConfig::check`]'s bounds.
pub fn rope_table(c: &TextConfig, positions: usize) -> Result<Vec<f32>, RunError> {
    c.check().map_err(|e| RunError::ModelConfig(Box::new(e)))?;
    if positions > MAX_CONTEXT {
        return Err(RunError::BadParam {
            name: "positions",
            value: positions.to_string(),
            expected: "at most 2^20 (MAX_CONTEXT)",
        });
    }
    let half = c.rotary_dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = (2 * i) as f32 / c.rotary_dim as f32;
            (1.0 / (c.rope_theta as f32).powf(exponent) as f64) as f32
        })
        .collect();
    let mut out = Vec::with_capacity(positions * half * 2);
    for pos in 0..positions {
        for f in &inv {
            let angle = pos as f32 * f;
            out.push((angle as f64).cos() as f32);
            out.push((angle as f64).sin() as f32);
        }
    }
    Ok(out)
}
