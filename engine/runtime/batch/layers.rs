//! A batched step's layers for every row: the projections once for all rows, the mixers' cores
//! on the pooled states and caches of all rows (or per session).

use crate::error::GpuError;
use crate::gpu::Recorder;
use crate::kernels::attention::{attention_one, attention_one_rows, AttnOneIo, AttnParams};
use crate::kernels::gdn::{gdn_step, gdn_step_rows, GdnIo, GdnParams, GdnStepIo, GDN_MAX_ROWS};
use crate::kernels::matmul::{batched_matvec_takes, LinearIo};
use crate::lora::Proj;
use crate::model::{AttnWeights, GdnWeights, TextConfig};
use crate::runtime::cache::{LayerState, Scratch};
use crate::runtime::forward::{
    attn_params, gated_delta_norm, gdn_params, gdn_step_fits, head_split, mixer_out, project, LayerLora, NextWrites,
    Parts, Shrunk, Src, ATTN_IN, GDN_IN,
};
use crate::runtime::session::Session;

use super::pool::PoolRows;

/// A GDN layer for every row: the input projections for all rows (row k of `mixer_in` is
/// session k's qkv|z|b|a), then the fused step of every row in one dispatch on the pooled states
/// (`pooled`; it also writes out_proj's LoRA shrink split by head where [`head_split`] applies),
/// else per session on its own states, reading its row and writing its output row of `mid_b`,
/// then out_proj for all rows. Where the fused step does not fit
/// (wide heads), each row is copied into the session's scratch for the unfused kernels and back.
#[allow(clippy::too_many_arguments)]
pub(super) fn gdn_rows(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &GdnWeights,
    (sessions, pooled): (&[&mut Session], Option<PoolRows>),
    layer: usize,
    (src, s): (Src, Option<Shrunk>),
    lora: Option<LayerLora>,
) -> Result<(), GpuError> {
    let n = sessions.len();
    let (cd, vd, hv) = (c.conv_dim(), c.value_dim(), c.linear_value_heads);
    let width = cd + vd + 2 * hv;
    project_rows(rec, c, Parts { w: &w.in_proj, order: &GDN_IN, parts: 0..GDN_IN.len() }, &sc.mixer_in, n, (src, &s))?;
    let params = gdn_params(c, 1);
    if let Some((pool, parity, slots)) = pooled.and_then(|p| p.gdn.map(|(pool, parity)| (pool, parity, p.slots))) {
        let Some((conv, state)) = pool.layer(layer) else {
            return Err(mismatch(layer));
        };
        let params = params.with_slots(slots).ok_or_else(|| GpuError::Validation {
            during: format!("layer {layer}"),
            message: format!("pooled slots {slots:?} (expected at most {GDN_MAX_ROWS} rows, each slot below 256)"),
        })?;
        let io = GdnStepIo {
            mixed: &sc.mixer_in,
            conv_in: &conv[parity],
            conv_out: &conv[1 - parity],
            state_in: &state[parity],
            state_out: &state[1 - parity],
            core: &sc.mid_b,
        };
        let split = head_split(lora, &sc.mid_b, (vd, hv), (n, &w.out_proj));
        gdn_step_rows(rec, &w.step_params, &params, &io, (n, split.as_ref().map(|s| s.shrink)))?;
        let split = split.map(|s| s.shrunk);
        return mixer_out(rec, c, sc, (&w.out_proj, Proj::OutProj), lora, n, (split, NextWrites::default()));
    }
    let f = |e: usize| (e * 4) as u64;
    for (k, sess) in sessions.iter().enumerate() {
        let LayerState::Gdn { conv, state } = &sess.states[layer] else {
            return Err(mismatch(layer));
        };
        let (from, to) = (sess.parity, 1 - sess.parity);
        let row = k * width;
        if gdn_step_fits(c) {
            let io = GdnStepIo {
                mixed: &sc.mixer_in,
                conv_in: &conv[from],
                conv_out: &conv[to],
                state_in: &state[from],
                state_out: &state[to],
                core: &sc.mid_b,
            };
            let params = GdnParams { mixed_at: row as u32, core_at: (k * vd) as u32, ..params };
            gdn_step(rec, &w.step_params, &params, &io, None)?;
        } else {
            let own = &sess.scratch;
            let m = &sc.mixer_in;
            rec.copy(m, f(row), &own.wide_a, 0, f(cd));
            rec.copy(m, f(row + cd), &own.mid_a, 0, f(vd));
            rec.copy(m, f(row + cd + vd), &own.beta, 0, f(hv));
            rec.copy(m, f(row + cd + vd + hv), &own.decay, 0, f(hv));
            let io = GdnIo {
                mixed: &own.wide_a,
                conv_y: &own.wide_b,
                conv_in: &conv[from],
                conv_out: &conv[to],
                b: &own.beta,
                a: &own.decay,
                core: &own.mid_b,
                state_in: &state[from],
                state_out: &state[to],
                splits: &[],
            };
            gated_delta_norm(rec, c, w, (&params, &io), &own.mid_a, 1)?;
            rec.copy(&own.mid_b, 0, &sc.mid_b, f(k * vd), f(vd));
        }
    }
    mixer_out(rec, c, sc, (&w.out_proj, Proj::OutProj), lora, n, (None, NextWrites::default()))
}

/// An attention layer for every row: q|gate, k and v for all rows (row k of `mixer_in` is
/// session k's q|gate|k|v), then every row through q/k norm, RoPE at its position, its KV cache
/// and attention into its output row of `mid_b`, in two dispatches on the pooled caches
/// (`pooled`; the second also writes o_proj's LoRA shrink split by head where [`head_split`]
/// applies), else per session on its own cache; then o_proj for all rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_rows(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &AttnWeights,
    (sessions, pooled): (&[&mut Session], Option<PoolRows>),
    layer: usize,
    (src, s): (Src, Option<Shrunk>),
    lora: Option<LayerLora>,
) -> Result<(), GpuError> {
    let n = sessions.len();
    let (q_out, kv, attn) = (2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_heads * c.head_dim);
    let width = q_out + 2 * kv;
    project_rows(rec, c, Parts { w: &w.qkv, order: &ATTN_IN, parts: 0..ATTN_IN.len() }, &sc.mixer_in, n, (src, &s))?;
    if let Some((pool, slots)) = pooled.and_then(|p| p.kv.map(|kv| (kv, p.slots))) {
        let (Some((k_cache, v_cache)), Some(widest)) =
            (pool.pool.layer(layer), sessions.iter().max_by_key(|s| s.opts.max_context))
        else {
            return Err(mismatch(layer));
        };
        let params = AttnParams {
            row_stride: width as u32,
            out_stride: attn as u32,
            ..attn_params(c, (1, 0, pool.positions), (q_out, q_out + kv))
        };
        let rows: Vec<(usize, usize)> = slots.iter().zip(sessions.iter()).map(|(&slot, s)| (slot, s.pos)).collect();
        // The widest session's RoPE table holds every row's position.
        let io =
            AttnOneIo { qkv: &sc.mixer_in, k_cache, v_cache, rope: &widest.rope, out: &sc.mid_b, part: &sc.attn_part };
        let split = head_split(lora, &sc.mid_b, (attn, c.num_heads), (n, &w.o_proj));
        attention_one_rows(rec, &w.qk_norm, &params, &io, (&rows, split.as_ref().map(|s| s.shrink)))?;
        let split = split.map(|s| s.shrunk);
        return mixer_out(rec, c, sc, (&w.o_proj, Proj::OProj), lora, n, (split, NextWrites::default()));
    }
    for (k, sess) in sessions.iter().enumerate() {
        let LayerState::Attention { k: k_cache, v: v_cache } = &sess.states[layer] else {
            return Err(mismatch(layer));
        };
        let row = k * width;
        let params = AttnParams {
            q_offset: row as u32,
            out_offset: (k * attn) as u32,
            ..attn_params(c, (1, sess.pos, sess.opts.max_context), (row + q_out, row + q_out + kv))
        };
        let io =
            AttnOneIo { qkv: &sc.mixer_in, k_cache, v_cache, rope: &sess.rope, out: &sc.mid_b, part: &sc.attn_part };
        attention_one(rec, &w.qk_norm, &params, &io, None)?;
    }
    mixer_out(rec, c, sc, (&w.o_proj, Proj::OProj), lora, n, (None, NextWrites::default()))
}

/// A batched step's input projections (`parts`, consecutive projections of one weight) for the
/// `n` rows, each row's outputs side by side in `y` (row k from element k times their total):
/// one dispatch where the kernel takes their LoRA segments together (no adapter on them, one row:
/// the single-token matvec, or the batched matvec's 2 to 8 rows), else (the tiled matmul's one
/// segment: 9 rows and more, or affine weights) one dispatch per projection into its columns.
fn project_rows(
    rec: &mut Recorder,
    c: &TextConfig,
    parts: Parts,
    y: &wgpu::Buffer,
    n: usize,
    (src, s): (Src, &Option<Shrunk>),
) -> Result<(), GpuError> {
    let dims = |i: usize| parts.order[i].dims(c).1;
    let width: usize = parts.parts.clone().map(dims).sum();
    let io = src.io(y, n, width);
    if s.is_none() || n == 1 || batched_matvec_takes(&parts.rows(c), n, src.offset) {
        return project(rec, c, parts, &io, src, s);
    }
    let mut at = 0;
    for i in parts.parts.clone() {
        let one = Parts { parts: i..i + 1, ..parts };
        project(rec, c, one, &LinearIo { y_offset: at, ..io }, src, s)?;
        at += dims(i);
    }
    Ok(())
}

pub(super) fn mismatch(layer: usize) -> GpuError {
    GpuError::Validation {
        during: format!("layer {layer}"),
        message: "layer state does not match the layer type".into(),
    }
}
