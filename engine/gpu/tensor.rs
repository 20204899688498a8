//! Weights on the GPU. Matrices keep their checkpoint dtype (bf16/f16 packed two per `u32`,
//! widened in the shader); a matrix larger than one storage binding is split by rows.

use crate::error::GpuError;
use crate::gpu::Dtype;
use crate::gpu::GpuContext;

/// One row range of a weight matrix, in its own buffer and bind group.
pub struct WeightChunk {
    /// First row (output feature) held by this chunk.
    pub row_start: usize,
    /// Rows held.
    pub rows: usize,
    /// The bytes of those rows, in the checkpoint dtype.
    pub buffer: wgpu::Buffer,
    /// Group-1 bind group over `buffer`.
    pub bind_group: wgpu::BindGroup,
}

/// A `[rows, cols]` matrix (nn.Linear weight or embedding table) on the GPU.
pub struct GpuWeight {
    /// The checkpoint dtype, kept exactly.
    pub dtype: Dtype,
    /// Rows (output features / vocabulary entries).
    pub rows: usize,
    /// Columns (input features / hidden size).
    pub cols: usize,
    /// Row chunks, each within the device's storage binding limit.
    pub chunks: Vec<WeightChunk>,
}

impl GpuWeight {
    /// Upload `[rows, cols]` raw bytes of dtype `dtype`, split into chunks of at most
    /// `max_chunk_bytes` (the binding limit unless a test asks for less).
    pub fn upload(
        ctx: &GpuContext,
        name: &str,
        dtype: Dtype,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        max_chunk_bytes: u64,
    ) -> Result<Self, GpuError> {
        let row_bytes = (cols * dtype.size()) as u64;
        let limit = max_chunk_bytes.min(ctx.max_binding());
        let rows_per_chunk = (limit / row_bytes.max(1)).max(1) as usize;
        if row_bytes > limit {
            return Err(GpuError::BufferTooLarge { name: name.to_string(), needed: row_bytes, limit });
        }
        let mut chunks = Vec::new();
        let mut row_start = 0;
        while row_start < rows {
            let n = rows_per_chunk.min(rows - row_start);
            let begin = row_start * row_bytes as usize;
            let end = begin + n * row_bytes as usize;
            let label = format!("{name}[{row_start}..{}]", row_start + n);
            let buffer = ctx.upload(&label, &bytes[begin..end])?;
            let bind_group = ctx.weights_bind_group(&buffer, &label);
            chunks.push(WeightChunk { row_start, rows: n, buffer, bind_group });
            row_start += n;
        }
        Ok(Self { dtype, rows, cols, chunks })
    }

    /// Bytes held on the GPU.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.buffer.size()).sum()
    }
}

/// A small f32 parameter vector (norm weights, conv taps, gate parameters) with its group-1
/// bind group.
pub struct GpuVector {
    /// The buffer.
    pub buffer: wgpu::Buffer,
    /// Group-1 bind group over it.
    pub bind_group: wgpu::BindGroup,
}

impl GpuVector {
    /// Upload f32 values.
    pub fn upload(ctx: &GpuContext, name: &str, values: &[f32]) -> Result<Self, GpuError> {
        let buffer = ctx.upload(name, bytemuck::cast_slice(values))?;
        let bind_group = ctx.weights_bind_group(&buffer, name);
        Ok(Self { buffer, bind_group })
    }
}
