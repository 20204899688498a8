//! `norm.wgsl`: RMSNorm1p (alone or with the LoRA shrink of its output) and the GDN gated RMSNorm.

use crate::error::GpuError;
use crate::gpu::{grid_1d, GpuVector, Recorder};
use crate::kernels::{Kernel, PipelineKey};

/// Mirrors `Params` in `norm.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct NormParams {
    /// Row length.
    pub n: u32,
    /// Rows.
    pub rows: u32,
    /// First element of x (gated: of z).
    pub x_offset: u32,
    /// Row stride of x.
    pub x_stride: u32,
    /// First element of y.
    pub y_offset: u32,
    /// Row stride of y.
    pub y_stride: u32,
    /// Epsilon inside the root.
    pub eps: f32,
    /// `rms_norm_shrink`: the rows of A (otherwise 0).
    pub rank: u32,
}

/// Rows of `x` (contiguous, length `n`, from element `x_offset`) normalised into `y`.
pub struct NormIo<'a> {
    /// Input (gated: the gate z).
    pub x: &'a wgpu::Buffer,
    /// Output (gated: the values, normalised in place).
    pub y: &'a wgpu::Buffer,
    /// First row's element in x.
    pub x_offset: usize,
    /// First row's element in y.
    pub y_offset: usize,
    /// Rows.
    pub rows: usize,
    /// Row length.
    pub n: usize,
    /// Epsilon.
    pub eps: f32,
}

/// `y = x · rsqrt(mean(x²) + eps) · (1 + w)`.
pub fn rms_norm(rec: &mut Recorder, w: &GpuVector, io: &NormIo) -> Result<(), GpuError> {
    record(rec, Kernel::RmsNorm, w, io)
}

/// `y = y · rsqrt(mean(y²) + eps) · w · silu(x)` in place, x being the gate z.
pub fn rms_norm_gated(rec: &mut Recorder, w: &GpuVector, io: &NormIo) -> Result<(), GpuError> {
    record(rec, Kernel::RmsNormGated, w, io)
}

/// The LoRA shrink `rms_norm_shrink` writes: `t[row, r] = y[row] · A[r]` for `r < rank`.
#[derive(Clone, Copy)]
pub struct NormShrink<'a> {
    /// Group-2 bind group over A (f32 `[rank, n]`, one binding).
    pub a: &'a wgpu::BindGroup,
    /// Rows of A.
    pub rank: usize,
    /// The output, `[rows, rank]` from element 0.
    pub t: &'a wgpu::Buffer,
}

/// [`rms_norm`], and the LoRA shrink of each normalised row in the same dispatch (a workgroup
/// per row and 8 rows of A, each finding the row's norm). The row length must be a multiple of 4.
pub fn rms_norm_shrink(rec: &mut Recorder, w: &GpuVector, io: &NormIo, shrink: NormShrink) -> Result<(), GpuError> {
    if !io.n.is_multiple_of(4) {
        return Err(GpuError::Validation {
            during: "rms_norm_shrink".into(),
            message: format!("row length {} is not a multiple of 4", io.n),
        });
    }
    let params = NormParams { rank: shrink.rank as u32, ..params(io) };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension as usize;
    if io.rows > max || shrink.rank.div_ceil(8) > max {
        return Err(GpuError::Validation {
            during: "rms_norm_shrink".into(),
            message: format!("{} rows and rank {} exceed {max} workgroups per dimension", io.rows, shrink.rank),
        });
    }
    let groups = [shrink.rank.div_ceil(8) as u32, io.rows as u32, 1];
    let key = PipelineKey::plain(Kernel::RmsNormShrink);
    rec.dispatch(key, &params, &[io.x, io.y, shrink.t], &[&w.bind_group, shrink.a], groups)
}

fn params(io: &NormIo) -> NormParams {
    NormParams {
        n: io.n as u32,
        rows: io.rows as u32,
        x_offset: io.x_offset as u32,
        x_stride: io.n as u32,
        y_offset: io.y_offset as u32,
        y_stride: io.n as u32,
        eps: io.eps,
        rank: 0,
    }
}

fn record(rec: &mut Recorder, kernel: Kernel, w: &GpuVector, io: &NormIo) -> Result<(), GpuError> {
    let params = params(io);
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    let groups = grid_1d(io.rows as u32, max);
    rec.dispatch(PipelineKey::plain(kernel), &params, &[io.x, io.y], &[&w.bind_group], groups)
}
