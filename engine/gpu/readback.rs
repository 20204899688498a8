//! Copy GPU buffers back to the host.

use crate::error::GpuError;
use crate::gpu::GpuContext;

/// A host-mappable buffer that a step copies its result into, reused for every step (no
/// allocation per token).
pub struct Staging {
    buffer: wgpu::Buffer,
}

impl Staging {
    /// A staging buffer of `bytes` (a multiple of 4).
    pub fn new(ctx: &GpuContext, label: &str, bytes: u64) -> Self {
        let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(4).next_multiple_of(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Self { buffer }
    }

    /// The buffer a step copies into.
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// Bytes it holds.
    pub fn size(&self) -> u64 {
        self.buffer.size()
    }

    /// Wait for submission `index` (not for anything submitted after it), then read the first
    /// `bytes` of the buffer (at most [`Staging::size`]).
    pub fn read(&self, ctx: &GpuContext, index: wgpu::SubmissionIndex, bytes: u64) -> Result<Vec<u8>, GpuError> {
        if bytes > self.size() {
            return Err(GpuError::BufferTooLarge { name: "staging read".into(), needed: bytes, limit: self.size() });
        }
        let slice = self.buffer.slice(..bytes);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        ctx.device
            .poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None })
            .map_err(|e| GpuError::Readback(e.to_string()))?;
        rx.recv().map_err(|e| GpuError::Readback(e.to_string()))?.map_err(|e| GpuError::Readback(e.to_string()))?;
        let data = slice.get_mapped_range().map_err(|e| GpuError::Readback(format!("{e:?}")))?;
        let out = data.to_vec();
        drop(data);
        self.buffer.unmap();
        ctx.count_read_back(bytes);
        Ok(out)
    }

    /// [`Staging::read`] of the first `words` little-endian `u32` words.
    pub fn read_words(
        &self,
        ctx: &GpuContext,
        index: wgpu::SubmissionIndex,
        words: usize,
    ) -> Result<Vec<u32>, GpuError> {
        let bytes = self.read(ctx, index, words.checked_mul(4).map_or(u64::MAX, |b| b as u64))?;
        Ok(bytes.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])).collect())
    }
}

/// Read `len` f32 values starting at element `offset` of `buffer` (waits for the GPU).
pub fn read_f32(ctx: &GpuContext, buffer: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<f32>, GpuError> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let size = (len * 4) as u64;
    let staging = Staging::new(ctx, "readback", size);
    read_f32_via(ctx, buffer, offset, len, &staging)
}

/// [`read_f32`] through a staging buffer the caller keeps (at least `len * 4` bytes).
pub fn read_f32_via(
    ctx: &GpuContext,
    buffer: &wgpu::Buffer,
    offset: usize,
    len: usize,
    staging: &Staging,
) -> Result<Vec<f32>, GpuError> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let size = (len * 4) as u64;
    if size > staging.size() {
        return Err(GpuError::BufferTooLarge { name: "readback staging".into(), needed: size, limit: staging.size() });
    }
    let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
    let mut encoder = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("readback") });
    encoder.copy_buffer_to_buffer(buffer, (offset * 4) as u64, staging.buffer(), 0, size);
    let index = ctx.submit(encoder.finish(), 0);
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(GpuError::Validation { during: "reading a buffer back".into(), message: e.to_string() });
    }
    Ok(bytemuck::pod_collect_to_vec(&staging.read(ctx, index, size)?))
}

/// Read several ranges `(buffer, first element, elements)` of f32 in one submission and one
/// mapping (waits for the GPU).
pub fn read_f32_many(ctx: &GpuContext, parts: &[(&wgpu::Buffer, usize, usize)]) -> Result<Vec<Vec<f32>>, GpuError> {
    let total: u64 = parts.iter().map(|&(_, _, len)| (len * 4) as u64).sum();
    if total == 0 {
        return Ok(parts.iter().map(|_| Vec::new()).collect());
    }
    if total > ctx.limits.max_buffer_size {
        return Err(GpuError::BufferTooLarge {
            name: "readback staging".into(),
            needed: total,
            limit: ctx.limits.max_buffer_size,
        });
    }
    let staging = Staging::new(ctx, "readback", total);
    let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
    let mut encoder = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("readback") });
    let mut at = 0u64;
    for &(buffer, offset, len) in parts {
        let size = (len * 4) as u64;
        if size > 0 {
            encoder.copy_buffer_to_buffer(buffer, (offset * 4) as u64, staging.buffer(), at, size);
        }
        at += size;
    }
    let index = ctx.submit(encoder.finish(), 0);
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(GpuError::Validation { during: "reading buffers back".into(), message: e.to_string() });
    }
    let bytes = staging.read(ctx, index, total)?;
    let all: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
    let mut out = Vec::with_capacity(parts.len());
    let mut at = 0;
    for &(_, _, len) in parts {
        out.push(all[at..at + len].to_vec());
        at += len;
    }
    Ok(out)
}
