//! The backward and optimiser kernels of on-GPU learning: `ce_grad.wgsl`, `matmul_dx.wgsl`,
//! `lora_grad.wgsl`, `backward.wgsl` and `adamw.wgsl`.

use std::ops::Range;

use crate::error::GpuError;
use crate::gpu::{grid_1d, GpuVector, GpuWeight, Recorder};
use crate::kernels::{Kernel, PipelineKey};
use crate::model::Dtype;

/// Mirrors `Params` in `ce_grad.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct CeParams {
    v: u32,
    rows: u32,
    _pad: [u32; 2],
}

/// Record the cross-entropy of `rows` logit rows (`[rows, vocab]`) against the targets in
/// `rowinfo` (`[rows, 2]` u32: target id, coefficient as f32 bits): `loss` gets each row's CE and
/// the logits are replaced by `coef · (softmax − onehot)`.
pub fn ce_grad(
    rec: &mut Recorder,
    logits: &wgpu::Buffer,
    rowinfo: &wgpu::Buffer,
    loss: &wgpu::Buffer,
    rows: usize,
    vocab: usize,
) -> Result<(), GpuError> {
    let params = CeParams { v: vocab as u32, rows: rows as u32, _pad: [0; 2] };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    rec.dispatch(PipelineKey::plain(Kernel::CeGrad), &params, &[logits, rowinfo, loss], &[], grid_1d(rows as u32, max))
}

/// Mirrors `Params` in `matmul_dx.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct DxParams {
    m: u32,
    n: u32,
    k: u32,
    dy_offset: u32,
    dy_stride: u32,
    dx_offset: u32,
    dx_stride: u32,
    w_row: u32,
    scale: f32,
    q_sb: u32,
    n_span: u32,
    slice_stride: u32,
}

/// Where `dx = dy · W` reads and writes.
pub struct DxIo<'a> {
    /// Output gradient `[m, *]`; the first weight row used pairs with column `dy_offset % dy_stride`.
    pub dy: &'a wgpu::Buffer,
    /// First element of dy.
    pub dy_offset: usize,
    /// Row stride of dy.
    pub dy_stride: usize,
    /// Tokens.
    pub m: usize,
    /// Input gradient `[m, dx_stride]`.
    pub dx: &'a wgpu::Buffer,
    /// First element of dx.
    pub dx_offset: usize,
    /// Row stride of dx.
    pub dx_stride: usize,
    /// Multiplies the product (a LoRA scaling).
    pub scale: f32,
    /// Add into dx instead of overwriting it.
    pub accumulate: bool,
    /// Scratch for the partial products of a split reduction ([`dx_slices`]), with its size in
    /// floats ([`matmul_dx_scratch`] gives what a weight needs); `None` or too small: unsplit.
    pub slices: Option<(&'a wgpu::Buffer, usize)>,
}

/// Outputs `n` a slice of a split [`matmul_dx`] reduces at least: 8 of its 16-deep steps, so the
/// slices' extra writes and their sum stay small against the reduction.
pub const DX_MIN_SPAN: usize = 128;

/// Rows of `n` each slice of a `matmul_dx` over `m` tokens, `k` inputs and `n` outputs reduces,
/// so that its grid of 64 × 64 tiles times slices gives the device `min_groups` workgroups: `n`
/// (one slice) where the tiles alone do or `n` is too short to split. A multiple of 16 otherwise.
pub fn dx_span(m: usize, n: usize, k: usize, min_groups: usize) -> usize {
    let tiles = k.div_ceil(64) * m.div_ceil(64);
    let slices = min_groups.div_ceil(tiles.max(1)).min(n / DX_MIN_SPAN);
    if slices < 2 {
        return n;
    }
    n.div_ceil(slices).next_multiple_of(16)
}

/// Slices of a `matmul_dx` over `n` outputs split into spans of `span`.
pub fn dx_slices(n: usize, span: usize) -> usize {
    n.div_ceil(span.max(1))
}

/// Floats of scratch [`matmul_dx`] splits its reduction into for any token count up to `max_m`
/// over `rows` of `w`, on a device that wants `min_groups` workgroups (0 where it never splits).
pub fn matmul_dx_scratch(w: &[DxWeight], rows: Range<usize>, max_m: usize, min_groups: usize) -> usize {
    (1..=max_m).map(|m| split_plan(w, rows.clone(), m, min_groups).map_or(0, |p| p.floats)).max().unwrap_or(0)
}

/// The slices of each chunk of a split `matmul_dx` (chunks outside `rows` take none).
struct SplitPlan {
    spans: Vec<usize>,
    floats: usize,
}

/// How `matmul_dx` splits over `m` tokens, or `None` where no chunk's reduction splits.
fn split_plan(w: &[DxWeight], rows: Range<usize>, m: usize, min_groups: usize) -> Option<SplitPlan> {
    let mut spans = Vec::with_capacity(w.len());
    let (mut slices, mut split) = (0, false);
    for c in w {
        let n = rows.end.min(c.row_start + c.rows).saturating_sub(rows.start.max(c.row_start));
        let span = dx_span(m, n, c.k, min_groups);
        split |= span < n;
        slices += if n == 0 { 0 } else { dx_slices(n, span) };
        spans.push(span);
    }
    let k = w.first()?.k;
    split.then_some(SplitPlan { spans, floats: slices * m * k })
}

/// A weight matrix `[rows, k]` bound as group 1, for [`matmul_dx`].
pub struct DxWeight<'a> {
    /// The group-1 bind group over the rows from `row_start`.
    pub bind_group: &'a wgpu::BindGroup,
    /// Its dtype.
    pub dtype: Dtype,
    /// First row of the whole matrix held by this binding.
    pub row_start: usize,
    /// Rows held by this binding.
    pub rows: usize,
    /// Columns (input features).
    pub k: usize,
    /// Affine weights: the `u32` index of the binding's scales and biases; 0 otherwise.
    pub sb: u32,
}

impl<'a> DxWeight<'a> {
    /// The chunks of a checkpoint or adapter weight.
    pub fn chunks(w: &'a GpuWeight) -> Vec<DxWeight<'a>> {
        w.chunks
            .iter()
            .map(|c| DxWeight {
                bind_group: &c.bind_group,
                dtype: c.dtype,
                row_start: c.row_start,
                rows: c.rows,
                k: w.cols,
                sb: c.sb,
            })
            .collect()
    }
}

/// Record `dx (+)= scale · dy · W[rows]`: the input gradient through the weight rows `rows` (all rows of
/// a projection, or one projection's A inside a concatenated group), one dispatch per chunk. Where
/// the tiles alone would leave the device idle ([`dx_span`]) and `io.slices` holds the partial
/// products, each chunk's reduction is split along `rows` into slices written to the scratch,
/// and one more dispatch sums them into dx in a fixed order (the same result on every run).
pub fn matmul_dx(rec: &mut Recorder, w: &[DxWeight], rows: Range<usize>, io: &DxIo) -> Result<(), GpuError> {
    let min_groups = rec.ctx().min_workgroups();
    let plan = split_plan(w, rows.clone(), io.m, min_groups);
    let scratch = match (&plan, io.slices) {
        (Some(plan), Some((buf, floats))) if plan.floats <= floats => Some((plan, buf)),
        _ => None,
    };
    let mut first = true;
    let mut slice0 = 0;
    for (ci, c) in w.iter().enumerate() {
        let lo = rows.start.max(c.row_start);
        let hi = rows.end.min(c.row_start + c.rows);
        if lo >= hi {
            continue;
        }
        let n = hi - lo;
        let (span, out, dx_offset, dx_stride, accumulate) = match scratch {
            Some((plan, buf)) => (plan.spans[ci], buf, slice0 * io.m * c.k, c.k, false),
            None => (n, io.dx, io.dx_offset, io.dx_stride, io.accumulate || !first),
        };
        let slices = dx_slices(n, span);
        let params = DxParams {
            m: io.m as u32,
            n: n as u32,
            k: c.k as u32,
            dy_offset: (io.dy_offset + lo - rows.start) as u32,
            dy_stride: io.dy_stride as u32,
            dx_offset: dx_offset as u32,
            dx_stride: dx_stride as u32,
            w_row: (lo - c.row_start) as u32,
            scale: io.scale,
            q_sb: c.sb,
            n_span: span as u32,
            slice_stride: (io.m * c.k) as u32,
        };
        let key = PipelineKey { kernel: Kernel::MatmulDx, dtype: c.dtype, accumulate, variant: 0 };
        let groups = [(c.k as u32).div_ceil(64), (io.m as u32).div_ceil(64), slices as u32];
        rec.dispatch(key, &params, &[io.dy, out], &[c.bind_group], groups)?;
        first = false;
        slice0 += slices;
    }
    if let Some((_, buf)) = scratch {
        let k = w.first().map_or(0, |c| c.k);
        let out = SlicesOut { y: io.dx, y_offset: io.dx_offset, y_stride: io.dx_stride, accumulate: io.accumulate };
        sum_slices(rec, buf, slice0, (io.m, k), &out)?;
    }
    Ok(())
}

/// Where [`sum_slices`] writes.
pub(crate) struct SlicesOut<'a> {
    pub(crate) y: &'a wgpu::Buffer,
    pub(crate) y_offset: usize,
    pub(crate) y_stride: usize,
    pub(crate) accumulate: bool,
}

/// Record `y[r, c] (+)= Σ_z slices[z, r, c]` over `rows × cols` outputs, the `slices` partial
/// products of a split reduction stored one after the other (`rows · cols` floats each) from the
/// start of `scratch`, added in order (`matmul_dx_sum`, the same result on every run).
pub(crate) fn sum_slices(
    rec: &mut Recorder,
    scratch: &wgpu::Buffer,
    slices: usize,
    (rows, cols): (usize, usize),
    out: &SlicesOut,
) -> Result<(), GpuError> {
    let params = DxParams {
        m: rows as u32,
        n: slices as u32,
        k: cols as u32,
        dx_offset: out.y_offset as u32,
        dx_stride: out.y_stride as u32,
        slice_stride: (rows * cols) as u32,
        ..Default::default()
    };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    let key = PipelineKey { kernel: Kernel::MatmulDxSum, dtype: Dtype::F32, accumulate: out.accumulate, variant: 0 };
    rec.dispatch(key, &params, &[scratch, out.y], &[], grid_1d(((rows * cols) as u32).div_ceil(64), max))
}

/// Mirrors `Params` in `lora_grad.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct GradParams {
    rows: u32,
    cols: u32,
    tokens: u32,
    a_offset: u32,
    a_stride: u32,
    b_offset: u32,
    b_stride: u32,
    g_offset: u32,
    g_stride: u32,
    accumulate: u32,
    scale: f32,
    _pad: u32,
}

/// A strided f32 matrix view: element (row, col) at `offset + row · stride + col`.
#[derive(Clone, Copy)]
pub struct View<'a> {
    /// The buffer.
    pub buf: &'a wgpu::Buffer,
    /// First element.
    pub offset: usize,
    /// Row stride.
    pub stride: usize,
}

/// Record `g[i, j] (+)= scale · Σ_t a[t, i] · b[t, j]` for `i < rows`, `j < cols`.
#[allow(clippy::too_many_arguments)]
pub fn lora_grad(
    rec: &mut Recorder,
    a: View,
    b: View,
    g: View,
    rows: usize,
    cols: usize,
    tokens: usize,
    scale: f32,
    accumulate: bool,
) -> Result<(), GpuError> {
    let params = GradParams {
        rows: rows as u32,
        cols: cols as u32,
        tokens: tokens as u32,
        a_offset: a.offset as u32,
        a_stride: a.stride as u32,
        b_offset: b.offset as u32,
        b_stride: b.stride as u32,
        g_offset: g.offset as u32,
        g_stride: g.stride as u32,
        accumulate: accumulate as u32,
        scale,
        _pad: 0,
    };
    let groups = [(cols as u32).div_ceil(64), rows as u32, 1];
    rec.dispatch(PipelineKey::plain(Kernel::LoraGrad), &params, &[a.buf, b.buf, g.buf], &[], groups)
}

/// Mirrors `Params` in `backward.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
struct BackwardParams {
    n: u32,
    rows: u32,
    x_offset: u32,
    dy_offset: u32,
    dx_offset: u32,
    accumulate: u32,
    eps: f32,
    _pad: u32,
}

/// Record the RMSNorm1p backward over `rows` rows of length `n`: `dx (+)= ∂(x·r·(1+w))/∂x · dy`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_bwd(
    rec: &mut Recorder,
    w: &GpuVector,
    x: (&wgpu::Buffer, usize),
    dy: (&wgpu::Buffer, usize),
    dx: (&wgpu::Buffer, usize),
    rows: usize,
    n: usize,
    eps: f32,
    accumulate: bool,
) -> Result<(), GpuError> {
    let params = BackwardParams {
        n: n as u32,
        rows: rows as u32,
        x_offset: x.1 as u32,
        dy_offset: dy.1 as u32,
        dx_offset: dx.1 as u32,
        accumulate: accumulate as u32,
        eps,
        _pad: 0,
    };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    let key = PipelineKey::plain(Kernel::RmsNormBwd);
    rec.dispatch(key, &params, &[x.0, dy.0, dx.0], &[&w.bind_group], grid_1d(rows as u32, max))
}

/// Record the SwiGLU backward over `n` elements: `da` becomes `dg`, `du` is written.
pub fn swiglu_bwd(
    rec: &mut Recorder,
    g: &wgpu::Buffer,
    u: &wgpu::Buffer,
    da: &wgpu::Buffer,
    du: &wgpu::Buffer,
    n: usize,
) -> Result<(), GpuError> {
    let params = BackwardParams { n: n as u32, ..Default::default() };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    let groups = grid_1d((n as u32).div_ceil(64), max);
    rec.dispatch(PipelineKey::plain(Kernel::SwigluBwd), &params, &[g, u, da, du], &[], groups)
}

/// Mirrors `Params` in `adamw.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AdamParams {
    /// Elements of the tensor.
    pub n: u32,
    /// Its slot in the norms buffer.
    pub slot: u32,
    /// Slots in use (all tensors of the adapter).
    pub slots: u32,
    /// First element of the tensor in its parameter buffer.
    pub offset: u32,
    /// Learning rate.
    pub lr: f32,
    /// β1.
    pub beta1: f32,
    /// β2.
    pub beta2: f32,
    /// ε.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Strength of the L2 pull towards the starting weights.
    pub anchor_l2: f32,
    /// 1 − β1^t.
    pub bc1: f32,
    /// 1 − β2^t.
    pub bc2: f32,
    /// Global gradient-norm clip (0: none).
    pub max_norm: f32,
    /// Padding.
    pub _pad1: [f32; 3],
}

/// Record `norms[slot] = Σ grad²`.
pub fn sum_squares(
    rec: &mut Recorder,
    grad: &wgpu::Buffer,
    norms: &wgpu::Buffer,
    n: usize,
    slot: usize,
) -> Result<(), GpuError> {
    let params = AdamParams { n: n as u32, slot: slot as u32, ..Default::default() };
    rec.dispatch(PipelineKey::plain(Kernel::SumSquares), &params, &[grad, norms], &[], [1, 1, 1])
}

/// One trainable tensor and its optimiser state.
pub struct AdamTensor<'a> {
    /// The gradient.
    pub grad: &'a wgpu::Buffer,
    /// The weights, updated in place.
    pub param: &'a wgpu::Buffer,
    /// First moment.
    pub m: &'a wgpu::Buffer,
    /// Second moment.
    pub v: &'a wgpu::Buffer,
    /// The starting weights.
    pub anchor: &'a wgpu::Buffer,
}

/// Record the AdamW update of one tensor (after [`sum_squares`] of every tensor).
pub fn adamw(rec: &mut Recorder, t: &AdamTensor, norms: &wgpu::Buffer, params: &AdamParams) -> Result<(), GpuError> {
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    let groups = grid_1d(params.n.div_ceil(256), max);
    let buffers = [t.grad, norms, t.param, t.m, t.v, t.anchor];
    rec.dispatch(PipelineKey::plain(Kernel::AdamW), params, &buffers, &[], groups)
}

/// Mirrors `Params` in `attention_bwd.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct AttnBwdParams {
    /// Rows with an output gradient (R).
    pub rows: u32,
    /// Position of row 0.
    pub pos0: u32,
    /// Query heads.
    pub hq: u32,
    /// Key/value heads.
    pub hkv: u32,
    /// Head dimension.
    pub hd: u32,
    /// Cache capacity (positions).
    pub s_max: u32,
    /// Score scale, hd^-0.5.
    pub scale: f32,
    /// Padding.
    pub _pad: u32,
}

/// The forward's attention state and the output gradient, for the attention backward.
pub struct AttnBwdIo<'a> {
    /// Rotated queries `[T, Hq, hd]`.
    pub q: &'a wgpu::Buffer,
    /// q_proj output `[T, Hq, 2·hd]` (query | gate).
    pub qg: &'a wgpu::Buffer,
    /// Key cache.
    pub k_cache: &'a wgpu::Buffer,
    /// Value cache.
    pub v_cache: &'a wgpu::Buffer,
    /// Gradient of the gated attention output `[R, Hq·hd]`.
    pub dy: &'a wgpu::Buffer,
    /// Out: gradient of q_proj's output `[R, Hq, 2·hd]` (rotated-query part, then the gate).
    pub dqg: &'a wgpu::Buffer,
    /// Out: softmax statistics `[R, Hq, 4]`.
    pub stats: &'a wgpu::Buffer,
    /// Out: gradient of the rotated keys `[keys, Hkv·hd]`.
    pub dk: &'a wgpu::Buffer,
    /// Out: gradient of the values `[keys, Hkv·hd]`.
    pub dv: &'a wgpu::Buffer,
}

/// Record the attention backward: queries and gate for the R rows, then keys and values of the
/// `keys` positions those rows see.
pub fn attention_bwd(rec: &mut Recorder, params: &AttnBwdParams, io: &AttnBwdIo, keys: usize) -> Result<(), GpuError> {
    let q = [io.q, io.qg, io.k_cache, io.v_cache, io.dy, io.dqg, io.stats];
    rec.dispatch(PipelineKey::plain(Kernel::AttnBwdQ), params, &q, &[], [params.rows, params.hq, 1])?;
    let kv = [io.q, io.qg, io.k_cache, io.v_cache, io.dy, io.stats, io.dk, io.dv];
    rec.dispatch(PipelineKey::plain(Kernel::AttnBwdKv), params, &kv, &[], [keys as u32, params.hkv, 1])
}

/// Mirrors `Params` in `norm_rope_bwd.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct NormRopeBwdParams {
    /// Heads per row.
    pub heads: u32,
    /// Head dimension.
    pub hd: u32,
    /// Rotary dims / 2.
    pub rot_half: u32,
    /// Position of row 0.
    pub pos0: u32,
    /// Raw input: first element.
    pub x_offset: u32,
    /// Raw input: row stride.
    pub x_row: u32,
    /// Raw input: head stride.
    pub x_head: u32,
    /// Gradient: first element.
    pub y_offset: u32,
    /// Gradient: row stride.
    pub y_row: u32,
    /// Gradient: head stride.
    pub y_head: u32,
    /// Norm epsilon.
    pub eps: f32,
    /// Padding.
    pub _pad: u32,
}

/// Record the q/k norm + RoPE backward over `rows` rows, in place on `y`.
pub fn norm_rope_bwd(
    rec: &mut Recorder,
    w: &GpuVector,
    x: &wgpu::Buffer,
    rope: &wgpu::Buffer,
    y: &wgpu::Buffer,
    params: &NormRopeBwdParams,
    rows: usize,
) -> Result<(), GpuError> {
    let key = PipelineKey::plain(Kernel::NormRopeBwd);
    rec.dispatch(key, params, &[x, rope, y], &[&w.bind_group], [rows as u32, params.heads, 1])
}
