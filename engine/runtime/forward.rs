//! The layer loop's blocks: what one step (up to `max_batch` tokens; `session/step.rs` records it)
//! runs per layer.
//!
//! Scratch use per block (see `cache.rs` for the buffers):
//! * GDN: xnorm → in_proj_qkv → wide_a → conv → wide_b → delta rule (+ beta, decay) → mid_b,
//!   gated norm with z (mid_a) → out_proj added into hidden; one token: the four input
//!   projections in one dispatch → mixer_in, then one dispatch (conv, rule, gated norm) → mid_b;
//! * attention: xnorm → q_proj → wide_a, k_proj → mid_a, v_proj → mid_c → norm/RoPE → wide_b and
//!   the KV cache → attention → mid_b → o_proj added into hidden; one token (not captured for
//!   learning): q|k|v in one dispatch → mixer_in;
//! * MLP: xnorm → gate → mlp_g, up → mlp_u → SwiGLU → down added into hidden; one token (the
//!   single-token matvec) and 2 to 8 tokens (the batched matvec): gate|up with SwiGLU in one
//!   dispatch → mlp_g.
//!
//! The projections that read one input are one weight (rows concatenated, `weights.rs`); a
//! multi-token step runs each projection's row range into its own buffer.

use crate::error::GpuError;
use crate::gpu::{Dtype, GpuContext, GpuVector, GpuWeight, Recorder, WeightChunk};
use crate::kernels::attention::{attention, attention_one, AttnIo, AttnOneIo, AttnParams};
use crate::kernels::gdn::{gated_delta, gdn_step, GdnIo, GdnParams, GdnSplit, GdnStepIo, HeadShrink, GDN_STEP_MAX_D};
use crate::kernels::matmul::{
    batched_matvec_takes, linear_rows, linear_with, shrink_out_parts, Fuse, FusedNorm, LinearIo, LoraExpand,
    LoraSegment, NormOut, ShrinkOut, SplitShrink, WeightRows, BATCH_SPLIT_SHRINK_FLOATS, SPLIT_SHRINK_MAX_RANK,
};
use crate::kernels::misc::swiglu;
use crate::kernels::norm::{rms_norm, rms_norm_gated, rms_norm_shrink, NormIo, NormShrink};
use crate::lora::{InputGroup, LoraGroup, Proj};
use crate::model::{AttnWeights, GdnWeights, Mlp, Model, TextConfig};
use crate::runtime::adapters::BoundSet;
use crate::runtime::cache::Scratch;

/// The active adapter as one layer's step sees it.
#[derive(Clone, Copy)]
pub(crate) struct LayerLora<'a> {
    pub(crate) bound: &'a BoundSet,
    pub(crate) t: &'a wgpu::Buffer,
    pub(crate) layer: usize,
}

/// The shrink of one input group (`t = x·A_catᵀ`), when the adapter covers it: in t's buffer,
/// or in parts after the input row (`parts`: split by head by the token mixer, or by workgroup
/// by the SwiGLU dispatch or the residual projection before the block).
pub(crate) struct Shrunk<'a> {
    lora: LayerLora<'a>,
    group: &'a LoraGroup,
    parts: Option<SplitShrink>,
}

impl<'a> LayerLora<'a> {
    /// The layer's `group` and its A when A is f32 `[rank, cols]` in one binding, what the
    /// kernels that shrink inside another dispatch read (the head split, the shrink out,
    /// `rms_norm_shrink`); None when the adapter does not cover the group or A is not that.
    fn f32_a(self, group: InputGroup, cols: usize) -> Option<(&'a LoraGroup, &'a WeightChunk)> {
        let g = self.bound.lora.group(self.layer, group)?;
        let [chunk] = g.a.chunks.as_slice() else {
            return None;
        };
        (chunk.dtype == Dtype::F32 && g.a.cols == cols).then_some((g, chunk))
    }

    fn shrink(self, rec: &mut Recorder, group: InputGroup, src: Src, m: usize) -> Result<Option<Shrunk<'a>>, GpuError> {
        let Some(g) = self.bound.lora.group(self.layer, group) else {
            return Ok(None);
        };
        rec.tagged("lora_shrink", |rec| linear_with(rec, &g.a, &src.io(self.t, m, g.rank_total), None, src.fuse))?;
        Ok(Some(Shrunk { lora: self, group: g, parts: None }))
    }
}

/// out_proj's / o_proj's shrink split by head: what the mixer's decode kernel takes to write the
/// parts (`shrink`) and what the projection's expand reads (`shrunk`, with its parts).
pub(crate) struct HeadSplit<'a> {
    pub(crate) shrink: HeadShrink<'a>,
    pub(crate) shrunk: Shrunk<'a>,
}

/// The split shrink of the mixer output of `rows` rows (each of `row` elements, side by side in
/// `out`): the mixer's decode kernel writes each row's `heads` parts after the rows, and the
/// projection `w` sums them (no shrink dispatch). None when the adapter does not cover the group
/// or the split does not apply (A in more than one binding, a rank above the matvec's, unaligned
/// rows, `out` too small; for several rows, `w` outside the batched matvec or rows times rank
/// past what it stages): the group then takes the shrink dispatch.
pub(crate) fn head_split<'a>(
    lora: Option<LayerLora<'a>>,
    out: &wgpu::Buffer,
    (row, heads): (usize, usize),
    (rows, w): (usize, &GpuWeight),
) -> Option<HeadSplit<'a>> {
    let l = lora?;
    let (g, chunk) = l.f32_a(InputGroup::MixerOut, row)?;
    let batched = rows == 1
        || (batched_matvec_takes(&WeightRows::all(w), rows, 0) && rows * g.rank_total <= BATCH_SPLIT_SHRINK_FLOATS);
    let fits = batched
        && g.rank_total <= SPLIT_SHRINK_MAX_RANK
        && row.is_multiple_of(4)
        && (row / heads).is_multiple_of(4)
        && (parts_end(rows * row, rows * heads, g.rank_total) * 4) as u64 <= out.size();
    fits.then_some(HeadSplit {
        shrink: HeadShrink { a: &chunk.bind_group, rank: g.rank_total },
        shrunk: Shrunk { lora: l, group: g, parts: Some(SplitShrink { count: heads, at: rows * row }) },
    })
}

/// The element after `parts` parts of a rank-`rank` split shrink written after a row of `row`
/// elements: the parts start at the row rounded up to 4, each rank rounded up to 4 (what the
/// mixers' head split and a shrink out write; `Scratch` keeps room for the largest).
pub(crate) fn parts_end(row: usize, parts: usize, rank: usize) -> usize {
    row.next_multiple_of(4) + parts * rank.next_multiple_of(4)
}

/// Where a single-token residual projection over `n` outputs in `parts` workgroups puts its
/// norm out after its row and a rank-`rank` shrink out (rank 0: none): the prenormed row, the
/// sums of squares, and the end.
pub(crate) fn norm_out_layout(n: usize, parts: usize, rank: usize) -> (usize, usize, usize) {
    let at = parts_end(n, parts, rank);
    let ssq_at = at + n.next_multiple_of(4);
    (at, ssq_at, ssq_at + parts)
}

/// What a single-token residual projection (o_proj, out_proj, down_proj) writes besides its
/// outputs for the block after it, which folds its norm into its projections ([`residual_out`]).
#[derive(Clone, Copy, Default)]
pub(crate) struct NextWrites<'a> {
    /// The next block's input-group LoRA shrink, split by workgroup.
    pub(crate) shrink_out: Option<ShrinkOut<'a>>,
    /// The residual through the next block's norm weight, with its sums of squares.
    pub(crate) norm_out: Option<NormOut<'a>>,
}

/// What the block after a residual projection reads of what that projection wrote
/// ([`NextWrites`]): its prenormed input (the element of the residual buffer where it starts, and
/// the sums of squares), and its input group's shrink.
#[derive(Default)]
pub(crate) struct NextReads<'a> {
    pub(crate) input: Option<(usize, SplitShrink)>,
    pub(crate) shrunk: Option<Shrunk<'a>>,
}

/// What a single-token residual projection `w` adding into the residual stream `hidden` writes
/// for the next block, which folds its norm `norm` into its projections (`group`: that block's
/// input group, None for lm_head, which takes no adapter), and what that block reads: the input
/// group's shrink where [`split_out`] applies, then the residual times `1 + norm` and one sum of
/// squares per workgroup where they fit in `hidden` after it (its row, then the shrink's parts).
/// Nothing where `w` is in more than one binding: the block then takes its norm and shrink from
/// the residual itself.
pub(crate) fn residual_out<'a>(
    ctx: &GpuContext,
    lora: Option<LayerLora<'a>>,
    (group, norm): (Option<InputGroup>, &'a GpuVector),
    w: &GpuWeight,
    hidden: &wgpu::Buffer,
) -> (NextWrites<'a>, NextReads<'a>) {
    if !WeightRows::all(w).in_one_chunk() {
        return Default::default();
    }
    let n = w.rows;
    let split = group.and_then(|g| split_out(ctx, lora, (g, Some(norm)), (n, false), hidden));
    let parts = shrink_out_parts(ctx, n, false);
    let (at, ssq_at, end) = norm_out_layout(n, parts, split.as_ref().map_or(0, |(s, _)| s.rank));
    let fits = (end * 4) as u64 <= hidden.size();
    let norm_out = fits.then_some(NormOut { weight: &norm.buffer, at, ssq_at });
    let (shrink_out, shrunk) = split.unzip();
    let input = fits.then_some((at, SplitShrink { count: parts, at: ssq_at }));
    (NextWrites { shrink_out, norm_out }, NextReads { input, shrunk })
}

/// The shrink of `group` (the input group of the projections that read the layer's output)
/// written by a single-token layer over `rows` weight rows (SwiGLU over `[gate; up]` when
/// `glu`) split by workgroup after its outputs in `out`, of the outputs times (1 + `norm`) where
/// the readers fuse that norm: the [`ShrinkOut`] the layer takes and what the readers' expand
/// reads. None where `head_split` would refuse (the adapter does not cover the group, A not f32
/// in one binding, a rank above the matvec's, `out` too small).
fn split_out<'a>(
    ctx: &GpuContext,
    lora: Option<LayerLora<'a>>,
    (group, norm): (InputGroup, Option<&'a GpuVector>),
    (rows, glu): (usize, bool),
    out: &wgpu::Buffer,
) -> Option<(ShrinkOut<'a>, Shrunk<'a>)> {
    let l = lora?;
    let n = if glu { rows / 2 } else { rows };
    let (g, chunk) = l.f32_a(group, n)?;
    let count = shrink_out_parts(ctx, rows, glu);
    let at = n.next_multiple_of(4);
    let fits = g.rank_total <= SPLIT_SHRINK_MAX_RANK && (parts_end(n, count, g.rank_total) * 4) as u64 <= out.size();
    let shrunk = Shrunk { lora: l, group: g, parts: Some(SplitShrink { count, at }) };
    let write = ShrinkOut { a: &chunk.buffer, rank: g.rank_total, at, norm: norm.map(|v| &v.buffer) };
    fits.then_some((write, shrunk))
}

/// A block's input for the projections of `group` and their LoRA shrink when an adapter covers
/// the group: with `fold`, `hidden` with the block norm `norm` fused into the projections (read
/// prenormed where the residual projection before wrote it so, [`residual_out`]), and the shrink
/// that projection wrote or a dispatch;
/// otherwise `xnorm`, written by a norm dispatch of its own, which for one token also writes the
/// shrink when A is f32 in one binding (`rms_norm_shrink`: one dispatch instead of two).
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_input<'a>(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &'a Scratch,
    norm: &'a GpuVector,
    fold: bool,
    lora: Option<LayerLora<'a>>,
    (group, written): (InputGroup, NextReads<'a>),
    t: usize,
) -> Result<(Src<'a>, Option<Shrunk<'a>>), GpuError> {
    if fold {
        let src = Src::normed(&sc.hidden, &norm.buffer, c.rms_norm_eps, written.input);
        let s = match written.shrunk {
            Some(s) => Some(s),
            None => shrink(rec, lora, group, src, t)?,
        };
        return Ok((src, s));
    }
    debug_assert!(
        written.input.is_none() && written.shrunk.is_none(),
        "a residual projection wrote for a block that does not fold its norm"
    );
    let io = norm_rows(sc, c, 0, t);
    let src = Src::plain(&sc.xnorm);
    let one = t == 1 && c.hidden_size.is_multiple_of(4);
    if let Some((l, (g, chunk))) = lora.filter(|_| one).and_then(|l| Some((l, l.f32_a(group, c.hidden_size)?))) {
        let shrink = NormShrink { a: &chunk.bind_group, rank: g.rank_total, t: l.t };
        rms_norm_shrink(rec, norm, &io, shrink)?;
        return Ok((src, Some(Shrunk { lora: l, group: g, parts: None })));
    }
    rms_norm(rec, norm, &io)?;
    Ok((src, shrink(rec, lora, group, src, t)?))
}

/// Whether `t` rows can fold a block's RMSNorm1p into the projections over `w` that read it and
/// into their LoRA shrink (no norm dispatch): one row runs the single-token matvec, 2 to 8 the
/// batched matvec, both of which fuse it; the tiled matmul does not.
pub(crate) fn folds_norm(w: &GpuWeight, t: usize) -> bool {
    t == 1 || batched_matvec_takes(&WeightRows::all(w), t, 0)
}

/// The input of a block's projections: a buffer and what to do to it first (steps of 1 to 8
/// rows fold the block's RMSNorm into the projections that read it, single-token steps also the
/// SwiGLU product).
#[derive(Clone, Copy)]
pub(crate) struct Src<'a> {
    pub(crate) x: &'a wgpu::Buffer,
    /// The element of x where row 0 starts.
    pub(crate) offset: usize,
    pub(crate) fuse: Fuse<'a>,
}

impl<'a> Src<'a> {
    pub(crate) fn plain(x: &'a wgpu::Buffer) -> Self {
        Self { x, offset: 0, fuse: Fuse::NONE }
    }

    /// `x` through the block norm `weight` (fused into the projections that read it); with
    /// `prenormed`, the row from that element of x, already times `1 + weight`, and its sums of
    /// squares ([`residual_out`]).
    pub(crate) fn normed(
        x: &'a wgpu::Buffer,
        weight: &'a wgpu::Buffer,
        eps: f32,
        prenormed: Option<(usize, SplitShrink)>,
    ) -> Self {
        let norm = FusedNorm { weight, eps, prenormed: prenormed.map(|(_, p)| p) };
        Self { x, offset: prenormed.map_or(0, |(at, _)| at), fuse: Fuse { norm: Some(norm), ..Fuse::NONE } }
    }

    /// A linear layer reading `[m, k]` from this input and writing `[m, y_stride]` into `y`.
    pub(crate) fn io(&self, y: &'a wgpu::Buffer, m: usize, y_stride: usize) -> LinearIo<'a> {
        LinearIo { x_offset: self.offset, ..lin(self.x, y, m, y_stride) }
    }
}

impl<'a> Shrunk<'a> {
    /// The expand over the rows of `projs` (consecutive projections of one weight), if any of
    /// them is adapted.
    fn expand(&self, projs: &[Proj], c: &TextConfig) -> Option<LoraExpand<'a>> {
        let segments: Vec<LoraSegment> = projs
            .iter()
            .map(|&p| {
                let rows = p.dims(c).1;
                self.group.member(p).map_or(LoraSegment { rows, ..Default::default() }, |m| LoraSegment {
                    rows,
                    rank: m.rank,
                    t_offset: m.t_offset,
                    b_offset: m.b_offset,
                    scale: self.lora.bound.seg_scale[self.lora.layer][p.index()],
                })
            })
            .collect();
        let group = projs.first()?.group();
        let table = self.lora.bound.tables[self.lora.layer][group as usize];
        segments.iter().any(|s| s.rank > 0).then_some(LoraExpand {
            t: self.lora.t,
            t_stride: self.group.rank_total,
            b: &self.group.b_bind,
            segments,
            table,
            parts: self.parts,
        })
    }
}

/// The row order of the concatenated weights (`weights.rs`).
pub(crate) const GDN_IN: [Proj; 4] = [Proj::InProjQkv, Proj::InProjZ, Proj::InProjB, Proj::InProjA];
pub(crate) const ATTN_IN: [Proj; 3] = [Proj::QProj, Proj::KProj, Proj::VProj];
const MLP_IN: [Proj; 2] = [Proj::GateProj, Proj::UpProj];

/// Projections `parts` of the concatenated weight `w` whose row order is `order`.
pub(crate) struct Parts<'a> {
    pub(crate) w: &'a GpuWeight,
    pub(crate) order: &'a [Proj],
    pub(crate) parts: std::ops::Range<usize>,
}

impl Parts<'_> {
    pub(crate) fn rows(&self, c: &TextConfig) -> WeightRows<'_> {
        let end = |i: usize| self.order[..i].iter().map(|p| p.dims(c).1).sum::<usize>();
        WeightRows { w: self.w, rows: end(self.parts.start)..end(self.parts.end) }
    }
}

/// Shrink `src` for `group` if an adapter is active and covers it.
pub(crate) fn shrink<'a>(
    rec: &mut Recorder,
    lora: Option<LayerLora<'a>>,
    group: InputGroup,
    src: Src,
    m: usize,
) -> Result<Option<Shrunk<'a>>, GpuError> {
    match lora {
        Some(l) => l.shrink(rec, group, src, m),
        None => Ok(None),
    }
}

/// `linear` over some projections of a concatenated weight, with their LoRA expand when their
/// group was shrunk; `io.x` is `src.x`.
pub(crate) fn project(
    rec: &mut Recorder,
    c: &TextConfig,
    w: Parts,
    io: &LinearIo,
    src: Src,
    shrunk: &Option<Shrunk>,
) -> Result<(), GpuError> {
    let expand = shrunk.as_ref().and_then(|s| s.expand(&w.order[w.parts.clone()], c));
    linear_rows(rec, w.rows(c), io, expand.as_ref(), src.fuse)
}

/// A linear layer reading `[m, k]` from the start of `x` and writing `[m, y_stride]` into `y`.
pub(crate) fn lin<'a>(x: &'a wgpu::Buffer, y: &'a wgpu::Buffer, m: usize, y_stride: usize) -> LinearIo<'a> {
    LinearIo { x, x_offset: 0, m, y, y_offset: 0, y_stride, accumulate: false }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn gdn_block(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &GdnWeights,
    (conv, state, splits): ([&wgpu::Buffer; 2], [&wgpu::Buffer; 2], &[GdnSplit]),
    (src, s): (Src, Option<Shrunk>),
    (lora, next): (Option<LayerLora>, NextWrites),
    t: usize,
) -> Result<(), GpuError> {
    let (cd, vd, hv) = (c.conv_dim(), c.value_dim(), c.linear_value_heads);
    let part = |i: usize| Parts { w: &w.in_proj, order: &GDN_IN, parts: i..i + 1 };
    let params = gdn_params(c, t);
    let fused = t == 1 && splits.is_empty() && gdn_step_fits(c);
    if fused {
        // One token: one dispatch for the four projections, one for conv, rule and gated norm.
        let all = Parts { w: &w.in_proj, order: &GDN_IN, parts: 0..4 };
        project(rec, c, all, &src.io(&sc.mixer_in, 1, cd + vd + 2 * hv), src, &s)?;
        let io = GdnStepIo {
            mixed: &sc.mixer_in,
            conv_in: conv[0],
            conv_out: conv[1],
            state_in: state[0],
            state_out: state[1],
            core: &sc.mid_b,
        };
        let split = head_split(lora, &sc.mid_b, (vd, hv), (1, &w.out_proj));
        gdn_step(rec, &w.step_params, &params, &io, split.as_ref().map(|s| s.shrink))?;
        return mixer_out(rec, c, sc, (&w.out_proj, Proj::OutProj), lora, t, (split.map(|s| s.shrunk), next));
    } else {
        project(rec, c, part(0), &src.io(&sc.wide_a, t, cd), src, &s)?;
        project(rec, c, part(1), &src.io(&sc.mid_a, t, vd), src, &s)?;
        project(rec, c, part(2), &src.io(&sc.beta, t, hv), src, &s)?;
        project(rec, c, part(3), &src.io(&sc.decay, t, hv), src, &s)?;
        let io = GdnIo {
            mixed: &sc.wide_a,
            conv_y: &sc.wide_b,
            conv_in: conv[0],
            conv_out: conv[1],
            b: &sc.beta,
            a: &sc.decay,
            core: &sc.mid_b,
            state_in: state[0],
            state_out: state[1],
            splits,
        };
        gated_delta_norm(rec, c, w, (&params, &io), &sc.mid_a, t)?;
    }
    mixer_out(rec, c, sc, (&w.out_proj, Proj::OutProj), lora, t, (None, next))
}

/// The unfused GDN core of `t` tokens: conv and delta rule into `io.core`, then the gated norm
/// of `io.core` in place with the gate `z` (both from element 0).
pub(crate) fn gated_delta_norm(
    rec: &mut Recorder,
    c: &TextConfig,
    w: &GdnWeights,
    (params, io): (&GdnParams, &GdnIo),
    z: &wgpu::Buffer,
    t: usize,
) -> Result<(), GpuError> {
    gated_delta(rec, &w.conv_w, &w.gate_p, params, io)?;
    let norm = NormIo {
        x: z,
        y: io.core,
        x_offset: 0,
        y_offset: 0,
        rows: t * c.linear_value_heads,
        n: c.linear_value_dim,
        eps: c.rms_norm_eps,
    };
    rms_norm_gated(rec, &w.norm, &norm)
}

/// The GDN kernels' parameters for `t` tokens.
pub(crate) fn gdn_params(c: &TextConfig, t: usize) -> GdnParams {
    GdnParams {
        t: t as u32,
        c: c.conv_dim() as u32,
        k: c.conv_kernel as u32,
        hk: c.linear_key_heads as u32,
        hv: c.linear_value_heads as u32,
        dk: c.linear_key_dim as u32,
        dv: c.linear_value_dim as u32,
        eps: c.rms_norm_eps,
        ..Default::default()
    }
}

/// Whether one token of a GDN layer runs as one `gdn_decode` dispatch.
pub(crate) fn gdn_step_fits(c: &TextConfig) -> bool {
    c.linear_key_dim.max(c.linear_value_dim) <= GDN_STEP_MAX_D
}

/// The attention kernels' parameters: `t` tokens from position `pos0` in a cache of `s_max`, k
/// and v at those offsets of their rows.
pub(crate) fn attn_params(
    c: &TextConfig,
    (t, pos0, s_max): (usize, usize, usize),
    (k_offset, v_offset): (usize, usize),
) -> AttnParams {
    let hd = c.head_dim;
    AttnParams {
        t: t as u32,
        pos0: pos0 as u32,
        hq: c.num_heads as u32,
        hkv: c.num_kv_heads as u32,
        hd: hd as u32,
        rot_half: (c.rotary_dim / 2) as u32,
        s_max: s_max as u32,
        eps: c.rms_norm_eps,
        scale: (hd as f32).powf(-0.5),
        k_offset: k_offset as u32,
        v_offset: v_offset as u32,
        lora_rank: 0,
        ..AttnParams::default()
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_block(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &AttnWeights,
    cache: (&wgpu::Buffer, &wgpu::Buffer),
    rope: &wgpu::Buffer,
    pos0: usize,
    s_max: usize,
    (src, s): (Src, Option<Shrunk>),
    (lora, next): (Option<LayerLora>, NextWrites),
    (t, one): (usize, bool),
) -> Result<(), GpuError> {
    let (hq, hkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let (q_out, kv) = (2 * hq * hd, hkv * hd);
    let part = |parts| Parts { w: &w.qkv, order: &ATTN_IN, parts };
    if one {
        // One token: q|gate, k and v in one dispatch, read in place by one attention dispatch
        // (which also shrinks o_proj's input when it can).
        project(rec, c, part(0..3), &src.io(&sc.mixer_in, 1, q_out + 2 * kv), src, &s)?;
        let params = attn_params(c, (1, pos0, s_max), (q_out, q_out + kv));
        let io = AttnOneIo {
            qkv: &sc.mixer_in,
            k_cache: cache.0,
            v_cache: cache.1,
            rope,
            out: &sc.mid_b,
            part: &sc.attn_part,
        };
        let split = head_split(lora, &sc.mid_b, (hq * hd, hq), (1, &w.o_proj));
        attention_one(rec, &w.qk_norm, &params, &io, split.as_ref().map(|s| s.shrink))?;
        return mixer_out(rec, c, sc, (&w.o_proj, Proj::OProj), lora, t, (split.map(|s| s.shrunk), next));
    }
    project(rec, c, part(0..1), &src.io(&sc.wide_a, t, q_out), src, &s)?;
    project(rec, c, part(1..2), &src.io(&sc.mid_a, t, kv), src, &s)?;
    project(rec, c, part(2..3), &src.io(&sc.mid_c, t, kv), src, &s)?;
    let params = attn_params(c, (t, pos0, s_max), (0, 0));
    let io = AttnIo {
        qg: &sc.wide_a,
        kraw: &sc.mid_a,
        vraw: &sc.mid_c,
        q: &sc.wide_b,
        k_cache: cache.0,
        v_cache: cache.1,
        rope,
        out: &sc.mid_b,
    };
    attention(rec, &w.q_norm, &w.k_norm, &params, &io)?;
    mixer_out(rec, c, sc, (&w.o_proj, Proj::OProj), lora, t, (None, next))
}

/// A token mixer's output projection (`out_proj` / `o_proj`, with its LoRA) from `mid_b`, added
/// into the residual stream of `t` rows; its shrink is a dispatch of its own unless the mixer
/// wrote it split by head (`split`: [`head_split`]). With `next` it also writes the
/// MLP's input shrink and prenormed input ([`residual_out`]).
pub(crate) fn mixer_out(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    (w, proj): (&GpuWeight, Proj),
    lora: Option<LayerLora>,
    t: usize,
    (split, next): (Option<Shrunk>, NextWrites),
) -> Result<(), GpuError> {
    let out = LinearIo { accumulate: true, ..lin(&sc.mid_b, &sc.hidden, t, c.hidden_size) };
    let mid = Src::plain(&sc.mid_b);
    let s = match split {
        Some(s) => Some(s),
        None => shrink(rec, lora, InputGroup::MixerOut, mid, t)?,
    };
    let src = Src { fuse: Fuse { shrink_out: next.shrink_out, norm_out: next.norm_out, ..Fuse::NONE }, ..mid };
    project(rec, c, Parts { w, order: &[proj], parts: 0..1 }, &out, src, &s)
}

/// The MLP. A single token, and 2 to 8 tokens of a weight the batched matvec takes, run gate|up
/// in one dispatch that applies SwiGLU as it stores (when the weight is in one binding). With
/// `next` down_proj also writes the next layer's input shrink and prenormed input
/// ([`residual_out`]).
pub(crate) fn mlp_block(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &Mlp,
    (src, s): (Src, Option<Shrunk>),
    (lora, next): (Option<LayerLora>, NextWrites),
    t: usize,
) -> Result<(), GpuError> {
    let i = c.intermediate_size;
    let part = |parts| Parts { w: &w.gate_up, order: &MLP_IN, parts };
    let both = part(0..2);
    let gate_up = both.rows(c);
    let mut split = None;
    if t == 1 && gate_up.in_one_chunk() {
        // down_proj's shrink, written by the SwiGLU dispatch.
        split = split_out(rec.ctx(), lora, (InputGroup::MlpOut, None), (2 * i, true), &sc.mlp_g);
        let shrink_out = split.as_ref().map(|(out, _)| *out);
        let glu = Src { fuse: Fuse { glu: true, shrink_out, ..src.fuse }, ..src };
        project(rec, c, part(0..2), &src.io(&sc.mlp_g, t, i), glu, &s)?;
    } else if batched_matvec_takes(&gate_up, t, src.offset) && gate_up.in_one_chunk() {
        let glu = Src { fuse: Fuse { glu: true, ..src.fuse }, ..src };
        project(rec, c, part(0..2), &src.io(&sc.mlp_g, t, i), glu, &s)?;
    } else {
        project(rec, c, part(0..1), &src.io(&sc.mlp_g, t, i), src, &s)?;
        project(rec, c, part(1..2), &src.io(&sc.mlp_u, t, i), src, &s)?;
        swiglu(rec, &sc.mlp_g, &sc.mlp_u, t * i)?;
    }
    let act = Src::plain(&sc.mlp_g);
    let out = LinearIo { accumulate: true, ..lin(&sc.mlp_g, &sc.hidden, t, c.hidden_size) };
    let s = match split {
        Some((_, shrunk)) => Some(shrunk),
        None => shrink(rec, lora, InputGroup::MlpOut, act, t)?,
    };
    let src = Src { fuse: Fuse { shrink_out: next.shrink_out, norm_out: next.norm_out, ..Fuse::NONE }, ..act };
    project(rec, c, Parts { w: &w.down_proj, order: &[Proj::DownProj], parts: 0..1 }, &out, src, &s)
}

pub(crate) fn norm_rows<'a>(sc: &'a Scratch, c: &TextConfig, r0: usize, rows: usize) -> NormIo<'a> {
    NormIo {
        x: &sc.hidden,
        y: &sc.xnorm,
        x_offset: r0 * c.hidden_size,
        y_offset: r0 * c.hidden_size,
        rows,
        n: c.hidden_size,
        eps: c.rms_norm_eps,
    }
}

/// lm_head's input: the residual rows through the final norm, folded into lm_head (`fold`; from
/// the prenormed row the last residual projection wrote, if it wrote one) or normed by a
/// dispatch of their own into `xnorm` (rows `r0..r0 + n`).
pub(crate) fn head_input<'a>(
    rec: &mut Recorder,
    model: &'a Model,
    sc: &'a Scratch,
    (fold, prenormed): (bool, Option<(usize, SplitShrink)>),
    (r0, n): (usize, usize),
) -> Result<Src<'a>, GpuError> {
    let c = &model.config;
    if fold {
        return Ok(Src::normed(&sc.hidden, &model.norm.buffer, c.rms_norm_eps, prenormed));
    }
    rms_norm(rec, &model.norm, &norm_rows(sc, c, r0, n))?;
    Ok(Src::plain(&sc.xnorm))
}

pub(crate) fn lm_head(
    rec: &mut Recorder,
    model: &Model,
    src: Src,
    logits: &wgpu::Buffer,
    r0: usize,
    rows: usize,
) -> Result<(), GpuError> {
    let c = &model.config;
    let io = LinearIo {
        x: src.x,
        x_offset: src.offset + r0 * c.hidden_size,
        m: rows,
        y: logits,
        y_offset: 0,
        y_stride: c.vocab_size,
        accumulate: false,
    };
    linear_with(rec, model.output(), &io, None, src.fuse)
}
