//! `attention_prep.wgsl` and `attention.wgsl` (several tokens) and `attention_one.wgsl` (one
//! token): gated full attention with a KV cache.

use crate::error::GpuError;
use crate::gpu::{GpuVector, Recorder};
use crate::kernels::gdn::HeadShrink;
use crate::kernels::{Kernel, PipelineKey};

/// Mirrors `Params` in `attention_common.wgsl` (what `attention.wgsl`, `attention_prep.wgsl`
/// and `attention_one.wgsl` read).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttnParams {
    /// Tokens in the step.
    pub t: u32,
    /// Cache position of the first token.
    pub pos0: u32,
    /// Query heads.
    pub hq: u32,
    /// KV heads.
    pub hkv: u32,
    /// Head dim.
    pub hd: u32,
    /// Half the rotary dim (R/2).
    pub rot_half: u32,
    /// Cache capacity in positions.
    pub s_max: u32,
    /// q/k norm epsilon.
    pub eps: f32,
    /// Score scale hd^-0.5.
    pub scale: f32,
    /// First element of the raw keys in `kraw` (a single token's keys follow q|gate in one
    /// concatenated projection output).
    pub k_offset: u32,
    /// First element of the raw values in `vraw`.
    pub v_offset: u32,
    /// `attend_one_merge_lora`, `attend_rows_merge_lora`: the total rank of o_proj's shrink (0
    /// otherwise).
    pub lora_rank: u32,
    /// `attend_one`: first element of the q|gate rows in `qkv` (a batch's row of one session; 0
    /// otherwise); `attend_rows`: row 0's.
    pub q_offset: u32,
    /// `attend_one`: first element of the output row in `out`; `attend_rows`: row 0's.
    pub out_offset: u32,
    /// `attend_one`: workgroups per query head over the cached keys ([`attention_one`] sets it).
    pub splits: u32,
    /// `attend_one`: cached keys per split, a multiple of 64 ([`attention_one`] sets it).
    pub split_keys: u32,
    /// `attend_rows`: elements from one row's q|gate|k|v to the next's.
    pub row_stride: u32,
    /// `attend_rows`: elements from one row's output to the next's.
    pub out_stride: u32,
    /// `attend_rows_merge_lora`: the first element of row 0's o_proj shrink parts in `out`
    /// ([`attention_one_rows`] sets it).
    pub lora_at: u32,
    /// Padding (the WGSL struct's arrays start on 16 bytes).
    pub _pad: u32,
    /// `attend_rows`: row r's cache slot in byte `r % 4` of word `r / 4` ([`attention_one_rows`]
    /// sets it).
    pub slots: [u32; 8],
    /// `attend_rows`: row r's position ([`attention_one_rows`] sets it).
    pub positions: [u32; ATTN_MAX_ROWS],
}

/// Most rows one `attend_rows` dispatch takes ([`AttnParams::positions`]).
pub const ATTN_MAX_ROWS: usize = 32;

/// Most workgroups per query head a single-token step spreads the cached keys over
/// ([`attention_one`]); [`AttnOneIo::part`] holds `Hq × ATTN_MAX_SPLITS × (hd + 2)` floats.
pub const ATTN_MAX_SPLITS: u32 = 32;

/// Keys per split: one block of the kernel's 64 (its workgroup size) per split up to
/// `64 · ATTN_MAX_SPLITS` cached keys, then as many blocks as keep the splits at the maximum.
const SPLIT_BLOCK: u32 = 64;

/// `(splits, split_keys)` for a single-token step over `cached` keys: every split but the last
/// full, at least one split (the token's own key is in the last).
pub fn attention_splits(cached: u32) -> (u32, u32) {
    let keys = cached.div_ceil(ATTN_MAX_SPLITS).next_multiple_of(SPLIT_BLOCK).max(SPLIT_BLOCK);
    (cached.div_ceil(keys).max(1), keys)
}

/// Largest head_dim the attention kernel supports (WG × MAX_DIMS in `attention.wgsl`); the
/// config check rejects larger ones.
pub use crate::model::config::MAX_HEAD_DIM;

/// The buffers of one attention layer's step.
pub struct AttnIo<'a> {
    /// q_proj output `[T, Hq, 2hd]`.
    pub qg: &'a wgpu::Buffer,
    /// k_proj output `[T, Hkv·hd]`.
    pub kraw: &'a wgpu::Buffer,
    /// v_proj output `[T, Hkv·hd]`.
    pub vraw: &'a wgpu::Buffer,
    /// Rotated queries `[T, Hq, hd]`.
    pub q: &'a wgpu::Buffer,
    /// Key cache `[Hkv, S, hd]`.
    pub k_cache: &'a wgpu::Buffer,
    /// Value cache `[Hkv, S, hd]`.
    pub v_cache: &'a wgpu::Buffer,
    /// RoPE table `[S, R/2]` of (cos, sin).
    pub rope: &'a wgpu::Buffer,
    /// Gated output `[T, Hq·hd]`.
    pub out: &'a wgpu::Buffer,
}

/// Record q/k norm + RoPE, the cache write and the attention itself.
pub fn attention(
    rec: &mut Recorder,
    q_norm: &GpuVector,
    k_norm: &GpuVector,
    params: &AttnParams,
    io: &AttnIo,
) -> Result<(), GpuError> {
    let t = params.t;
    rec.dispatch(
        PipelineKey::plain(Kernel::PrepQ),
        params,
        &[io.qg, io.rope, io.q],
        &[&q_norm.bind_group],
        [t, params.hq, 1],
    )?;
    rec.dispatch(
        PipelineKey::plain(Kernel::PrepKv),
        params,
        &[io.kraw, io.rope, io.k_cache, io.vraw, io.v_cache],
        &[&k_norm.bind_group],
        [t, params.hkv, 1],
    )?;
    rec.dispatch(
        PipelineKey::plain(Kernel::Attend),
        params,
        &[io.q, io.qg, io.k_cache, io.v_cache, io.out],
        &[],
        [t, params.hq, 1],
    )
}

/// The buffers of one attention layer's single-token step.
pub struct AttnOneIo<'a> {
    /// The concatenated q|gate, k, v projection output (k and v from the params' offsets), a
    /// row per token of a batched step.
    pub qkv: &'a wgpu::Buffer,
    /// Key cache `[Hkv, S, hd]` (pooled: `[slots · Hkv, S, hd]`).
    pub k_cache: &'a wgpu::Buffer,
    /// Value cache, the keys' layout.
    pub v_cache: &'a wgpu::Buffer,
    /// RoPE table `[S, R/2]` of (cos, sin).
    pub rope: &'a wgpu::Buffer,
    /// Gated output `[Hq·hd]` (then the shrink's parts, with `shrink`), a row per token of a
    /// batched step.
    pub out: &'a wgpu::Buffer,
    /// The splits' parts: at least `Hq × ATTN_MAX_SPLITS × (hd + 2)` floats (per row of a
    /// batched step, up to [`ATTN_MAX_ROWS`]).
    pub part: &'a wgpu::Buffer,
}

/// Record one token's attention for each of a batched step's `rows` (row r: (cache slot,
/// position)) in two dispatches per [`ATTN_MAX_ROWS`] rows: `attend_rows` over every row's
/// splits (those of the furthest row's keys: [`attention_splits`]), then `attend_rows_merge`
/// (`attend_rows_merge_lora` with `shrink`).
/// `params` holds row 0's offsets (q|gate, k, v and output), the strides to the next rows and
/// the pooled caches' positions per KV head (`s_max`); `io.k_cache` and `io.v_cache` are
/// `[slots · Hkv, s_max, hd]`, `io.part` holds `min(rows, ATTN_MAX_ROWS) · Hq ·
/// ATTN_MAX_SPLITS · (hd + 2)` floats. With `shrink`, each row's heads also write their parts
/// of o_proj's LoRA shrink into `out` after all the rows' outputs (from the element after the last
/// row's output rounded up to 4: row r's `Hq` parts, each of the rank rounded up to 4, after row
/// r − 1's). A slot past the caches or 255, a position past the caches, a parts buffer too small
/// or shrink parts past `out` is a `Validation` error.
pub fn attention_one_rows(
    rec: &mut Recorder,
    qk_norm: &GpuVector,
    params: &AttnParams,
    io: &AttnOneIo,
    (rows, shrink): (&[(usize, usize)], Option<HeadShrink>),
) -> Result<(), GpuError> {
    let bad = |message: String| GpuError::Validation { during: "recording AttendRows".into(), message };
    let (hq, hd, s_max) = (u64::from(params.hq), u64::from(params.hd), u64::from(params.s_max));
    // Slots whose caches the buffers hold: [slots · Hkv, s_max, hd] floats.
    let slot_bytes = u64::from(params.hkv) * s_max * hd * 4;
    let slots = io.k_cache.size().min(io.v_cache.size()) / slot_bytes.max(1);
    let fits = |&(slot, pos): &(usize, usize)| slot <= 255 && (slot as u64) < slots && (pos as u64) < s_max;
    if let Some(&(slot, pos)) = rows.iter().find(|r| !fits(r)) {
        return Err(bad(format!(
            "row at slot {slot}, position {pos} (expected slots below {}, positions below {s_max})",
            slots.min(256)
        )));
    }
    // The parts of the largest chunk of the furthest row's splits, checked before recording.
    let furthest = rows.iter().map(|&(_, pos)| pos as u32).max().unwrap_or(0);
    let need = rows.len().min(ATTN_MAX_ROWS) as u64 * hq * u64::from(attention_splits(furthest).0) * (hd + 2) * 4;
    if io.part.size() < need {
        return Err(bad(format!("the parts buffer holds {} bytes, {} rows need {need}", io.part.size(), rows.len())));
    }
    // The shrink parts: after the last row's output, each row's Hq parts of the padded rank.
    let n = rows.len() as u64;
    let rank_pad = shrink.map_or(0, |s| s.rank.next_multiple_of(4)) as u64;
    let lora_at = (u64::from(params.out_offset) + n * u64::from(params.out_stride)).next_multiple_of(4);
    let parts_end = lora_at + n * hq * rank_pad;
    if shrink.is_some() && !hd.is_multiple_of(4) {
        return Err(bad(format!("a split shrink reads A four columns at a time: head dim {hd}")));
    }
    if shrink.is_some() && (parts_end * 4 > io.out.size() || parts_end > u64::from(u32::MAX)) {
        return Err(bad(format!(
            "the shrink parts of {} rows run to element {parts_end}, past the output ({} bytes)",
            rows.len(),
            io.out.size()
        )));
    }
    for (chunk, part) in rows.chunks(ATTN_MAX_ROWS).enumerate() {
        let furthest = part.iter().map(|&(_, pos)| pos).max().unwrap_or(0);
        let (splits, split_keys) = attention_splits(furthest as u32);
        let first = (chunk * ATTN_MAX_ROWS) as u32;
        let mut p = AttnParams {
            splits,
            split_keys,
            q_offset: params.q_offset + first * params.row_stride,
            k_offset: params.k_offset + first * params.row_stride,
            v_offset: params.v_offset + first * params.row_stride,
            out_offset: params.out_offset + first * params.out_stride,
            lora_rank: shrink.map_or(0, |s| s.rank as u32),
            lora_at: (lora_at + u64::from(first) * hq * rank_pad) as u32,
            slots: [0; 8],
            positions: [0; ATTN_MAX_ROWS],
            ..*params
        };
        for (r, &(slot, pos)) in part.iter().enumerate() {
            p.slots[r / 4] |= (slot as u32) << (8 * (r % 4));
            p.positions[r] = pos as u32;
        }
        let storage = [io.qkv, io.rope, io.k_cache, io.v_cache, io.out, io.part];
        let norm = [&qk_norm.bind_group];
        let n = part.len() as u32;
        rec.dispatch(PipelineKey::plain(Kernel::AttendRows), &p, &storage, &norm, [params.hq, splits, n])?;
        let merge = [params.hq, 1, n];
        match shrink {
            None => rec.dispatch(PipelineKey::plain(Kernel::AttendRowsMerge), &p, &storage, &norm, merge)?,
            Some(s) => {
                let binds = [&qk_norm.bind_group, s.a];
                rec.dispatch(PipelineKey::plain(Kernel::AttendRowsMergeLora), &p, &storage, &binds, merge)?
            }
        }
    }
    Ok(())
}

/// Record one token's attention (`attention_one.wgsl`) in two dispatches: q/k norm + RoPE, the
/// cache write and the attention over [`attention_splits`] of the cached keys per query head,
/// then one workgroup per head combining its splits. `qk_norm` is `[q_norm | k_norm]`. With
/// `shrink`, each head also writes its part of o_proj's LoRA shrink into `out` after the output
/// row (`Hq` parts of the rank rounded up to 4, from element `Hq·hd`).
pub fn attention_one(
    rec: &mut Recorder,
    qk_norm: &GpuVector,
    params: &AttnParams,
    io: &AttnOneIo,
    shrink: Option<HeadShrink>,
) -> Result<(), GpuError> {
    let (splits, split_keys) = attention_splits(params.pos0);
    let need = u64::from(params.hq) * u64::from(splits) * (u64::from(params.hd) + 2) * 4;
    if io.part.size() < need {
        return Err(GpuError::Validation {
            during: "recording AttendOne".into(),
            message: format!(
                "the parts buffer holds {} bytes, {splits} splits of {} heads need {need}",
                io.part.size(),
                params.hq
            ),
        });
    }
    let params = AttnParams { splits, split_keys, ..*params };
    let storage = [io.qkv, io.rope, io.k_cache, io.v_cache, io.out, io.part];
    let norm = [&qk_norm.bind_group];
    rec.dispatch(PipelineKey::plain(Kernel::AttendOne), &params, &storage, &norm, [params.hq, splits, 1])?;
    let groups = [params.hq, 1, 1];
    match shrink {
        None => rec.dispatch(PipelineKey::plain(Kernel::AttendOneMerge), &params, &storage, &norm, groups),
        Some(s) => {
            let params = AttnParams { lora_rank: s.rank as u32, ..params };
            let binds = [&qk_norm.bind_group, s.a];
            rec.dispatch(PipelineKey::plain(Kernel::AttendOneMergeLora), &params, &storage, &binds, groups)
        }
    }
}
