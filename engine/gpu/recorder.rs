//! Records one step's dispatches, then submits them as a single command buffer. Every dispatch's
//! parameters go into one uniform arena (one 256-byte slot each, bound with a dynamic offset),
//! written once per step.

use std::collections::HashMap;

use crate::error::GpuError;
use crate::gpu::context::PARAMS_SLOT;
use crate::gpu::GpuContext;
use crate::kernels::{Kernel, PipelineKey};

enum Op {
    Dispatch {
        pipeline: wgpu::ComputePipeline,
        io: wgpu::BindGroup,
        offset: u32,
        bound: Vec<wgpu::BindGroup>,
        groups: [u32; 3],
    },
    Copy {
        src: wgpu::Buffer,
        src_offset: u64,
        dst: wgpu::Buffer,
        dst_offset: u64,
        size: u64,
    },
}

/// Group-0 bind groups over a fixed set of buffers plus the uniform arena, cached by the
/// buffers they bind (built once per session, reused by every step).
pub struct IoBindCache {
    params: wgpu::Buffer,
    groups: HashMap<(Kernel, Vec<wgpu::Buffer>), wgpu::BindGroup>,
}

impl IoBindCache {
    /// A cache whose bind groups use `params` as the uniform arena.
    pub fn new(params: wgpu::Buffer) -> Self {
        Self { params, groups: HashMap::new() }
    }

    /// The uniform arena.
    pub fn params(&self) -> &wgpu::Buffer {
        &self.params
    }

    fn get(&mut self, ctx: &GpuContext, kernel: Kernel, buffers: &[&wgpu::Buffer]) -> wgpu::BindGroup {
        let key = (kernel, buffers.iter().map(|b| (*b).clone()).collect::<Vec<_>>());
        if let Some(g) = self.groups.get(&key) {
            return g.clone();
        }
        let layout = ctx.io_layout(kernel.io());
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &self.params,
                offset: 0,
                size: wgpu::BufferSize::new(PARAMS_SLOT),
            }),
        }];
        for (i, b) in buffers.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry { binding: i as u32 + 1, resource: b.as_entire_binding() });
        }
        let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(kernel.entry()),
            layout: &layout,
            entries: &entries,
        });
        self.groups.insert(key, group.clone());
        group
    }
}

/// Collects a step's work; [`Recorder::submit`] writes the arena and submits once.
pub struct Recorder<'a> {
    ctx: &'a GpuContext,
    cache: &'a mut IoBindCache,
    params: Vec<u8>,
    ops: Vec<Op>,
}

impl<'a> Recorder<'a> {
    /// Start recording a step.
    pub fn new(ctx: &'a GpuContext, cache: &'a mut IoBindCache) -> Self {
        Self { ctx, cache, params: Vec::new(), ops: Vec::new() }
    }

    /// The context.
    pub fn ctx(&self) -> &GpuContext {
        self.ctx
    }

    /// Record a dispatch of `key` with uniform `params`, group-0 storage `buffers` (in binding
    /// order) and the bind groups of groups 1.. (weights, then the adapter slot).
    pub fn dispatch<P: bytemuck::Pod>(
        &mut self,
        key: PipelineKey,
        params: &P,
        buffers: &[&wgpu::Buffer],
        bound: &[&wgpu::BindGroup],
        groups: [u32; 3],
    ) -> Result<(), GpuError> {
        debug_assert_eq!(buffers.len(), key.kernel.io().len());
        debug_assert!(std::mem::size_of::<P>() as u64 <= PARAMS_SLOT);
        if groups.contains(&0) {
            return Ok(());
        }
        let max = self.ctx.limits.max_compute_workgroups_per_dimension;
        if groups.iter().any(|&g| g > max) {
            return Err(GpuError::Validation {
                during: format!("recording {:?}", key.kernel),
                message: format!("workgroup grid {groups:?} exceeds {max} per dimension"),
            });
        }
        let pipeline = self.ctx.pipeline(key)?;
        let offset = self.params.len() as u32;
        self.params.extend_from_slice(bytemuck::bytes_of(params));
        self.params.resize(offset as usize + PARAMS_SLOT as usize, 0);
        let io = self.cache.get(self.ctx, key.kernel, buffers);
        let bound = bound.iter().map(|g| (*g).clone()).collect();
        self.ops.push(Op::Dispatch { pipeline, io, offset, bound, groups });
        Ok(())
    }

    /// Record a buffer copy (outside any compute pass).
    pub fn copy(&mut self, src: &wgpu::Buffer, src_offset: u64, dst: &wgpu::Buffer, dst_offset: u64, size: u64) {
        self.ops.push(Op::Copy { src: src.clone(), src_offset, dst: dst.clone(), dst_offset, size });
    }

    /// Write the uniform arena and submit everything as one command buffer.
    pub fn submit(self) -> Result<wgpu::SubmissionIndex, GpuError> {
        let arena = self.cache.params();
        if self.params.len() as u64 > arena.size() {
            return Err(GpuError::BufferTooLarge {
                name: "uniform arena".into(),
                needed: self.params.len() as u64,
                limit: arena.size(),
            });
        }
        let scope = self.ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
        if !self.params.is_empty() {
            self.ctx.write(arena, 0, &self.params);
        }
        let mut encoder =
            self.ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") });
        let mut i = 0;
        while i < self.ops.len() {
            match &self.ops[i] {
                Op::Copy { src, src_offset, dst, dst_offset, size } => {
                    encoder.copy_buffer_to_buffer(src, *src_offset, dst, *dst_offset, *size);
                    i += 1;
                }
                Op::Dispatch { .. } => {
                    let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("step"),
                        timestamp_writes: None,
                    });
                    while let Some(Op::Dispatch { pipeline, io, offset, bound, groups }) = self.ops.get(i) {
                        pass.set_pipeline(pipeline);
                        pass.set_bind_group(0, io, &[*offset]);
                        for (g, group) in bound.iter().enumerate() {
                            pass.set_bind_group(g as u32 + 1, group, &[]);
                        }
                        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                        i += 1;
                    }
                }
            }
        }
        let dispatches = self.ops.iter().filter(|op| matches!(op, Op::Dispatch { .. })).count() as u64;
        let index = self.ctx.submit(encoder.finish(), dispatches);
        match pollster::block_on(scope.pop()) {
            Some(err) => Err(GpuError::Validation { during: "a step".into(), message: err.to_string() }),
            None => Ok(index),
        }
    }
}

/// Split `n` workgroups into a 2-D grid within the per-dimension limit (kernels rebuild the
/// linear index as `wg.y * num_workgroups.x + wg.x`).
pub fn grid_1d(n: u32, max: u32) -> [u32; 3] {
    if n <= max {
        [n, 1, 1]
    } else {
        let y = n.div_ceil(max);
        [n.div_ceil(y), y, 1]
    }
}
