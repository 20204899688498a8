//! `embed.wgsl`, `swiglu.wgsl`, `stream.wgsl`, `argmax.wgsl` and `topk.wgsl`.

use crate::error::GpuError;
use crate::gpu::{grid_1d, GpuWeight, Recorder};
use crate::kernels::{Kernel, PipelineKey};

/// Mirrors `Params` in `embed.wgsl` (and, with the first field only, `swiglu.wgsl` and
/// `stream.wgsl`).
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
    /// Affine tables: the `u32` index of the chunk's scales and biases.
    pub q_sb: u32,
    /// `embed_split`: chunks of the table.
    pub chunks: u32,
    /// `embed_split`: rows per chunk.
    pub per_chunk: u32,
    /// Padding.
    pub _pad: u32,
    /// `embed_split`, affine tables: each chunk's `q_sb`.
    pub sb: [u32; 4],
}

/// The most chunks `embed_split` gathers from in one dispatch.
pub const EMBED_SPLIT_CHUNKS: usize = 4;

/// Record `hidden[t] = table[ids[t]]`: one dispatch for a table in one binding or split in up to
/// [`EMBED_SPLIT_CHUNKS`] chunks of equal rows (the last may hold fewer), else one per chunk.
pub fn embed(
    rec: &mut Recorder,
    table: &GpuWeight,
    ids: &wgpu::Buffer,
    tokens: usize,
    hidden: &wgpu::Buffer,
) -> Result<(), GpuError> {
    let groups = [(table.cols as u32).div_ceil(64), tokens as u32, 1];
    let base = EmbedParams { n: table.cols as u32, rows: tokens as u32, ..Default::default() };
    let chunks = &table.chunks;
    let per = chunks.first().map_or(0, |c| c.rows);
    let last = chunks.len().saturating_sub(1);
    let uniform = chunks.iter().enumerate().all(|(i, c)| {
        c.row_start == i * per && c.dtype == chunks[0].dtype && (c.rows == per || (i == last && c.rows < per))
    });
    if (2..=EMBED_SPLIT_CHUNKS).contains(&chunks.len()) && uniform {
        let key = PipelineKey { kernel: Kernel::EmbedSplit, dtype: chunks[0].dtype, accumulate: false, variant: 0 };
        let mut sb = [0; 4];
        sb.iter_mut().zip(chunks.iter()).for_each(|(s, c)| *s = c.sb);
        let (chunks_n, rows) = (chunks.len() as u32, table.rows as u32);
        let params = EmbedParams { row_count: rows, chunks: chunks_n, per_chunk: per as u32, sb, ..base };
        let rest = |i: usize| &chunks[i.min(chunks.len() - 1)].buffer;
        let storage = [ids, hidden, rest(1), rest(2), rest(3)];
        return rec.dispatch(key, &params, &storage, &[&chunks[0].bind_group], groups);
    }
    for chunk in chunks {
        let key = PipelineKey { kernel: Kernel::Embed, dtype: chunk.dtype, accumulate: false, variant: 0 };
        let params =
            EmbedParams { row_start: chunk.row_start as u32, row_count: chunk.rows as u32, q_sb: chunk.sb, ..base };
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
    // (value, index, non-finite flag) per block.
    (n.div_ceil(ARGMAX_BLOCK) * 12) as u64
}

/// Record the greedy choice over `n` logits (the rule of [`crate::runtime::argmax`], NaN and ties
/// included): the chosen id lands in `ids[0]`, where the next step's embedding reads it, and
/// `ids[1]` becomes 1 when any of the logits is NaN or infinite (0 otherwise). `ids` must hold
/// two words.
pub fn argmax(
    rec: &mut Recorder,
    logits: &wgpu::Buffer,
    parts: &wgpu::Buffer,
    ids: &wgpu::Buffer,
    n: usize,
) -> Result<(), GpuError> {
    argmax_rows(rec, logits, parts, ids, (n, 1))
}

/// [`argmax`] of each of `rows` rows of `n` logits (`[rows, n]` from element 0), in the same two
/// dispatches: row r's id into `ids[2r]`, its flag into `ids[2r + 1]`; `parts` holds
/// `rows · argmax_scratch_bytes(n)`.
pub fn argmax_rows(
    rec: &mut Recorder,
    logits: &wgpu::Buffer,
    parts: &wgpu::Buffer,
    ids: &wgpu::Buffer,
    (n, rows): (usize, usize),
) -> Result<(), GpuError> {
    let blocks = n.div_ceil(ARGMAX_BLOCK) as u32;
    let params = ArgmaxParams { n: n as u32, block: ARGMAX_BLOCK as u32, parts: blocks, _pad: 0 };
    let rows = rows as u32;
    rec.dispatch(PipelineKey::plain(Kernel::ArgmaxBlocks), &params, &[logits, parts], &[], [blocks, rows, 1])?;
    rec.dispatch(PipelineKey::plain(Kernel::ArgmaxFinal), &params, &[parts, ids], &[], [rows, 1, 1])
}

/// Mirrors `Params` in `topk.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct TopkParams {
    /// Logits.
    pub n: u32,
    /// Logits per workgroup of the first pass.
    pub block: u32,
    /// Pairs the final pass merges.
    pub parts: u32,
    /// Candidates kept.
    pub k: u32,
    /// History ids masked.
    pub hist: u32,
    /// 1 / temperature, for the blocks' softmax masses (0: none are computed).
    pub inv_t: f32,
    /// Padding.
    pub _pad: [u32; 2],
}

/// Logits per workgroup of the first top-k pass (256 invocations × 16).
pub const TOPK_BLOCK: usize = 4096;

/// Pairs the final top-k pass holds (256 invocations × 32).
const TOPK_MERGE: usize = 256 * 32;

/// The most candidates [`topk`] returns for `n` logits: 128, fewer when the blocks' pairs would not
/// fit the final pass.
pub fn topk_max(n: usize) -> usize {
    (TOPK_MERGE / n.div_ceil(TOPK_BLOCK).max(1)).min(128)
}

/// Bytes of the pair buffer [`topk`] needs for `n` logits: the blocks' pairs, then their masses.
pub fn topk_scratch_bytes(n: usize) -> u64 {
    (n.div_ceil(TOPK_BLOCK) * (topk_max(n) + 1) * 8) as u64
}

/// Blocks of the first top-k pass over `n` logits (one softmax mass each).
pub fn topk_blocks(n: usize) -> usize {
    n.div_ceil(TOPK_BLOCK)
}

/// Byte offset in the pair buffer of the blocks' softmax masses after a pass keeping `k`: one
/// `(m, s)` f32 pair per block, `s = Σ exp((l − m) · inv_t)` over the block's finite logits outside
/// the history, `m` its largest (see `topk.wgsl`).
pub fn topk_mass_offset(n: usize, k: usize) -> u64 {
    (topk_blocks(n) * k * 8) as u64
}

/// The buffers of a top-k pass.
pub struct TopkIo<'a> {
    /// The logits row (history entries are overwritten by the mask).
    pub logits: &'a wgpu::Buffer,
    /// Scratch of [`topk_scratch_bytes`].
    pub parts: &'a wgpu::Buffer,
    /// Out: `k` (key, id) pairs, best first.
    pub out: &'a wgpu::Buffer,
    /// The unique history ids (`hist` of them).
    pub hist_ids: &'a wgpu::Buffer,
    /// Out: their logits, in the same order.
    pub hist_out: &'a wgpu::Buffer,
}

/// Record the `k` (≤ [`topk_max`]) best of `n` logits after masking `hist` history ids: pairs
/// (key, id) in `Sampler::sample`'s order, key = the f32 bits mapped to a total order
/// ([`topk_value`] maps back); and with `inv_t > 0` each block's softmax mass at that inverse
/// temperature in the scratch ([`topk_mass_offset`]).
pub fn topk(rec: &mut Recorder, io: &TopkIo, n: usize, k: usize, hist: usize, inv_t: f32) -> Result<(), GpuError> {
    if k == 0 || k > topk_max(n) {
        return Err(GpuError::Validation {
            during: "recording a top-k pass".into(),
            message: format!("k = {k}, expected 1..={}", topk_max(n)),
        });
    }
    let blocks = topk_blocks(n);
    let params = TopkParams {
        n: n as u32,
        block: TOPK_BLOCK as u32,
        parts: (blocks * k) as u32,
        k: k as u32,
        hist: hist as u32,
        inv_t,
        _pad: [0; 2],
    };
    if hist > 0 {
        let groups = [hist.div_ceil(256) as u32, 1, 1];
        rec.dispatch(
            PipelineKey::plain(Kernel::TopkMask),
            &params,
            &[io.logits, io.hist_out, io.hist_ids],
            &[],
            groups,
        )?;
    }
    rec.dispatch(PipelineKey::plain(Kernel::TopkBlocks), &params, &[io.logits, io.parts], &[], [blocks as u32, 1, 1])?;
    rec.dispatch(PipelineKey::plain(Kernel::TopkFinal), &params, &[io.parts, io.out], &[], [1, 1, 1])
}

/// The logit a top-k key stands for (bit-exact).
pub fn topk_value(key: u32) -> f32 {
    f32::from_bits(if key & 0x8000_0000 != 0 { key & 0x7fff_ffff } else { !key })
}
