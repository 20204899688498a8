//! `gdn_conv.wgsl` and `gdn_rule.wgsl`: the Gated DeltaNet token mixer's conv and recurrence;
//! `gdn_step.wgsl`: both plus the gated norm in one dispatch for a single token.

use crate::error::GpuError;
use crate::gpu::{GpuVector, Recorder};
use crate::kernels::{Kernel, PipelineKey};

/// Mirrors `Params` in `gdn_step.wgsl`; `gdn_conv.wgsl` and `gdn_rule.wgsl` declare its first fields
/// (all but `slots`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct GdnParams {
    /// Tokens in the step.
    pub t: u32,
    /// Conv channels C = 2·Kd + Vd.
    pub c: u32,
    /// Conv kernel width.
    pub k: u32,
    /// Key heads.
    pub hk: u32,
    /// Value heads.
    pub hv: u32,
    /// Key head dim.
    pub dk: u32,
    /// Value head dim.
    pub dv: u32,
    /// Epsilon of the gated RMSNorm (`gdn_step.wgsl`).
    pub eps: f32,
    /// `gdn_decode_lora`: the total rank of out_proj's shrink (0 otherwise).
    pub lora_rank: u32,
    /// `gdn_decode`: the first element of the token's row in `mixed` (a batch's row of one
    /// session; 0 otherwise).
    pub mixed_at: u32,
    /// `gdn_decode`: the first element of its output row in `core`.
    pub core_at: u32,
    /// `gdn_conv` and `gdn_rule`: the first row of the step's buffers the dispatch runs (`t`
    /// rows from there; [`gated_delta`] sets it where it splits a step).
    pub row0: u32,
    /// `gdn_decode` over a grid of several rows (a batch's pooled states): row r's state slot
    /// in byte `r % 4` of word `r / 4` ([`GdnParams::with_slots`]); zero for one session.
    pub slots: [u32; 16],
}

/// Most rows one `gdn_decode` dispatch steps (one byte of `GdnParams::slots` each).
pub const GDN_MAX_ROWS: usize = 64;

impl GdnParams {
    /// These parameters for rows whose states are slots `slots` of pooled buffers, or `None`
    /// for more than [`GDN_MAX_ROWS`] rows or a slot past 255.
    pub fn with_slots(self, slots: &[usize]) -> Option<Self> {
        if slots.len() > GDN_MAX_ROWS || slots.iter().any(|&s| s > 255) {
            return None;
        }
        let mut packed = [0u32; 16];
        for (r, &s) in slots.iter().enumerate() {
            packed[r / 4] |= (s as u32) << (8 * (r % 4));
        }
        Some(Self { slots: packed, ..self })
    }
}

/// Largest conv kernel width (`MAX_K` in `gdn_conv.wgsl`); the config check rejects wider ones.
pub use crate::model::config::MAX_CONV_K;

/// The buffers of one GDN layer's step.
#[derive(Clone, Copy)]
pub struct GdnIo<'a> {
    /// in_proj_qkv output `[T, C]`.
    pub mixed: &'a wgpu::Buffer,
    /// Conv output `[T, C]`.
    pub conv_y: &'a wgpu::Buffer,
    /// Conv history `[C, K-1]` before the step.
    pub conv_in: &'a wgpu::Buffer,
    /// Conv history after the step (another buffer).
    pub conv_out: &'a wgpu::Buffer,
    /// in_proj_b output `[T, Hv]`.
    pub b: &'a wgpu::Buffer,
    /// in_proj_a output `[T, Hv]`.
    pub a: &'a wgpu::Buffer,
    /// Recurrence output `[T, Vd]`.
    pub core: &'a wgpu::Buffer,
    /// Recurrent state `[Hv, Dk, Dv]` before the step.
    pub state_in: &'a wgpu::Buffer,
    /// Recurrent state after the step (another buffer).
    pub state_out: &'a wgpu::Buffer,
    /// States to keep at rows inside the step, in row order (none for a plain step).
    pub splits: &'a [GdnSplit<'a>],
}

/// The states of a GDN layer before row `row` of a step (after its first `row` tokens), written
/// into buffers of their own, e.g. a prompt cache's snapshot of a prompt's prefix.
#[derive(Clone, Copy)]
pub struct GdnSplit<'a> {
    /// The row, `1..T` (an edge of the step needs no split: its states are the step's own).
    pub row: usize,
    /// The conv history `[C, K-1]` there.
    pub conv: &'a wgpu::Buffer,
    /// The recurrent state `[Hv, Dk, Dv]` there.
    pub state: &'a wgpu::Buffer,
}

/// `gdn_rule.wgsl`'s workgroup size (`WG`) and state rows per invocation (`RPI`): a workgroup
/// holds `WG / ceil(Dk / RPI)` columns of a head's state in registers.
const DELTA_RULE_WG: u32 = 64;
const DELTA_RULE_ROWS: u32 = 32;
/// Largest key head dim `gdn_rule.wgsl` takes (`WG * RPI`).
pub const DELTA_RULE_MAX_DK: u32 = DELTA_RULE_WG * DELTA_RULE_ROWS;

/// Record the conv + SiLU and the delta-rule recurrence of `params.t` rows. A step with
/// `io.splits` runs as one conv and one rule dispatch per part between them: each part reads
/// the states the one before wrote (the first `io.conv_in` / `io.state_in`) and writes its
/// split's buffers (the last `io.conv_out` / `io.state_out`).
pub fn gated_delta(
    rec: &mut Recorder,
    conv_w: &GpuVector,
    gate_p: &GpuVector,
    params: &GdnParams,
    io: &GdnIo,
) -> Result<(), GpuError> {
    if params.dk == 0 || params.dk > DELTA_RULE_MAX_DK || params.hk == 0 || !params.hv.is_multiple_of(params.hk) {
        return Err(GpuError::Validation {
            during: "delta_rule".into(),
            message: format!(
                "key head dim {} (expected 1..={DELTA_RULE_MAX_DK}) with {} value heads over {} key heads",
                params.dk, params.hv, params.hk
            ),
        });
    }
    let t = params.t as usize;
    if io.splits.windows(2).any(|w| w[0].row >= w[1].row) || io.splits.iter().any(|s| s.row == 0 || s.row >= t) {
        return Err(GpuError::Validation {
            during: "gdn splits".into(),
            message: format!(
                "split rows {:?} (expected increasing, each in 1..{t})",
                io.splits.iter().map(|s| s.row).collect::<Vec<_>>()
            ),
        });
    }
    let columns = DELTA_RULE_WG / params.dk.div_ceil(DELTA_RULE_ROWS);
    let mut from = (io.conv_in, io.state_in, 0);
    let ends = io.splits.iter().map(|s| (s.conv, s.state, s.row)).chain([(io.conv_out, io.state_out, t)]);
    for (conv_out, state_out, end) in ends {
        let (conv_in, state_in, row0) = from;
        let part = GdnParams { t: (end - row0) as u32, row0: row0 as u32, ..*params };
        rec.dispatch(
            PipelineKey::plain(Kernel::ConvSilu),
            &part,
            &[io.mixed, io.conv_y, conv_in, conv_out],
            &[&conv_w.bind_group],
            [params.c.div_ceil(64), 1, 1],
        )?;
        rec.dispatch(
            PipelineKey::plain(Kernel::DeltaRule),
            &part,
            &[io.conv_y, io.b, io.a, io.core, state_in, state_out],
            &[&gate_p.bind_group],
            [params.dv.div_ceil(columns), params.hv, 1],
        )?;
        from = (conv_out, state_out, end);
    }
    Ok(())
}

/// Largest key and value head dims `gdn_step.wgsl` takes (`MAX_D`); larger ones use the
/// separate conv, rule and norm dispatches.
pub const GDN_STEP_MAX_D: usize = 256;

/// The buffers of one GDN layer's single-token step.
pub struct GdnStepIo<'a> {
    /// The concatenated input projections' output `[C + Vd + 2·Hv]`: in_proj_qkv, z, b, a.
    pub mixed: &'a wgpu::Buffer,
    /// Conv history before the token.
    pub conv_in: &'a wgpu::Buffer,
    /// Conv history after it (another buffer).
    pub conv_out: &'a wgpu::Buffer,
    /// Recurrent state before the token.
    pub state_in: &'a wgpu::Buffer,
    /// Recurrent state after it (another buffer).
    pub state_out: &'a wgpu::Buffer,
    /// Gated-normed output `[Vd]`.
    pub core: &'a wgpu::Buffer,
}

/// The shrink matrix of a LoRA input group whose shrink a token mixer's decode kernel computes
/// split by head, after its output row.
#[derive(Clone, Copy)]
pub struct HeadShrink<'a> {
    /// Group-2 bind group over A (f32 `[rank, K]`, one binding).
    pub a: &'a wgpu::BindGroup,
    /// The group's total rank.
    pub rank: usize,
}

/// Record the conv, delta rule and gated norm of one token: one workgroup per value head.
/// `prm` is `[conv taps | A_log | dt_bias | norm weight]`. With `shrink`, each head also writes
/// its part of out_proj's LoRA shrink into `core` after the output row (`gdn_decode_lora`:
/// `Hv` parts of the rank rounded up to 4, from element `Vd`).
pub fn gdn_step(
    rec: &mut Recorder,
    prm: &GpuVector,
    params: &GdnParams,
    io: &GdnStepIo,
    shrink: Option<HeadShrink>,
) -> Result<(), GpuError> {
    gdn_step_rows(rec, prm, params, io, (1, shrink))
}

/// Record one token of each of `rows` rows of a GDN layer in one dispatch (a workgroup per value
/// head and row): row r reads its row of `io.mixed`, writes its row of `io.core` and steps the
/// states of slot r of `params` in the pooled state buffers of `io` (see `gdn_step.wgsl`). With
/// `shrink`, each row's heads also write their parts of out_proj's LoRA shrink into `core` after
/// all the rows' outputs (row r's `Hv` parts, each of the rank rounded up to 4, after row r − 1's).
pub fn gdn_step_rows(
    rec: &mut Recorder,
    prm: &GpuVector,
    params: &GdnParams,
    io: &GdnStepIo,
    (rows, shrink): (usize, Option<HeadShrink>),
) -> Result<(), GpuError> {
    if rows > GDN_MAX_ROWS {
        return Err(GpuError::Validation {
            during: "gdn_decode".into(),
            message: format!("{rows} rows (expected at most {GDN_MAX_ROWS})"),
        });
    }
    if let Some(s) = shrink {
        if !params.dv.is_multiple_of(4) {
            return Err(GpuError::Validation {
                during: "gdn_decode_lora".into(),
                message: format!("a split shrink reads A four columns at a time: value head dim {}", params.dv),
            });
        }
        // After the rows' outputs, each row's Hv parts of the padded rank.
        let vd = u64::from(params.hv) * u64::from(params.dv);
        let parts = rows as u64 * u64::from(params.hv) * s.rank.next_multiple_of(4) as u64;
        let end = u64::from(params.core_at) + rows as u64 * vd + parts;
        if end * 4 > io.core.size() {
            return Err(GpuError::Validation {
                during: "gdn_decode_lora".into(),
                message: format!(
                    "the shrink parts of {rows} rows run to element {end}, past the output ({} bytes)",
                    io.core.size()
                ),
            });
        }
    }
    let storage = [io.mixed, io.conv_in, io.conv_out, io.state_in, io.state_out, io.core];
    let grid = [params.hv, rows as u32, 1];
    match shrink {
        None => rec.dispatch(PipelineKey::plain(Kernel::GdnDecode), params, &storage, &[&prm.bind_group], grid),
        Some(s) => {
            let params = GdnParams { lora_rank: s.rank as u32, ..*params };
            rec.dispatch(PipelineKey::plain(Kernel::GdnDecodeLora), &params, &storage, &[&prm.bind_group, s.a], grid)
        }
    }
}
