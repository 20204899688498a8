//! `matmul.wgsl`: every nn.Linear, batched (tiled matmul) or single-token (matvec).

use crate::error::GpuError;
use crate::gpu::{grid_1d, GpuWeight, Recorder};
use crate::kernels::{Kernel, PipelineKey};

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
    /// Padding.
    pub _pad: u32,
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

/// Record `y (+)= x Wᵀ`, one dispatch per weight chunk.
pub fn linear(rec: &mut Recorder, w: &GpuWeight, io: &LinearIo) -> Result<(), GpuError> {
    let kernel = if io.m == 1 { Kernel::Matvec } else { Kernel::Matmul };
    let key = PipelineKey {
        kernel,
        dtype: w.dtype,
        accumulate: io.accumulate,
    };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    for chunk in &w.chunks {
        let params = MatmulParams {
            m: io.m as u32,
            n: chunk.rows as u32,
            k: w.cols as u32,
            x_offset: io.x_offset as u32,
            x_stride: w.cols as u32,
            y_offset: (io.y_offset + chunk.row_start) as u32,
            y_stride: io.y_stride as u32,
            _pad: 0,
        };
        let groups = if io.m == 1 {
            grid_1d((chunk.rows as u32).div_ceil(4), max)
        } else {
            [(chunk.rows as u32).div_ceil(64), (io.m as u32).div_ceil(64), 1]
        };
        rec.dispatch(key, &params, &[io.x, io.y], Some(&chunk.bind_group), groups)?;
    }
    Ok(())
}
