//! `embed.wgsl`, `swiglu.wgsl`, `stream.wgsl` and `argmax.wgsl`.

use crate::error::GpuError;
use crate::gpu::{grid_1d, GpuWeight, Recorder};
use crate::kernels::{Kernel, PipelineKey};

/// Mirrors `Params` in `embed.wgsl` (and, with the first field only, `swiglu.wgsl`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct EmbedParams {
    /// Hidden size (swiglu: element count).
    pub n: u32,
    /// Tokens.
    pub rows: u32,
    /// First vocabulary row of the chunk.
    pub row_start: u32,
    /// Rows in the chunk.
    pub row_count: u32,
}

/// Record `hidden[t] = table[ids[t]]`, one dispatch per table chunk.
pub fn embed(
    rec: &mut Recorder,
    table: &GpuWeight,
    ids: &wgpu::Buffer,
    tokens: usize,
    hidden: &wgpu::Buffer,
) -> Result<(), GpuError> {
    let key = PipelineKey { kernel: Kernel::Embed, dtype: table.dtype, accumulate: false, variant: 0 };
    for chunk in &table.chunks {
        let params = EmbedParams {
            n: table.cols as u32,
            rows: tokens as u32,
            row_start: chunk.row_start as u32,
            row_count: chunk.rows as u32,
        };
        let groups = [(table.cols as u32).div_ceil(64), tokens as u32, 1];
        rec.dispatch(key, &params, &[ids, hidden], &[&chunk.bind_group], groups)?;
    }
    Ok(())
}

/// Record `g = silu(g) · u` over `n` elements.
pub fn swiglu(rec: &mut Recorder, g: &wgpu::Buffer, u: &wgpu::Buffer, n: usize) -> Result<(), GpuError> {
    let params = EmbedParams { n: n as u32, ..Default::default() };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    let groups = grid_1d((n as u32).div_ceil(64), max);
    rec.dispatch(PipelineKey::plain(Kernel::Swiglu), &params, &[u, g], &[], groups)
}

/// Workgroups of [`stream_read`]; `dst` holds one vec4 per invocation.
pub const STREAM_GROUPS: u32 = 1024;

/// Record a streaming read of the first `bytes` (a multiple of 16) of `src`; `dst` receives one
/// partial sum per invocation (`STREAM_GROUPS · 256 · 16` bytes).
pub fn stream_read(rec: &mut Recorder, src: &wgpu::Buffer, dst: &wgpu::Buffer, bytes: u64) -> Result<(), GpuError> {
    let n = (bytes / 16) as u32;
    let params = EmbedParams { n, ..Default::default() };
    rec.dispatch(PipelineKey::plain(Kernel::StreamRead), &params, &[src, dst], &[], [STREAM_GROUPS, 1, 1])
}

/// Mirrors `Params` in `argmax.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct ArgmaxParams {
    /// Logits.
    pub n: u32,
    /// Logits per workgroup of the first pass.
    pub block: u32,
    /// Candidates of the first pass.
    pub parts: u32,
    /// Padding.
    pub _pad: u32,
}

/// Logits per workgroup of the first argmax pass (256 invocations × 16).
pub const ARGMAX_BLOCK: usize = 4096;

/// Bytes of the candidate buffer [`argmax`] needs for `n` logits.
pub fn argmax_scratch_bytes(n: usize) -> u64 {
    (n.div_ceil(ARGMAX_BLOCK) * 8) as u64
}

/// Record the greedy choice over `n` logits (the rule of [`crate::runtime::argmax`], NaN and ties
/// included): the chosen id lands in `ids[0]`, where the next step's embedding reads it.
pub fn argmax(
    rec: &mut Recorder,
    logits: &wgpu::Buffer,
    parts: &wgpu::Buffer,
    ids: &wgpu::Buffer,
    n: usize,
) -> Result<(), GpuError> {
    let blocks = n.div_ceil(ARGMAX_BLOCK) as u32;
    let params = ArgmaxParams { n: n as u32, block: ARGMAX_BLOCK as u32, parts: blocks, _pad: 0 };
    rec.dispatch(PipelineKey::plain(Kernel::ArgmaxBlocks), &params, &[logits, parts], &[], [blocks, 1, 1])?;
    rec.dispatch(PipelineKey::plain(Kernel::ArgmaxFinal), &params, &[parts, ids], &[], [1, 1, 1])
}
