//! Copy GPU buffers back to the host.

use crate::error::GpuError;
use crate::gpu::GpuContext;

/// Read `len` f32 values starting at element `offset` of `buffer` (waits for the GPU).
pub fn read_f32(ctx: &GpuContext, buffer: &wgpu::Buffer, offset: usize, len: usize) -> Result<Vec<f32>, GpuError> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let size = (len * 4) as u64;
    let staging = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
    let mut encoder = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("readback") });
    encoder.copy_buffer_to_buffer(buffer, (offset * 4) as u64, &staging, 0, size);
    ctx.queue.submit([encoder.finish()]);
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(GpuError::Validation { during: "reading a buffer back".into(), message: e.to_string() });
    }
    let slice = staging.slice(..);
    let (tx, rx) = std::sync::mpsc::channel();
    slice.map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    ctx.device.poll(wgpu::PollType::wait_indefinitely()).map_err(|e| GpuError::Readback(e.to_string()))?;
    rx.recv().map_err(|e| GpuError::Readback(e.to_string()))?.map_err(|e| GpuError::Readback(e.to_string()))?;
    let data = slice.get_mapped_range().map_err(|e| GpuError::Readback(format!("{e:?}")))?;
    let out: Vec<f32> = bytemuck::pod_collect_to_vec(&data[..]);
    drop(data);
    staging.unmap();
    Ok(out)
}
