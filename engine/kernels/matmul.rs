//! Every nn.Linear: `matmul.wgsl` (tiled, several tokens) or `matvec.wgsl` (one token).

use std::ops::Range;

use crate::error::GpuError;
use crate::gpu::{grid_1d, Dtype, GpuContext, GpuWeight, Recorder};
pub use crate::gpu::{
    matmul_overrides, matmul_variant, matvec_batch_variants, matvec_overrides, matvec_variant, matvec_variants,
    MATMUL_TILES, MATVEC_BATCH_GLU, MATVEC_BATCH_NORM, MATVEC_BATCH_TOKENS, MATVEC_LANES, MATVEC_SPLIT,
};
use crate::gpu::{Kernel, PipelineKey};
use crate::kernels::learn::{sum_slices, SlicesOut};

/// Mirrors `Params` in `matmul.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MatmulParams {
    /// Rows of x (tokens).
    pub m: u32,
    /// Rows of this weight chunk.
    pub n: u32,
    /// Input features.
    pub k: u32,
    /// First element of x.
    pub x_offset: u32,
    /// Row stride of x.
    pub x_stride: u32,
    /// Element of y where row 0, column 0 of this chunk goes.
    pub y_offset: u32,
    /// Row stride of y.
    pub y_stride: u32,
    /// Weight row of the binding where the dispatch's row 0 is.
    pub w_row0: u32,
    /// Row stride of t (the input group's total rank).
    pub lora_t_stride: u32,
    /// The dispatch's row 0 among the rows the LoRA segments describe.
    pub lora_row0: u32,
    /// Epsilon of the fused RMSNorm (matvec).
    pub eps: f32,
    /// Affine weights: the `u32` index of the chunk's scales and biases (`WeightChunk::sb`).
    pub q_sb: u32,
    /// Element of t's buffer where the scale table's row 0 is ([`NO_TABLE`]: none).
    pub lora_sc: u32,
    /// Row stride of the scale table (0: one row for every row of t).
    pub lora_sc_stride: u32,
    /// Split shrink (the matvecs): parts of t summed from x per token (0: t is read from its
    /// buffer).
    pub lora_parts: u32,
    /// Split shrink: the element of x where part 0 starts (a multiple of 4).
    pub lora_parts_at: u32,
    /// Shrink out (matvec): the rank of the next projections' shrink written split by workgroup
    /// (0: none).
    pub out_rank: u32,
    /// Shrink out: the element of y where part 0 starts (a multiple of 4).
    pub out_at: u32,
    /// Shrink out: 1 when each output is taken times (1 + the norm weight) ([`ShrinkOut::norm`]).
    pub out_norm: u32,
    /// Norm out (matvec): the element of y where the outputs times (1 + the norm weight) go
    /// (0: none; [`NormOut`]).
    pub xw_at: u32,
    /// Norm out: the element of y where the workgroups' sums of squares go.
    pub ssq_at: u32,
    /// Fused norm (matvec): parts of x's sum of squares, x already times (1 + the norm weight)
    /// (0: the kernel sums x² itself; [`FusedNorm::prenormed`]).
    pub ssq_parts: u32,
    /// The element of x where those parts start.
    pub ssq_parts_at: u32,
    /// Matmul: inputs one slice of a split reduction takes ([`matmul_split`]; `k`: unsplit).
    pub k_span: u32,
    /// End row of each LoRA segment (`u32::MAX` past the last).
    pub seg_end: [u32; 4],
    /// Rank of each segment (0: no adapter on its rows).
    pub seg_rank: [u32; 4],
    /// First column of each segment's rank in t.
    pub seg_t: [u32; 4],
    /// Element of B holding each segment's row 0.
    pub seg_b: [u32; 4],
    /// Effective scale of each segment (user scale × alpha / r).
    pub seg_scale: [f32; 4],
}

/// The block norm a linear layer applies to x first (`NORM` in `matvec.wgsl` for a single
/// token, in `matvec_batch.wgsl` for 2 to 8; the tiled matmul has none).
#[derive(Clone, Copy)]
pub struct FusedNorm<'a> {
    /// The RMSNorm1p weight `[K]` (f32).
    pub weight: &'a wgpu::Buffer,
    /// Epsilon.
    pub eps: f32,
    /// Where x is the norm's input already times `1 + weight` with its sum of squares in parts
    /// (a residual projection's [`NormOut`]), those parts in x: the layer then reads neither the
    /// weight nor x² (None: it applies the weight and sums x² itself).
    pub prenormed: Option<SplitShrink>,
}

/// What a single-token residual projection (accumulating into the residual stream) writes for
/// the next block, whose projections fuse that block's RMSNorm1p: its outputs times `1 + weight`
/// from element `at` of y, and one sum of its outputs' squares per workgroup
/// ([`shrink_out_parts`] of them) from element `ssq_at`. The readers take them as a
/// [`FusedNorm::prenormed`] input: per weight row group they load the parts instead of the norm
/// weight beside every x value and x² summed over the whole row.
#[derive(Clone, Copy)]
pub struct NormOut<'a> {
    /// The next block's RMSNorm1p weight `[n]` (f32); the same buffer as a residual
    /// [`ShrinkOut::norm`] beside it.
    pub weight: &'a wgpu::Buffer,
    /// The element of y where the outputs times `1 + weight` start (a multiple of 4, past the
    /// outputs).
    pub at: usize,
    /// The element of y where the workgroups' sums of squares start (past those).
    pub ssq_at: usize,
}

/// The LoRA shrink of a single-token layer's output for the projections that read it next,
/// written by the layer's dispatch split by workgroup ([`shrink_out_parts`] parts of `rank`
/// rounded up to 4, in y from element `at`): those projections sum them as a [`SplitShrink`]
/// instead of a shrink dispatch of their own. A SwiGLU layer writes down_proj's; a residual
/// projection (accumulating into the residual stream) writes the next block's input group's, of
/// the residual times `1 + norm` (the block's RMSNorm1p weight; the reading projection fuses
/// that norm and scales the expand by its rsqrt).
#[derive(Clone, Copy)]
pub struct ShrinkOut<'a> {
    /// A, f32 `[rank, n]` (n: the layer's outputs).
    pub a: &'a wgpu::Buffer,
    /// Rows of A (at most [`SPLIT_SHRINK_MAX_RANK`]).
    pub rank: usize,
    /// The element of y where part 0 starts (a multiple of 4, past the outputs).
    pub at: usize,
    /// The RMSNorm1p weight `[n]` (f32) the reading projections fuse, for a residual projection.
    pub norm: Option<&'a wgpu::Buffer>,
}

/// What a linear layer fuses in, saving the dispatches that would do it: all of it for a single
/// token, the norm and SwiGLU for the batched matvec's 2 to 8 tokens.
#[derive(Clone, Copy)]
pub struct Fuse<'a> {
    /// The block's RMSNorm1p of x, before the product.
    pub norm: Option<FusedNorm<'a>>,
    /// SwiGLU after the product (`GLU`) over a concatenated `[gate; up]` weight: the rows are
    /// split in halves and `y = silu(gate) · up` (half as many outputs as rows).
    pub glu: bool,
    /// The next projections' LoRA shrink of the output, split by workgroup (with SwiGLU, or
    /// accumulating into the residual stream with the next block's norm weight).
    pub shrink_out: Option<ShrinkOut<'a>>,
    /// The output through the next block's norm weight for the projections that fuse that norm
    /// (accumulating into the residual stream).
    pub norm_out: Option<NormOut<'a>>,
}

impl Fuse<'_> {
    /// Nothing fused.
    pub const NONE: Fuse<'static> = Fuse { norm: None, glu: false, shrink_out: None, norm_out: None };

    /// The `variant` bits: 1 = norm, 2 = SwiGLU.
    pub fn code(&self) -> u32 {
        u32::from(self.norm.is_some()) | u32::from(self.glu) << 1
    }
}

/// One projection's LoRA expand inside a run of rows: `y += scale · t[:, t_offset..+rank] · Bᵀ`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoraSegment {
    /// Rows of the segment (the projection's output features).
    pub rows: usize,
    /// Rank r (0: the projection has no adapter).
    pub rank: usize,
    /// First column of its rank in t.
    pub t_offset: usize,
    /// Element of B holding its row 0 (`[rows, rank]` f32 from there).
    pub b_offset: usize,
    /// Effective scale.
    pub scale: f32,
}

/// `lora_sc` of an expand without a scale table (`NO_TABLE` in `linear.wgsl`).
pub const NO_TABLE: u32 = u32::MAX;

/// Per-rank-column factors of an expand, in t's buffer: element `offset + m·stride + c`
/// multiplies `t[m, c]` (stride 0: the same factors for every row).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleTableAt {
    /// Element of t's buffer holding the factor of column 0 (a multiple of 4).
    pub offset: usize,
    /// Row stride (0 or a multiple of 4).
    pub stride: usize,
}

/// The most projections one dispatch's LoRA expand covers (the four GDN input projections).
pub const MAX_SEGMENTS: usize = 4;

/// The LoRA expand fused into a linear layer: the rows of the view the layer runs, in
/// consecutive segments, one per projection.
#[derive(Clone)]
pub struct LoraExpand<'a> {
    /// Shrink output `[m, t_stride]` (`t = x · Aᵀ` for the whole input group).
    pub t: &'a wgpu::Buffer,
    /// Row stride of t.
    pub t_stride: usize,
    /// Group-2 bind group over B (f32, every segment's `[rows, rank]`).
    pub b: &'a wgpu::BindGroup,
    /// The segments, in row order, covering the rows.
    pub segments: Vec<LoraSegment>,
    /// Per-rank-column factors (an adapter set's scales), if any.
    pub table: Option<ScaleTableAt>,
    /// Where t comes from instead of `t` when the dispatch before split the shrink (the matvecs:
    /// one token, or the batched matvec's tokens without a fused norm or SwiGLU).
    pub parts: Option<SplitShrink>,
}

/// A shrink the dispatch before the linear layer wrote in parts: split by head by the token
/// mixer's decode kernel (`gdn_step.wgsl`, `attention_one.wgsl`), or by workgroup by a
/// [`ShrinkOut`]. `count` parts of `t_stride` columns rounded up to 4, in the linear layer's input
/// x from element `at` (for several tokens, token k's `count` parts after token k − 1's); the
/// matvec sums them in its prologue. With a fused norm
/// ([`Fuse::norm`]) the parts are of `x · (1 + w)` before the norm's scale (a residual
/// projection's shrink out) and the matvec multiplies its expand by that scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitShrink {
    /// Parts (one per head or workgroup).
    pub count: usize,
    /// The element of x where part 0 starts (a multiple of 4).
    pub at: usize,
}

/// The largest total rank a split shrink takes (`tsum` in `matvec.wgsl`).
pub const SPLIT_SHRINK_MAX_RANK: usize = 256;

/// Tokens times rank a batched matvec's split shrink holds at most (`matvec_batch.wgsl`'s `TSUM`:
/// every token's t staged in workgroup memory).
pub const BATCH_SPLIT_SHRINK_FLOATS: usize = 1024;

/// The parts a single-token layer over `rows` weight rows writes its [`ShrinkOut`] in: one per
/// workgroup (with SwiGLU the rows are `[gate; up]`, half as many outputs).
pub fn shrink_out_parts(ctx: &GpuContext, rows: usize, glu: bool) -> usize {
    let lanes = matvec_lanes(rows, ctx.min_workgroups()) as usize;
    if glu {
        (rows / 2).div_ceil(4 * 64 / lanes)
    } else {
        rows.div_ceil(8 * 64 / lanes)
    }
}

/// Why `s` cannot be written by the layer `view` → `io` (SwiGLU when `glu`, `norm` when it fuses
/// a norm of its input), if it cannot.
fn shrink_out_error(
    ctx: &GpuContext,
    view: &WeightRows,
    io: &LinearIo,
    (glu, norm): (bool, bool),
    s: ShrinkOut,
) -> Option<String> {
    let n = if glu { view.rows.len() / 2 } else { view.rows.len() };
    let end = s.at + shrink_out_parts(ctx, view.rows.len(), glu) * s.rank.next_multiple_of(4);
    if io.m != 1 || !view.in_one_chunk() || io.y_offset != 0 {
        Some(format!(
            "a shrink out needs one token, one binding and y from 0, got {} tokens from {}",
            io.m, io.y_offset
        ))
    } else if glu == s.norm.is_some() || (s.norm.is_some() && (norm || !io.accumulate)) {
        Some(format!(
            "a shrink out is written by SwiGLU (no norm weight) or by a residual projection (accumulating, not fusing a norm, with the next norm's weight): got SwiGLU {glu}, accumulate {}, fused norm {norm}, next norm {}",
            io.accumulate,
            s.norm.is_some()
        ))
    } else if s.rank == 0 || s.rank > SPLIT_SHRINK_MAX_RANK || !s.at.is_multiple_of(4) || s.at < n {
        Some(format!(
            "a shrink out takes a rank of 1 to {SPLIT_SHRINK_MAX_RANK} and parts from a multiple of 4 past the {n} outputs: got rank {}, parts from {}",
            s.rank, s.at
        ))
    } else if (end * 4) as u64 > io.y.size()
        || ((s.rank * n) * 4) as u64 > s.a.size()
        || s.norm.is_some_and(|w| (n * 4) as u64 > w.size())
    {
        Some(format!(
            "a shrink out of rank {} over {n} outputs runs past y ({} bytes, parts to element {end}), A ({} bytes) or the norm weight ({} bytes)",
            s.rank,
            io.y.size(),
            s.a.size(),
            s.norm.map_or(0, |w| w.size())
        ))
    } else {
        None
    }
}

/// Why `o` cannot be written by the layer `view` → `io` fusing `fuse`, if it cannot: a norm out
/// is a residual projection's (one token, one binding, accumulating from y's element 0, no SwiGLU
/// or fused norm), and its two regions lie past the outputs, apart from each other and from a
/// shrink out's parts, inside y.
fn norm_out_error(ctx: &GpuContext, view: &WeightRows, io: &LinearIo, fuse: Fuse, o: NormOut) -> Option<String> {
    let n = view.rows.len();
    let parts = shrink_out_parts(ctx, n, false);
    let shrink = fuse.shrink_out.map_or(0..0, |s| s.at..s.at + parts * s.rank.next_multiple_of(4));
    let regions = [0..n, o.at..o.at + n, o.ssq_at..o.ssq_at + parts, shrink];
    let overlap = regions.iter().enumerate().any(|(i, a)| {
        regions[i + 1..].iter().any(|b| !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end)
    });
    if io.m != 1 || !view.in_one_chunk() || io.y_offset != 0 || !io.accumulate || fuse.glu || fuse.norm.is_some() {
        Some(format!(
            "a norm out is written by a residual projection (one token, one binding, accumulating into y from 0, no SwiGLU or fused norm): got {} tokens, y from {}, accumulate {}, SwiGLU {}, fused norm {}",
            io.m,
            io.y_offset,
            io.accumulate,
            fuse.glu,
            fuse.norm.is_some()
        ))
    } else if fuse.shrink_out.and_then(|s| s.norm).is_some_and(|w| w != o.weight) {
        Some("a norm out and a residual shrink out beside it take the same norm weight".to_string())
    } else if !o.at.is_multiple_of(4) || overlap {
        Some(format!(
            "a norm out's {n} outputs from element {} (a multiple of 4) and {parts} sums from {} lie apart, past the outputs and any shrink out's parts",
            o.at, o.ssq_at
        ))
    } else if ((o.at + n).max(o.ssq_at + parts) * 4) as u64 > io.y.size() || (n * 4) as u64 > o.weight.size() {
        Some(format!(
            "a norm out of {n} outputs from element {} and {parts} sums from {} runs past y ({} bytes) or the norm weight ({} bytes)",
            o.at,
            o.ssq_at,
            io.y.size(),
            o.weight.size()
        ))
    } else {
        None
    }
}

/// Why a layer cannot read `io.x` as a prenormed input with its sums of squares in `p`, if it
/// cannot.
fn prenormed_error(io: &LinearIo, p: SplitShrink) -> Option<String> {
    if io.m != 1 || p.count == 0 || ((p.at + p.count) * 4) as u64 > io.x.size() {
        Some(format!(
            "a prenormed input takes one token and its sums of squares inside x: got {} tokens, {} sums from element {} of {} bytes",
            io.m,
            p.count,
            p.at,
            io.x.size()
        ))
    } else {
        None
    }
}

/// The uniform fields of up to four segments: ends, ranks, t columns, B elements, scales.
type SegmentFields = ([u32; 4], [u32; 4], [u32; 4], [u32; 4], [f32; 4]);

impl<'a> LoraExpand<'a> {
    /// One projection: `y += scale · t[:, t_offset..t_offset + rank] · Bᵀ`, B `[rows, rank]` from
    /// element `b_offset`.
    pub fn single(
        t: &'a wgpu::Buffer,
        (t_offset, t_stride): (usize, usize),
        (rank, b_offset): (usize, usize),
        scale: f32,
        b: &'a wgpu::BindGroup,
    ) -> Self {
        let seg = LoraSegment { rows: usize::MAX, rank, t_offset, b_offset, scale };
        Self { t, t_stride, b, segments: vec![seg], table: None, parts: None }
    }

    fn fields(&self) -> Result<SegmentFields, GpuError> {
        if self.segments.len() > MAX_SEGMENTS {
            return Err(GpuError::Validation {
                during: "recording a linear layer".into(),
                message: format!("{} LoRA segments, at most {MAX_SEGMENTS}", self.segments.len()),
            });
        }
        let mut f = ([u32::MAX; 4], [0; 4], [0; 4], [0; 4], [0.0; 4]);
        let mut end = 0usize;
        for (j, s) in self.segments.iter().enumerate() {
            end = end.saturating_add(s.rows);
            f.0[j] = u32::try_from(end).unwrap_or(u32::MAX);
            f.1[j] = s.rank as u32;
            f.2[j] = s.t_offset as u32;
            f.3[j] = s.b_offset as u32;
            f.4[j] = s.scale;
        }
        Ok(f)
    }
}

/// Rows `rows` of a weight: what one linear layer computes (a whole projection, or one
/// projection of a concatenated weight).
#[derive(Clone)]
pub struct WeightRows<'a> {
    /// The weight.
    pub w: &'a GpuWeight,
    /// Its rows.
    pub rows: Range<usize>,
}

impl<'a> WeightRows<'a> {
    /// Every row of `w`.
    pub fn all(w: &'a GpuWeight) -> Self {
        Self { w, rows: 0..w.rows }
    }

    /// Whether the rows lie in one binding (what the SwiGLU pairing needs).
    pub fn in_one_chunk(&self) -> bool {
        self.w.chunks.iter().any(|c| c.row_start <= self.rows.start && self.rows.end <= c.row_start + c.rows)
    }
}

/// Where a linear layer reads and writes.
pub struct LinearIo<'a> {
    /// Input activations `[m, k]`, row stride `k`.
    pub x: &'a wgpu::Buffer,
    /// First element of x.
    pub x_offset: usize,
    /// Tokens.
    pub m: usize,
    /// Output `[m, y_stride]`.
    pub y: &'a wgpu::Buffer,
    /// First element of y.
    pub y_offset: usize,
    /// Row stride of y (the layer's output width unless writing into a wider buffer).
    pub y_stride: usize,
    /// Add into y instead of overwriting it (fused residual add).
    pub accumulate: bool,
}

/// Invocations along K (LANES) of the single-token and the batched matvec for a chunk of `n`
/// rows: both give an invocation 8 rows, so a workgroup 8 · 64 / LANES. The most rows per
/// workgroup (64, 32, 16, then 8) that still gives the device `min_groups` workgroups; LANES 64
/// when none does. More rows per workgroup read x once for more rows, stream 128 contiguous bytes
/// per row and step (8 lanes × 16 bytes) and leave fewer partial sums to reduce; fewer rows keep
/// a narrow projection (the LoRA shrinks: a few dozen rows) spread over the device.
pub fn matvec_lanes(n: usize, min_groups: usize) -> u32 {
    for lanes in [8, 16, 32] {
        if n.div_ceil(8 * 64 / lanes as usize) >= min_groups {
            return lanes;
        }
    }
    64
}

/// The most tokens the batched matvec takes; more run the tiled matmul.
pub const MAX_BATCH_TOKENS: usize = 8;

/// `TOK` of the batched matvec for `m` tokens: the smallest variant that holds them.
pub fn batch_tokens(m: usize) -> u32 {
    MATVEC_BATCH_TOKENS.iter().copied().find(|&t| t as usize >= m).unwrap_or(MAX_BATCH_TOKENS as u32)
}

/// Tokens per matmul tile for `m` tokens: 128 unless half a tile would be padding; up to 64
/// tokens, the smallest tile that holds them all (every weight is read once, and at most half the
/// tile is padding). Every tile gives an invocation 8 rows and the workgroup `16 · TM / 8`
/// invocations. Invocations whose rows are all padding skip their FMAs, but they
/// still take a share of the workgroup and its staging.
pub fn matmul_rows(m: usize) -> u32 {
    match m {
        0..=16 => 16,
        17..=32 => 32,
        33..=64 => 64,
        _ => 128,
    }
}

/// The matmul tile for `m` tokens and `n` outputs on a device that wants `min_groups`
/// workgroups: [`matmul_rows`] tokens by 128 outputs (twice the FMAs per staged x value, half
/// the x tiles staged) where a grid of such tiles still has `min_groups`, else by 64.
pub fn matmul_tile(m: usize, n: usize, min_groups: usize) -> u32 {
    let tm = matmul_rows(m);
    let wide = n.div_ceil(128) * m.div_ceil(tm as usize) >= min_groups;
    matmul_variant(tm, if wide { 128 } else { 64 })
}

/// Inputs each slice of a split matmul reduction takes at least: 16 of its 16-deep steps, so the
/// slices' stores and their sum stay small against the reduction.
pub const SPLIT_MIN_SPAN: usize = 256;

/// How the tiled matmul over `m` tokens, `n` outputs and `k` inputs with the tile `variant`
/// splits its reduction on a device that wants `min_groups` workgroups: `(slices, span)`, slice z
/// reducing inputs `z · span .. + span` (a multiple of the 16-deep K step), so that tiles times
/// slices come close to `min_groups` without passing it. `(1, k)` where the tiles alone give
/// more than half of `min_groups` or `k` is too short to split.
pub fn matmul_split(m: usize, n: usize, k: usize, variant: u32, min_groups: usize) -> (usize, usize) {
    let (tm, tn) = matmul_overrides(variant);
    let tiles = n.div_ceil(tn as usize) * m.div_ceil(tm as usize);
    let slices = (min_groups / tiles.max(1)).min(k / SPLIT_MIN_SPAN);
    if 2 * tiles > min_groups || slices < 2 {
        return (1, k);
    }
    let span = k.div_ceil(slices).next_multiple_of(16);
    (k.div_ceil(span), span)
}

/// Floats of scratch a split matmul reduction takes at most on a device that wants `min_groups`
/// workgroups: slices times tiles stay within `min_groups` ([`matmul_split`]), and a split tile
/// is at most 128 tokens by 64 outputs (the 128-wide tile is chosen only where its grid alone
/// fills the device, [`matmul_tile`]).
pub fn matmul_split_floats(min_groups: usize) -> u64 {
    min_groups as u64 * 128 * 64
}

/// Record `y (+)= x Wᵀ [+ s·t·Bᵀ]`, one dispatch per weight chunk. Without `lora` the plain
/// pipelines run (no LoRA code at all).
pub fn linear(rec: &mut Recorder, w: &GpuWeight, io: &LinearIo, lora: Option<&LoraExpand>) -> Result<(), GpuError> {
    linear_rows(rec, WeightRows::all(w), io, lora, Fuse::NONE)
}

/// Whether [`linear_rows`] runs the batched matvec for `m` tokens of `view` from x element
/// `x_offset`: 2 to 8 tokens of aligned rows (every weight read once for all of them). Affine
/// weights take the tiled matmul (the batched matvec decodes 16/32-bit weights only).
pub fn batched_matvec_takes(view: &WeightRows, m: usize, x_offset: usize) -> bool {
    (2..=MAX_BATCH_TOKENS).contains(&m)
        && view.w.cols.is_multiple_of(8)
        && x_offset.is_multiple_of(4)
        && view.w.chunks.iter().all(|c| !matches!(c.dtype, Dtype::Affine(_)))
}

/// [`linear`] with what `fuse` names: a single token takes all of it, the batched matvec's 2 to 8
/// tokens ([`batched_matvec_takes`]) the norm (not prenormed) and SwiGLU, the tiled matmul none.
pub fn linear_with(
    rec: &mut Recorder,
    w: &GpuWeight,
    io: &LinearIo,
    lora: Option<&LoraExpand>,
    fuse: Fuse,
) -> Result<(), GpuError> {
    linear_rows(rec, WeightRows::all(w), io, lora, fuse)
}

/// [`linear_with`] over the rows `view.rows` of a weight, one dispatch per chunk they touch; y's
/// column 0 is the view's first row. With SwiGLU the rows are `[gate; up]` in one chunk and y gets
/// half as many columns (a LoRA expand of several tokens: the gate and up segments).
pub fn linear_rows(
    rec: &mut Recorder,
    view: WeightRows,
    io: &LinearIo,
    lora: Option<&LoraExpand>,
    fuse: Fuse,
) -> Result<(), GpuError> {
    let rows = view.rows.clone();
    // A split shrink's rank (t's stride) and parts.
    let split = lora.and_then(|l| l.parts.map(|p| (l.t_stride, p)));
    let batch = batched_matvec_takes(&view, io.m, io.x_offset);
    let n_glu = rows.len() / 2;
    let bad = if io.m != 1 && (fuse.shrink_out.is_some() || fuse.norm_out.is_some()) {
        Some(format!("a shrink out or norm out needs one token, got {}", io.m))
    } else if fuse.norm.is_some() && io.m != 1 && !batch {
        Some(format!("a fused norm needs one token or the batched matvec's 2 to {MAX_BATCH_TOKENS} (16-bit or f32 weights, K a multiple of 8, x 16-byte aligned), got {} tokens", io.m))
    } else if fuse.glu && io.m != 1 && !batch {
        Some(format!("SwiGLU needs one token or the batched matvec's 2 to {MAX_BATCH_TOKENS} (16-bit or f32 weights, K a multiple of 8, x 16-byte aligned), got {} tokens", io.m))
    } else if fuse.glu && io.accumulate {
        Some("SwiGLU cannot also accumulate".to_string())
    } else if fuse.glu && (!rows.len().is_multiple_of(2) || !view.in_one_chunk()) {
        Some(format!("SwiGLU pairs the halves of rows {rows:?} in one binding"))
    } else if rows.end > view.w.rows || rows.start > rows.end {
        Some(format!("rows {rows:?} of a weight with {} rows", view.w.rows))
    } else if lora.is_some_and(|l| io.m != 1 && !batch && l.segments.len() != 1) {
        Some(format!(
            "the tiled matmul ({} tokens) takes one LoRA segment; several need the batched matvec's 2 to {MAX_BATCH_TOKENS} tokens",
            io.m
        ))
    } else if lora
        .is_some_and(|l| io.m != 1 && fuse.glu && (l.segments.len() != 2 || l.segments.iter().any(|s| s.rows != n_glu)))
    {
        Some(format!("a multi-token SwiGLU takes two LoRA segments of {n_glu} rows (gate, up)"))
    } else if let Some((rank, p)) =
        split.filter(|&(rank, p)| rank > SPLIT_SHRINK_MAX_RANK || !p.at.is_multiple_of(4) || p.count == 0)
    {
        Some(format!(
            "a split shrink takes a rank of at most {SPLIT_SHRINK_MAX_RANK} and parts from a multiple of 4: got rank {rank}, {} parts from {}",
            p.count, p.at
        ))
    } else if let Some((rank, _)) = split.filter(|&(rank, _)| {
        io.m != 1 && (!batch || fuse.norm.is_some() || fuse.glu || io.m * rank > BATCH_SPLIT_SHRINK_FLOATS)
    }) {
        Some(format!(
            "a split shrink of {} tokens takes the batched matvec's 2 to {MAX_BATCH_TOKENS} tokens without a fused norm or SwiGLU and tokens times rank at most {BATCH_SPLIT_SHRINK_FLOATS}: got rank {rank}",
            io.m
        ))
    } else if let Some(msg) =
        fuse.shrink_out.and_then(|s| shrink_out_error(rec.ctx(), &view, io, (fuse.glu, fuse.norm.is_some()), s))
    {
        Some(msg)
    } else if let Some(msg) = fuse.norm_out.and_then(|o| norm_out_error(rec.ctx(), &view, io, fuse, o)) {
        Some(msg)
    } else if let Some(msg) = fuse.norm.and_then(|n| n.prenormed).and_then(|p| prenormed_error(io, p)) {
        Some(msg)
    } else if let Some((rank, p)) =
        split.filter(|&(rank, p)| ((p.at + io.m * p.count * rank.next_multiple_of(4)) * 4) as u64 > io.x.size())
    {
        Some(format!(
            "a split shrink of {} parts of rank {rank} per token over {} tokens from element {} runs past x ({} bytes)",
            p.count,
            io.m,
            p.at,
            io.x.size()
        ))
    } else {
        None
    };
    if let Some(message) = bad {
        return Err(GpuError::Validation { during: "recording a linear layer".into(), message });
    }
    // Binding 4: the fused norm's weight, or the one a residual projection's shrink out or norm
    // out applies (norm_out_error: the same buffer when both are there).
    let out_norm = fuse.shrink_out.and_then(|s| s.norm);
    let next_norm = fuse.norm_out.map(|o| o.weight).or(out_norm);
    let (eps, aux) = fuse.norm.map_or((0.0, next_norm.unwrap_or(io.x)), |n| (n.eps, n.weight));
    let prenormed = fuse.norm.and_then(|n| n.prenormed);
    let out_a = fuse.shrink_out.map_or(io.x, |s| s.a);
    let kernel = match (io.m == 1, batch, lora.is_some()) {
        (true, _, false) => Kernel::Matvec,
        (true, _, true) => Kernel::MatvecLora,
        (false, true, false) => Kernel::MatvecBatch,
        (false, true, true) => Kernel::MatvecBatchLora,
        (false, false, false) => Kernel::Matmul,
        (false, false, true) => Kernel::MatmulLora,
    };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    let w = view.w;
    let (seg_end, seg_rank, seg_t, seg_b, seg_scale) = match lora {
        Some(l) => l.fields()?,
        None => ([u32::MAX; 4], [0; 4], [0; 4], [0; 4], [0.0; 4]),
    };
    for chunk in &w.chunks {
        let lo = rows.start.max(chunk.row_start);
        let hi = rows.end.min(chunk.row_start + chunk.rows);
        if lo >= hi {
            continue;
        }
        // Rows computed, and outputs stored (half of them with SwiGLU).
        let n_rows = hi - lo;
        let n_out = if fuse.glu { n_rows / 2 } else { n_rows };
        let g = rec.ctx().min_workgroups();
        let mut kernel = kernel;
        let variant = match kernel {
            Kernel::Matvec | Kernel::MatvecLora => {
                let lanes = matvec_lanes(n_rows, g);
                // The subgroup twin (no barrier where a row group fits in one subgroup).
                match rec.ctx().subgroup_matvec(lanes) {
                    Some(split) => {
                        kernel = if lora.is_some() { Kernel::MatvecSgLora } else { Kernel::MatvecSg };
                        matvec_variant(lanes, fuse.code() | if split { MATVEC_SPLIT } else { 0 })
                    }
                    None => matvec_variant(lanes, fuse.code()),
                }
            }
            Kernel::MatvecBatch | Kernel::MatvecBatchLora => {
                let glu = if fuse.glu { MATVEC_BATCH_GLU } else { 0 };
                let norm = if fuse.norm.is_some() { MATVEC_BATCH_NORM } else { 0 };
                matvec_variant(matvec_lanes(n_rows, g), batch_tokens(io.m) | glu | norm)
            }
            _ => matmul_tile(io.m, n_out, g),
        };
        // A tiled matmul over too few tiles splits its reduction: the slices go to the
        // recorder's scratch, and a second dispatch adds them into y.
        let (slices, span) = match kernel {
            Kernel::Matmul | Kernel::MatmulLora => matmul_split(io.m, n_out, w.cols, variant, g),
            _ => (1, w.cols),
        };
        let scratch = if slices > 1 { rec.split_scratch(matmul_split_floats(g)) } else { None };
        let row0 = lo - rows.start;
        // Split: slice z's partial products at z · m · n_out of the scratch, rows of n_out, never
        // accumulating (the sum adds into y); unsplit (also where no scratch could be had): y.
        let (y, y_offset, y_stride, accumulate, slices, span) = match &scratch {
            Some(s) => (s, 0, n_out, false, slices, span),
            None => (io.y, io.y_offset + row0, io.y_stride, io.accumulate, 1, w.cols),
        };
        let key = PipelineKey { kernel, dtype: chunk.dtype, accumulate, variant };
        let params = MatmulParams {
            m: io.m as u32,
            n: n_out as u32,
            k: w.cols as u32,
            x_offset: io.x_offset as u32,
            x_stride: w.cols as u32,
            y_offset: y_offset as u32,
            y_stride: y_stride as u32,
            w_row0: (lo - chunk.row_start) as u32,
            lora_t_stride: lora.map_or(0, |l| l.t_stride as u32),
            lora_row0: row0 as u32,
            eps,
            q_sb: chunk.sb,
            lora_sc: lora.and_then(|l| l.table).map_or(NO_TABLE, |s| s.offset as u32),
            lora_sc_stride: lora.and_then(|l| l.table).map_or(0, |s| s.stride as u32),
            lora_parts: lora.and_then(|l| l.parts).map_or(0, |s| s.count as u32),
            lora_parts_at: lora.and_then(|l| l.parts).map_or(0, |s| s.at as u32),
            out_rank: fuse.shrink_out.map_or(0, |s| s.rank as u32),
            out_at: fuse.shrink_out.map_or(0, |s| s.at as u32),
            out_norm: u32::from(out_norm.is_some()),
            xw_at: fuse.norm_out.map_or(0, |o| o.at as u32),
            ssq_at: fuse.norm_out.map_or(0, |o| o.ssq_at as u32),
            ssq_parts: prenormed.map_or(0, |p| p.count as u32),
            ssq_parts_at: prenormed.map_or(0, |p| p.at as u32),
            k_span: span as u32,
            seg_end,
            seg_rank,
            seg_t,
            seg_b,
            seg_scale,
        };
        let groups = if io.m == 1 || batch {
            // Rows per workgroup: 8 per invocation row group (4 with SwiGLU).
            let per_group = if fuse.glu { 4 * 64 } else { 8 * 64 } / matvec_overrides(variant).0;
            grid_1d((n_out as u32).div_ceil(per_group), max)
        } else {
            let (tm, tn) = matmul_overrides(variant);
            [(n_out as u32).div_ceil(tn), (io.m as u32).div_ceil(tm), slices as u32]
        };
        // The matvecs bind t and the norm weight always (x where unused), the single-token one
        // also the shrink-out A; the tiled matmul binds t only with LoRA.
        let t = lora.map_or(io.x, |l| l.t);
        let (plain, adapted);
        let bind: &[&wgpu::BindGroup] = match lora {
            Some(l) => {
                adapted = [&chunk.bind_group, l.b];
                &adapted
            }
            None => {
                plain = [&chunk.bind_group];
                &plain
            }
        };
        match kernel {
            Kernel::Matmul => rec.dispatch(key, &params, &[io.x, y], bind, groups)?,
            Kernel::MatmulLora => rec.dispatch(key, &params, &[io.x, y, t], bind, groups)?,
            Kernel::MatvecBatch | Kernel::MatvecBatchLora => {
                rec.dispatch(key, &params, &[io.x, y, t, aux], bind, groups)?
            }
            _ => rec.dispatch(key, &params, &[io.x, y, t, aux, out_a], bind, groups)?,
        }
        rec.weight_bytes((n_rows * chunk.dtype.row_bytes(w.cols)) as u64);
        if let Some(scratch) = &scratch {
            let out =
                SlicesOut { y: io.y, y_offset: io.y_offset + row0, y_stride: io.y_stride, accumulate: io.accumulate };
            rec.tagged("matmul_split_sum", |rec| sum_slices(rec, scratch, slices, (io.m, n_out), &out))?;
        }
    }
    Ok(())
}
