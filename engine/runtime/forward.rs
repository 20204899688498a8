//! The layer loop: records one step (up to `max_batch` tokens) into one command buffer.
//!
//! Scratch use per block (see `cache.rs` for the buffers):
//! * GDN: xnorm → in_proj_qkv → wide_a → conv → wide_b → delta rule (+ beta, decay) → mid_b,
//!   gated norm with z (mid_a) → out_proj added into hidden; one token: the four input
//!   projections in one dispatch → mixer_in, then one dispatch (conv, rule, gated norm) → mid_b;
//! * attention: xnorm → q_proj → wide_a, k_proj → mid_a, v_proj → mid_c → norm/RoPE → wide_b and
//!   the KV cache → attention → mid_b → o_proj added into hidden; one token (not captured for
//!   learning): q|k|v in one dispatch → mixer_in;
//! * MLP: xnorm → gate → mlp_g, up → mlp_u → SwiGLU → down added into hidden; one token: gate|up
//!   with SwiGLU in one dispatch → mlp_g.
//!
//! The projections that read one input are one weight (rows concatenated, `weights.rs`); a
//! multi-token step runs each projection's row range into its own buffer.

use crate::error::{GpuError, RunError};
use crate::gpu::{Dtype, GpuContext, GpuWeight, Recorder};
use crate::kernels::attention::{attention, attention_one, AttnIo, AttnOneIo, AttnParams};
use crate::kernels::gdn::{gated_delta, gdn_step, GdnIo, GdnParams, GdnStepIo, HeadShrink, GDN_STEP_MAX_D};
use crate::kernels::matmul::{
    linear_rows, linear_with, Fuse, FusedNorm, LinearIo, LoraExpand, LoraSegment, SplitShrink, WeightRows,
    SPLIT_SHRINK_MAX_RANK,
};
use crate::kernels::misc::{argmax, embed, swiglu, topk, topk_blocks, topk_mass_offset, TopkIo};
use crate::kernels::norm::{rms_norm, rms_norm_gated, NormIo};
use crate::lora::{InputGroup, LoraGroup, Proj};
use crate::model::{AttnWeights, GdnWeights, Mixer, Mlp, Model, TextConfig};
use crate::runtime::adapters::BoundSet;
use crate::runtime::cache::{LayerState, Scratch};
use crate::runtime::session::{Logits, Session};

pub(crate) struct StepOutput {
    pub logits: Logits,
    pub hidden: Option<Vec<f32>>,
    /// The submission of the step's layers (a greedy choice is ready when it completes).
    pub index: wgpu::SubmissionIndex,
}

/// A step's tokens.
#[derive(Clone, Copy)]
pub(crate) enum Input<'a> {
    /// Ids from the host.
    Ids(&'a [u32]),
    /// The one id an earlier step's greedy choice left in the session's id buffer.
    Chosen,
}

/// The active adapter as one layer's step sees it.
#[derive(Clone, Copy)]
pub(crate) struct LayerLora<'a> {
    pub(crate) bound: &'a BoundSet,
    pub(crate) t: &'a wgpu::Buffer,
    pub(crate) layer: usize,
}

/// The shrink of one input group (`t = x·A_catᵀ`), when the adapter covers it: in t's buffer,
/// or split by head after the token mixer's output row (`parts`).
pub(crate) struct Shrunk<'a> {
    lora: LayerLora<'a>,
    group: &'a LoraGroup,
    parts: Option<SplitShrink>,
}

impl<'a> LayerLora<'a> {
    fn shrink(self, rec: &mut Recorder, group: InputGroup, src: Src, m: usize) -> Result<Option<Shrunk<'a>>, GpuError> {
        let Some(g) = self.bound.lora.group(self.layer, group) else {
            return Ok(None);
        };
        rec.tagged("lora_shrink", |rec| linear_with(rec, &g.a, &lin(src.x, self.t, m, g.rank_total), None, src.fuse))?;
        Ok(Some(Shrunk { lora: self, group: g, parts: None }))
    }
}

/// out_proj's / o_proj's shrink split by head: what the mixer's decode kernel takes to write the
/// parts (`shrink`) and what the projection's expand reads (`shrunk`, with its parts).
pub(crate) struct HeadSplit<'a> {
    pub(crate) shrink: HeadShrink<'a>,
    pub(crate) shrunk: Shrunk<'a>,
}

/// The split shrink of the mixer output: the mixer's decode kernel writes `heads` parts after
/// its output row of `row` elements in `out`, and the projection sums them (no shrink dispatch).
/// None when the adapter does not cover the group or the split does not apply (A in more than
/// one binding, a rank above the matvec's, unaligned rows, `out` too small): the group then
/// takes the shrink dispatch.
pub(crate) fn head_split<'a>(
    lora: Option<LayerLora<'a>>,
    out: &wgpu::Buffer,
    (row, heads): (usize, usize),
) -> Option<HeadSplit<'a>> {
    let l = lora?;
    let g = l.bound.lora.group(l.layer, InputGroup::MixerOut)?;
    let [chunk] = g.a.chunks.as_slice() else {
        return None;
    };
    let rank_pad = g.rank_total.next_multiple_of(4);
    let fits = chunk.dtype == Dtype::F32
        && g.rank_total <= SPLIT_SHRINK_MAX_RANK
        && row.is_multiple_of(4)
        && (row / heads).is_multiple_of(4)
        && g.a.cols == row
        && ((row + heads * rank_pad) * 4) as u64 <= out.size();
    fits.then_some(HeadSplit {
        shrink: HeadShrink { a: &chunk.bind_group, rank: g.rank_total },
        shrunk: Shrunk { lora: l, group: g, parts: Some(SplitShrink { count: heads, at: row }) },
    })
}

/// The input of a block's projections: a buffer and what to do to it first (single-token steps
/// fold the block's RMSNorm or the SwiGLU product into the projections that read it).
#[derive(Clone, Copy)]
pub(crate) struct Src<'a> {
    pub(crate) x: &'a wgpu::Buffer,
    pub(crate) fuse: Fuse<'a>,
}

impl<'a> Src<'a> {
    pub(crate) fn plain(x: &'a wgpu::Buffer) -> Self {
        Self { x, fuse: Fuse::NONE }
    }

    /// `x` through the block norm `weight` (fused into the projections that read it).
    fn normed(x: &'a wgpu::Buffer, weight: &'a wgpu::Buffer, eps: f32) -> Self {
        Self { x, fuse: Fuse { norm: Some(FusedNorm { weight, eps }), glu: false } }
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
    fn rows(&self, c: &TextConfig) -> WeightRows<'_> {
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
fn gdn_block(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &GdnWeights,
    conv: [&wgpu::Buffer; 2],
    state: [&wgpu::Buffer; 2],
    src: Src,
    lora: Option<LayerLora>,
    t: usize,
) -> Result<(), GpuError> {
    let (cd, vd, hv) = (c.conv_dim(), c.value_dim(), c.linear_value_heads);
    let s = shrink(rec, lora, InputGroup::MixerIn, src, t)?;
    let part = |i: usize| Parts { w: &w.in_proj, order: &GDN_IN, parts: i..i + 1 };
    let params = gdn_params(c, t);
    let fused = t == 1 && gdn_step_fits(c);
    if fused {
        // One token: one dispatch for the four projections, one for conv, rule and gated norm.
        let all = Parts { w: &w.in_proj, order: &GDN_IN, parts: 0..4 };
        project(rec, c, all, &lin(src.x, &sc.mixer_in, 1, cd + vd + 2 * hv), src, &s)?;
        let io = GdnStepIo {
            mixed: &sc.mixer_in,
            conv_in: conv[0],
            conv_out: conv[1],
            state_in: state[0],
            state_out: state[1],
            core: &sc.mid_b,
        };
        let split = head_split(lora, &sc.mid_b, (vd, hv));
        gdn_step(rec, &w.step_params, &params, &io, split.as_ref().map(|s| s.shrink))?;
        return mixer_out(rec, c, sc, &w.out_proj, Proj::OutProj, lora, t, split.map(|s| s.shrunk));
    } else {
        project(rec, c, part(0), &lin(src.x, &sc.wide_a, t, cd), src, &s)?;
        project(rec, c, part(1), &lin(src.x, &sc.mid_a, t, vd), src, &s)?;
        project(rec, c, part(2), &lin(src.x, &sc.beta, t, hv), src, &s)?;
        project(rec, c, part(3), &lin(src.x, &sc.decay, t, hv), src, &s)?;
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
        };
        gated_delta(rec, &w.conv_w, &w.gate_p, &params, &io)?;
        let norm = NormIo {
            x: &sc.mid_a,
            y: &sc.mid_b,
            x_offset: 0,
            y_offset: 0,
            rows: t * hv,
            n: c.linear_value_dim,
            eps: c.rms_norm_eps,
        };
        rms_norm_gated(rec, &w.norm, &norm)?;
    }
    mixer_out(rec, c, sc, &w.out_proj, Proj::OutProj, lora, t, None)
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
    }
}

#[allow(clippy::too_many_arguments)]
fn attention_block(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &AttnWeights,
    cache: (&wgpu::Buffer, &wgpu::Buffer),
    rope: &wgpu::Buffer,
    pos0: usize,
    s_max: usize,
    src: Src,
    lora: Option<LayerLora>,
    (t, one): (usize, bool),
) -> Result<(), GpuError> {
    let (hq, hkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let (q_out, kv) = (2 * hq * hd, hkv * hd);
    let s = shrink(rec, lora, InputGroup::MixerIn, src, t)?;
    let part = |parts| Parts { w: &w.qkv, order: &ATTN_IN, parts };
    if one {
        // One token: q|gate, k and v in one dispatch, read in place by one attention dispatch
        // (which also shrinks o_proj's input when it can).
        project(rec, c, part(0..3), &lin(src.x, &sc.mixer_in, 1, q_out + 2 * kv), src, &s)?;
        let params = attn_params(c, (1, pos0, s_max), (q_out, q_out + kv));
        let io = AttnOneIo { qkv: &sc.mixer_in, k_cache: cache.0, v_cache: cache.1, rope, out: &sc.mid_b };
        let split = head_split(lora, &sc.mid_b, (hq * hd, hq));
        attention_one(rec, &w.qk_norm, &params, &io, split.as_ref().map(|s| s.shrink))?;
        return mixer_out(rec, c, sc, &w.o_proj, Proj::OProj, lora, t, split.map(|s| s.shrunk));
    }
    project(rec, c, part(0..1), &lin(src.x, &sc.wide_a, t, q_out), src, &s)?;
    project(rec, c, part(1..2), &lin(src.x, &sc.mid_a, t, kv), src, &s)?;
    project(rec, c, part(2..3), &lin(src.x, &sc.mid_c, t, kv), src, &s)?;
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
    mixer_out(rec, c, sc, &w.o_proj, Proj::OProj, lora, t, None)
}

/// A token mixer's output projection (`out_proj` / `o_proj`, with its LoRA) from `mid_b`, added
/// into the residual stream of `t` rows; its shrink is a dispatch of its own unless the mixer
/// wrote it split by head (`split`, one token: [`head_split`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn mixer_out(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &GpuWeight,
    proj: Proj,
    lora: Option<LayerLora>,
    t: usize,
    split: Option<Shrunk>,
) -> Result<(), GpuError> {
    let out = LinearIo { accumulate: true, ..lin(&sc.mid_b, &sc.hidden, t, c.hidden_size) };
    let mid = Src::plain(&sc.mid_b);
    let s = match split {
        Some(s) => Some(s),
        None => shrink(rec, lora, InputGroup::MixerOut, mid, t)?,
    };
    project(rec, c, Parts { w, order: &[proj], parts: 0..1 }, &out, mid, &s)
}

/// The MLP. A single token runs gate|up in one dispatch that applies SwiGLU as it stores (when
/// the weight is in one binding).
pub(crate) fn mlp_block(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &Mlp,
    src: Src,
    lora: Option<LayerLora>,
    t: usize,
) -> Result<(), GpuError> {
    let i = c.intermediate_size;
    let s = shrink(rec, lora, InputGroup::MlpIn, src, t)?;
    let part = |parts| Parts { w: &w.gate_up, order: &MLP_IN, parts };
    if t == 1 && part(0..2).rows(c).in_one_chunk() {
        let glu = Src { fuse: Fuse { glu: true, ..src.fuse }, ..src };
        project(rec, c, part(0..2), &lin(src.x, &sc.mlp_g, t, i), glu, &s)?;
    } else {
        project(rec, c, part(0..1), &lin(src.x, &sc.mlp_g, t, i), src, &s)?;
        project(rec, c, part(1..2), &lin(src.x, &sc.mlp_u, t, i), src, &s)?;
        swiglu(rec, &sc.mlp_g, &sc.mlp_u, t * i)?;
    }
    let act = Src::plain(&sc.mlp_g);
    let out = LinearIo { accumulate: true, ..lin(&sc.mlp_g, &sc.hidden, t, c.hidden_size) };
    let s = shrink(rec, lora, InputGroup::MlpOut, act, t)?;
    project(rec, c, Parts { w: &w.down_proj, order: &[Proj::DownProj], parts: 0..1 }, &out, act, &s)
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
        x_offset: r0 * c.hidden_size,
        m: rows,
        y: logits,
        y_offset: 0,
        y_stride: c.vocab_size,
        accumulate: false,
    };
    linear_with(rec, model.output(), &io, None, src.fuse)
}

fn capture_slot(rec: &mut Recorder, sc: &Scratch, dst: Option<&wgpu::Buffer>, slot: usize, bytes: u64) {
    if let Some(dst) = dst {
        rec.copy(&sc.hidden, 0, dst, slot as u64 * bytes, bytes);
    }
}

/// What a step copies out of the residual stream besides its result.
#[derive(Clone, Copy)]
pub(crate) enum Capture<'a> {
    /// Nothing.
    None,
    /// The residual stream after the embedding and after every layer (`[L+1, T, H]`).
    Layers,
    /// What a learning step differentiates, from the attention layer `layer` (see [`LearnTaps`]),
    /// with rows `row0..row0 + rows` of the residual stream entering its MLP.
    Learn { layer: usize, row0: usize, rows: usize, taps: LearnTaps<'a> },
}

/// Where a learning step's forward copies what the backward reads, each from element 0 and for
/// every row of the step unless said otherwise (`T` rows).
#[derive(Clone, Copy)]
pub(crate) struct LearnTaps<'a> {
    /// The layer's normalised mixer input `[T, H]`.
    pub mixer_in: &'a wgpu::Buffer,
    /// Rows `row0..row0 + rows` of the residual entering the layer's MLP `[rows, H]`.
    pub mlp_in: &'a wgpu::Buffer,
    /// q_proj's output (query and gate per head) `[T, 2·Hq·hd]`.
    pub qg: &'a wgpu::Buffer,
    /// The normed, rotated queries `[T, Hq·hd]`.
    pub q: &'a wgpu::Buffer,
    /// k_proj's output `[T, Hkv·hd]`.
    pub kraw: &'a wgpu::Buffer,
    /// The gated attention output (o_proj's input) `[T, Hq·hd]`.
    pub attn_out: &'a wgpu::Buffer,
    /// The residual after the last layer `[T, H]`.
    pub hidden: &'a wgpu::Buffer,
    /// The final norm's output `[T, H]`.
    pub final_norm: &'a wgpu::Buffer,
}

/// Which positions of a step get the final norm and lm_head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Rows {
    /// The last position: logits for sampling.
    Last,
    /// Every position's logits.
    All,
    /// Every position's final-norm hidden state, no logits.
    Hidden,
    /// The last position's greedy choice, made on the GPU: the id goes into the session's id
    /// buffer (the next step's input) and into its choice staging slot; nothing is read back here.
    Choose {
        /// The staging slot (of two) the id is copied into.
        slot: usize,
    },
    /// The last position's sampling candidates, found on the GPU: the `k` best logits outside
    /// the `hist` history ids the session uploaded, and the history's own logits, copied into the
    /// session's candidate staging; nothing is read back here.
    Sample {
        /// Candidates.
        k: usize,
        /// Distinct history ids.
        hist: usize,
        /// For sampling without top-k: the inverse temperature at which the candidate pass's
        /// blocks' softmax masses are copied out after the flag.
        mass: Option<f32>,
    },
}

/// Record and submit one step of `input` (at most `max_batch` tokens) at the session's position.
/// The GDN layers read the state pair at the session's parity and write the other one: the step
/// takes effect when the caller commits it ([`Session::commit`]).
pub(crate) fn step(s: &mut Session, input: Input, rows: Rows, capture: Capture) -> Result<StepOutput, RunError> {
    let model = s.model.clone();
    let ctx: &GpuContext = &model.ctx;
    let c = &model.config;
    let t = match input {
        Input::Ids(ids) => {
            ctx.write(&s.ids, 0, bytemuck::cast_slice(ids));
            ids.len()
        }
        Input::Chosen => 1,
    };
    let h = c.hidden_size;
    let (from, to) = (s.parity, 1 - s.parity);
    let slot_bytes = (t * h * 4) as u64;
    let row = (h * 4) as u64;
    let captured = if matches!(capture, Capture::Layers) {
        Some(ctx.storage_buffer("hidden capture", slot_bytes * (c.num_layers() as u64 + 1), false)?)
    } else {
        None
    };
    let last = matches!(rows, Rows::Last | Rows::Choose { .. } | Rows::Sample { .. });
    let (r0, n) = if last { (t - 1, 1) } else { (0, t) };
    let first_rows = if rows == Rows::Hidden { 0 } else { n.min(s.logits_rows) };
    // One token whose normalised rows nobody reads back: the norms and the SwiGLU product go into
    // the prologues of the projections that read them (no dispatch of their own).
    let fold = s.fused && t == 1 && rows != Rows::Hidden && !matches!(capture, Capture::Learn { .. });
    // One token not captured for learning: attention runs q|k|v in one dispatch, read in place.
    let one = t == 1 && !matches!(capture, Capture::Learn { .. });
    let eps = c.rms_norm_eps;
    let index = {
        let sc = &s.scratch;
        let mut rec = Recorder::new(ctx, &mut s.io).profiled(s.profile.as_mut());
        embed(&mut rec, &model.embed, &s.ids, t, &sc.hidden)?;
        capture_slot(&mut rec, sc, captured.as_ref(), 0, slot_bytes);
        let active = s.lora.bound.as_ref().zip(s.lora.t.as_ref());
        for (i, layer) in model.layers.iter().enumerate() {
            let lora = active.map(|(bound, (t, _))| LayerLora { bound, t, layer: i });
            let mixer_src = if fold {
                Src::normed(&sc.hidden, &layer.input_norm.buffer, eps)
            } else {
                rms_norm(&mut rec, &layer.input_norm, &norm_rows(sc, c, 0, t))?;
                Src::plain(&sc.xnorm)
            };
            if let Capture::Learn { layer, taps, .. } = capture {
                if layer == i {
                    rec.copy(&sc.xnorm, 0, taps.mixer_in, 0, t as u64 * row);
                }
            }
            match (&layer.mixer, &s.states[i]) {
                (Mixer::Gdn(w), LayerState::Gdn { conv, state }) => {
                    let (conv, state) = ([&conv[from], &conv[to]], [&state[from], &state[to]]);
                    gdn_block(&mut rec, c, sc, w, conv, state, mixer_src, lora, t)?
                }
                (Mixer::Attention(w), LayerState::Attention { k, v }) => {
                    let cache = (k, v);
                    let rope = &s.rope;
                    attention_block(
                        &mut rec,
                        c,
                        sc,
                        w,
                        cache,
                        rope,
                        s.pos,
                        s.opts.max_context,
                        mixer_src,
                        lora,
                        (t, one),
                    )?
                }
                _ => {
                    return Err(RunError::Gpu(GpuError::Validation {
                        during: format!("layer {i}"),
                        message: "layer state does not match the layer type".into(),
                    }))
                }
            }
            if let Capture::Learn { layer, row0, rows, taps } = capture {
                if layer == i {
                    // The attention block's activations (its single-token path is not taken when
                    // learning, so they are in the per-projection buffers).
                    let (attn, kv) = ((c.num_heads * c.head_dim * 4) as u64, (c.num_kv_heads * c.head_dim * 4) as u64);
                    let tt = t as u64;
                    rec.copy(&sc.wide_a, 0, taps.qg, 0, tt * 2 * attn);
                    rec.copy(&sc.wide_b, 0, taps.q, 0, tt * attn);
                    rec.copy(&sc.mid_a, 0, taps.kraw, 0, tt * kv);
                    rec.copy(&sc.mid_b, 0, taps.attn_out, 0, tt * attn);
                    rec.copy(&sc.hidden, row0 as u64 * row, taps.mlp_in, 0, rows as u64 * row);
                }
            }
            let mlp_src = if fold {
                Src::normed(&sc.hidden, &layer.post_norm.buffer, eps)
            } else {
                rms_norm(&mut rec, &layer.post_norm, &norm_rows(sc, c, 0, t))?;
                Src::plain(&sc.xnorm)
            };
            mlp_block(&mut rec, c, sc, &layer.mlp, mlp_src, lora, t)?;
            capture_slot(&mut rec, sc, captured.as_ref(), i + 1, slot_bytes);
        }
        let head_src = if fold {
            Src::normed(&sc.hidden, &model.norm.buffer, eps)
        } else {
            rms_norm(&mut rec, &model.norm, &norm_rows(sc, c, r0, n))?;
            Src::plain(&sc.xnorm)
        };
        if let Capture::Learn { taps, .. } = capture {
            rec.copy(&sc.hidden, 0, taps.hidden, 0, t as u64 * row);
            rec.copy(&sc.xnorm, 0, taps.final_norm, 0, t as u64 * row);
        }
        if first_rows > 0 {
            lm_head(&mut rec, &model, head_src, &s.logits, r0, first_rows)?;
        }
        if let Rows::Choose { slot } = rows {
            // The id and the row's non-finite flag.
            argmax(&mut rec, &s.logits, &s.parts, &s.ids, c.vocab_size)?;
            rec.copy(&s.ids, 0, s.chosen[slot].buffer(), 0, 8);
        }
        if let Rows::Sample { k, hist, mass } = rows {
            let b = &s.sample;
            // The row's non-finite flag, before the mask overwrites the history's logits (with
            // the lowest key, a NaN pattern); the argmax's id is not used.
            argmax(&mut rec, &s.logits, &s.parts, &b.flag, c.vocab_size)?;
            let flag_at = (k * 8 + hist * 4) as u64;
            rec.copy(&b.flag, 4, b.staging.buffer(), flag_at, 4);
            let io = TopkIo {
                logits: &s.logits,
                parts: &b.parts,
                out: &b.out,
                hist_ids: &b.hist_ids,
                hist_out: &b.hist_out,
            };
            topk(&mut rec, &io, c.vocab_size, k, hist, mass.unwrap_or(0.0))?;
            let pairs = (k * 8) as u64;
            rec.copy(&b.out, 0, b.staging.buffer(), 0, pairs);
            if hist > 0 {
                rec.copy(&b.hist_out, 0, b.staging.buffer(), pairs, (hist * 4) as u64);
            }
            if mass.is_some() {
                let bytes = (topk_blocks(c.vocab_size) * 8) as u64;
                rec.copy(&b.parts, topk_mass_offset(c.vocab_size, k), b.staging.buffer(), flag_at + 4, bytes);
            }
        }
        let index = rec.submit()?;
        if let Rows::Choose { .. } | Rows::Sample { .. } = rows {
            let logits = Logits { rows: 0, vocab: c.vocab_size, data: Vec::new() };
            return Ok(StepOutput { logits, hidden: None, index });
        }
        index
    };
    let mut data = s.read_logits(first_rows)?;
    let mut done = first_rows;
    while done < n && rows != Rows::Hidden {
        let rows = (n - done).min(s.logits_rows);
        let mut rec = Recorder::new(ctx, &mut s.io).profiled(s.profile.as_mut());
        lm_head(&mut rec, &model, Src::plain(&s.scratch.xnorm), &s.logits, r0 + done, rows)?;
        rec.submit()?;
        data.extend(s.read_logits(rows)?);
        done += rows;
    }
    let hidden = match &captured {
        Some(buf) => Some(crate::gpu::read_f32(ctx, buf, 0, (c.num_layers() + 1) * t * h)?),
        None => None,
    };
    Ok(StepOutput { logits: Logits { rows: done, vocab: c.vocab_size, data }, hidden, index })
}
