//! `norm.wgsl`: RMSNorm1p and the GDN gated RMSNorm.

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
    /// Padding.
    pub _pad: u32,
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

fn record(rec: &mut Recorder, kernel: Kernel, w: &GpuVector, io: &NormIo) -> Result<(), GpuError> {
    let params = NormParams {
        n: io.n as u32,
        rows: io.rows as u32,
        x_offset: io.x_offset as u32,
        x_stride: io.n as u32,
        y_offset: io.y_offset as u32,
        y_stride: io.n as u32,
        eps: io.eps,
        _pad: 0,
    };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    let groups = grid_1d(io.rows as u32, max);
    rec.dispatch(PipelineKey::plain(kernel), &params, &[io.x, io.y], &[&w.bind_group], groups)
}
