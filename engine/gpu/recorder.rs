//! Records one step's dispatches, then submits them as a single command buffer. Every dispatch's
//! parameters go into one uniform arena (one 256-byte slot each, bound with a dynamic offset),
//! written once per step.

use std::collections::HashMap;

use crate::error::GpuError;
use crate::gpu::context::PARAMS_SLOT;
use crate::gpu::{GpuContext, Staging};
use crate::gpu::{Kernel, PipelineKey};

/// Most dispatches timed in one profiled submit (a query set holds at most 4096 timestamps).
const MAX_TIMED: usize = 2048;

enum Op {
    Dispatch {
        pipeline: wgpu::ComputePipeline,
        buffers: Vec<wgpu::Buffer>,
        offset: u32,
        bound: Vec<wgpu::BindGroup>,
        groups: [u32; 3],
        kernel: Kernel,
        weight_bytes: u64,
        /// The profile family: the entry point unless [`Recorder::tagged`] names it.
        family: &'static str,
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
/// buffers they bind (built once per session, reused by every step). The arena grows to what a
/// recording needs (the bind groups are then rebuilt once), so nobody counts dispatches ahead.
/// It also keeps the scratch that split reductions write their slices to
/// ([`Recorder::split_scratch`]), allocated by the first recording that needs it.
pub struct IoBindCache {
    params: wgpu::Buffer,
    groups: HashMap<(Kernel, Vec<wgpu::Buffer>), wgpu::BindGroup>,
    split: Option<wgpu::Buffer>,
    /// The smallest split scratch (in floats) the device refused: requests of that size or more
    /// are not retried.
    split_refused: Option<u64>,
}

/// A uniform arena of `size` bytes.
fn arena(ctx: &GpuContext, label: &str, size: u64) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

impl IoBindCache {
    /// A cache whose bind groups use `params` as the uniform arena.
    pub fn new(params: wgpu::Buffer) -> Self {
        Self { params, groups: HashMap::new(), split: None, split_refused: None }
    }

    /// A cache with a uniform arena of its own, `bytes` to start with (a multiple of the
    /// 256-byte slot a dispatch takes; the recorder grows it to what a recording needs).
    pub fn with_arena(ctx: &GpuContext, label: &str, bytes: u64) -> Self {
        Self::new(arena(ctx, label, bytes))
    }

    /// The uniform arena.
    pub fn params(&self) -> &wgpu::Buffer {
        &self.params
    }

    /// Drop the cached bind groups (a buffer they bind was replaced: they would keep it alive).
    pub fn forget_groups(&mut self) {
        self.groups.clear();
    }

    /// Drop the cached bind groups that bind any of `buffers` (buffers about to be freed, or
    /// bound for one step only: the groups would keep them alive).
    pub fn forget_buffers(&mut self, buffers: &[&wgpu::Buffer]) {
        self.groups.retain(|(_, bound), _| !bound.iter().any(|b| buffers.contains(&b)));
    }

    /// How many bind groups are cached.
    pub fn cached_groups(&self) -> usize {
        self.groups.len()
    }

    /// Make the arena hold at least `bytes` (doubling; the cached bind groups point at the old
    /// arena, so they are dropped and rebuilt on use).
    fn reserve(&mut self, ctx: &GpuContext, bytes: u64) {
        if bytes <= self.params.size() {
            return;
        }
        let size = bytes.next_power_of_two().max(self.params.size() * 2);
        self.params = arena(ctx, "uniform arena", size);
        self.groups.clear();
    }

    fn get(&mut self, ctx: &GpuContext, kernel: Kernel, buffers: &[wgpu::Buffer]) -> wgpu::BindGroup {
        let key = (kernel, buffers.to_vec());
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

/// One timed dispatch of a profiled submit.
#[derive(Clone, Debug)]
pub struct Timed {
    /// The entry point.
    pub kernel: Kernel,
    /// What it is for in the profile: the entry point, or the name [`Recorder::tagged`] gave it.
    pub family: &'static str,
    /// Weight bytes the dispatch streams (its group-1 weight chunk; 0 for other kernels).
    pub weight_bytes: u64,
    /// GPU time between the start and the end of its pass, in nanoseconds.
    pub ns: f64,
}

/// GPU timestamps of every dispatch, one list per submit (needs `TIMESTAMP_QUERY`). Each
/// dispatch then runs in a pass of its own and every submit waits for its timings, so a
/// profiled run is slower than a plain one: it is for attributing time, not for throughput.
#[derive(Debug, Default)]
pub struct Profile {
    /// The timed dispatches of each submit, in order.
    pub submits: Vec<Vec<Timed>>,
}

impl Profile {
    /// An empty profile to record into where `ctx`'s device has timestamps, else `None`.
    pub(crate) fn if_timed(ctx: &GpuContext) -> Option<Self> {
        ctx.features.contains(wgpu::Features::TIMESTAMP_QUERY).then(Self::default)
    }
}

/// Collects a step's work; [`Recorder::submit`] writes the arena and submits once.
pub struct Recorder<'a> {
    ctx: &'a GpuContext,
    cache: &'a mut IoBindCache,
    params: Vec<u8>,
    ops: Vec<Op>,
    profile: Option<&'a mut Profile>,
}

impl<'a> Recorder<'a> {
    /// Start recording a step.
    pub fn new(ctx: &'a GpuContext, cache: &'a mut IoBindCache) -> Self {
        Self { ctx, cache, params: Vec::new(), ops: Vec::new(), profile: None }
    }

    /// Time every dispatch of this recording into `profile` (when the device has timestamps).
    pub fn profiled(mut self, profile: Option<&'a mut Profile>) -> Self {
        if self.ctx.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            self.profile = profile;
        }
        self
    }

    /// Record what `f` records, its dispatches named `family` in profiles (a kernel used for
    /// more than one job, like the matvec that also runs the LoRA shrinks).
    pub fn tagged<T>(&mut self, family: &'static str, f: impl FnOnce(&mut Self) -> T) -> T {
        let start = self.ops.len();
        let out = f(self);
        for op in &mut self.ops[start..] {
            if let Op::Dispatch { family: f, .. } = op {
                *f = family;
            }
        }
        out
    }

    /// Note the weight bytes the last recorded dispatch streams (for profiles).
    pub fn weight_bytes(&mut self, bytes: u64) {
        if let Some(Op::Dispatch { weight_bytes, .. }) = self.ops.last_mut() {
            *weight_bytes = bytes;
        }
    }

    /// The context.
    pub fn ctx(&self) -> &GpuContext {
        self.ctx
    }

    /// A scratch buffer of at least `floats` f32 for the slices of a split reduction (a matmul
    /// over too few tiles to fill the device), kept by the cache for every later recording: the
    /// callers ask for their device's bound, so it is allocated once. `None` where it cannot be
    /// allocated (the caller then runs the reduction unsplit; the cache remembers the refusal,
    /// so later recordings do not ask the device again).
    pub fn split_scratch(&mut self, floats: u64) -> Option<wgpu::Buffer> {
        if let Some(buf) = self.cache.split.as_ref().filter(|b| b.size() >= floats * 4) {
            return Some(buf.clone());
        }
        if self.cache.split_refused.is_some_and(|f| f <= floats) {
            return None;
        }
        let Ok(buf) = self.ctx.storage_buffer("split reduction scratch", floats * 4, true) else {
            self.cache.split_refused = Some(self.cache.split_refused.map_or(floats, |f| f.min(floats)));
            return None;
        };
        // The cached bind groups over a smaller scratch would keep it alive.
        if self.cache.split.replace(buf.clone()).is_some() {
            self.cache.groups.clear();
        }
        Some(buf)
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
        const { assert!(std::mem::size_of::<P>() as u64 <= PARAMS_SLOT, "a kernel's parameters exceed the arena's slot") };
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
        let buffers = buffers.iter().map(|b| (*b).clone()).collect();
        let bound = bound.iter().map(|g| (*g).clone()).collect();
        self.ops.push(Op::Dispatch {
            pipeline,
            buffers,
            offset,
            bound,
            groups,
            kernel: key.kernel,
            weight_bytes: 0,
            family: key.kernel.entry(),
        });
        Ok(())
    }

    /// Record a buffer copy (outside any compute pass).
    pub fn copy(&mut self, src: &wgpu::Buffer, src_offset: u64, dst: &wgpu::Buffer, dst_offset: u64, size: u64) {
        self.ops.push(Op::Copy { src: src.clone(), src_offset, dst: dst.clone(), dst_offset, size });
    }

    /// Write the uniform arena and submit everything as one command buffer.
    pub fn submit(self) -> Result<wgpu::SubmissionIndex, GpuError> {
        let limit = self.ctx.limits.max_buffer_size;
        if self.params.len() as u64 > limit {
            return Err(GpuError::BufferTooLarge {
                name: "uniform arena".into(),
                needed: self.params.len() as u64,
                limit,
            });
        }
        self.cache.reserve(self.ctx, self.params.len() as u64);
        let ios: Vec<Option<wgpu::BindGroup>> = self
            .ops
            .iter()
            .map(|op| match op {
                Op::Dispatch { kernel, buffers, .. } => Some(self.cache.get(self.ctx, *kernel, buffers)),
                Op::Copy { .. } => None,
            })
            .collect();
        let arena = self.cache.params();
        let scope = self.ctx.device.push_error_scope(wgpu::ErrorFilter::Validation);
        if !self.params.is_empty() {
            self.ctx.write(arena, 0, &self.params);
        }
        let mut encoder =
            self.ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("step") });
        // Profiled recordings only: the dispatches to time and a query set for them.
        let timed: Vec<(Kernel, &'static str, u64)> = match &self.profile {
            Some(_) => self
                .ops
                .iter()
                .filter_map(|op| match op {
                    Op::Dispatch { kernel, weight_bytes, family, .. } => Some((*kernel, *family, *weight_bytes)),
                    Op::Copy { .. } => None,
                })
                .take(MAX_TIMED)
                .collect(),
            None => Vec::new(),
        };
        let queries = (!timed.is_empty()).then(|| {
            self.ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: 2 * timed.len() as u32,
            })
        });
        let mut i = 0;
        let mut n = 0u32;
        while i < self.ops.len() {
            match &self.ops[i] {
                Op::Copy { src, src_offset, dst, dst_offset, size } => {
                    encoder.copy_buffer_to_buffer(src, *src_offset, dst, *dst_offset, *size);
                    i += 1;
                }
                Op::Dispatch { .. } => {
                    // Profiled: one pass per dispatch, timestamps at its start and end.
                    let timestamp_writes = queries.as_ref().filter(|_| (n as usize) < timed.len()).map(|q| {
                        wgpu::ComputePassTimestampWrites {
                            query_set: q,
                            beginning_of_pass_write_index: Some(2 * n),
                            end_of_pass_write_index: Some(2 * n + 1),
                        }
                    });
                    let one = timestamp_writes.is_some();
                    let mut pass = encoder
                        .begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("step"), timestamp_writes });
                    while let (Some(Op::Dispatch { pipeline, offset, bound, groups, .. }), Some(Some(io))) =
                        (self.ops.get(i), ios.get(i))
                    {
                        pass.set_pipeline(pipeline);
                        pass.set_bind_group(0, io, &[*offset]);
                        for (g, group) in bound.iter().enumerate() {
                            pass.set_bind_group(g as u32 + 1, group, &[]);
                        }
                        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                        i += 1;
                        n += 1;
                        if one {
                            break;
                        }
                    }
                }
            }
        }
        let resolved = queries.as_ref().map(|q| {
            let bytes = 16 * timed.len() as u64;
            let buf = self.ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("profile resolve"),
                size: bytes,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let staging = Staging::new(self.ctx, "profile staging", bytes);
            encoder.resolve_query_set(q, 0..2 * timed.len() as u32, &buf, 0);
            encoder.copy_buffer_to_buffer(&buf, 0, staging.buffer(), 0, bytes);
            staging
        });
        let dispatches = self.ops.iter().filter(|op| matches!(op, Op::Dispatch { .. })).count() as u64;
        let index = self.ctx.submit(encoder.finish(), dispatches);
        if let Some(err) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Validation { during: "a step".into(), message: err.to_string() });
        }
        if let (Some(staging), Some(profile)) = (resolved, self.profile) {
            let bytes = staging.read(self.ctx, index.clone(), 16 * timed.len() as u64)?;
            let ticks: Vec<u64> = bytemuck::pod_collect_to_vec(&bytes);
            let period = self.ctx.queue.get_timestamp_period() as f64;
            let times = timed
                .iter()
                .zip(ticks.chunks_exact(2))
                .map(|(&(kernel, family, weight_bytes), t)| Timed {
                    kernel,
                    family,
                    weight_bytes,
                    ns: t[1].saturating_sub(t[0]) as f64 * period,
                })
                .collect();
            profile.submits.push(times);
        }
        Ok(index)
    }
}

/// Split `n` workgroups into a 2-D grid within the per-dimension limit (kernels rebuild the
/// linear index as `wg.y * num_workgroups.x + wg.x`); a limit of 0 counts as 1.
pub fn grid_1d(n: u32, max: u32) -> [u32; 3] {
    let max = max.max(1);
    if n <= max {
        [n, 1, 1]
    } else {
        let y = n.div_ceil(max);
        [n.div_ceil(y), y, 1]
    }
}
