//! Device selection and the caches every model on a device shares.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::GpuError;
use crate::gpu::{read_f32, IoBindCache, Kernel, PipelineKey, Recorder, Shader};

/// How a storage binding of group 0 is accessed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// `var<storage, read>`
    Read,
    /// `var<storage, read_write>`
    ReadWrite,
}

/// The storage bindings of a kernel's group 0, in binding order starting at 1 (binding 0 is
/// always the per-dispatch uniform, bound with a dynamic offset).
pub type IoSpec = &'static [Access];

/// Bytes reserved per dispatch in the uniform arena; every kernel's `Params` fits.
pub const PARAMS_SLOT: u64 = 256;

/// Which optional device features the engine may use ([`GpuContext::with_options`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuOptions {
    /// Subgroup operations (wgpu's `SUBGROUP`): the one-token matvec reduces its partial sums by
    /// subgroup shuffles instead of workgroup memory and a barrier.
    pub subgroups: Subgroups,
}

/// When the subgroup kernels run ([`GpuOptions::subgroups`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Subgroups {
    /// Never: the portable kernels only.
    Off,
    /// Where the adapter has `SUBGROUP` (the default): a row group wider than the subgroup sums
    /// its subgroups' shuffled sums in workgroup memory after one barrier (`SPLIT`).
    #[default]
    Auto,
    /// Where the adapter has `SUBGROUP`, for every shape, with row groups wider than the
    /// subgroup kept in one subgroup (the others idle: exact but slower, the path a device whose
    /// pipelines get a narrower subgroup than measured takes; for testing it on any device).
    Always,
}

/// A wgpu device with the layouts, shader modules and pipelines built on it.
pub struct GpuContext {
    /// The device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// What the adapter says about itself.
    pub info: wgpu::AdapterInfo,
    /// The limits the device was created with.
    pub limits: wgpu::Limits,
    /// The optional features the device was created with (those of the adapter among the ones
    /// the engine can use: `TIMESTAMP_QUERY` for per-kernel profiles, `SUBGROUP` unless
    /// [`GpuOptions::subgroups`] is off).
    pub features: wgpu::Features,
    subgroup_size: Option<u32>,
    subgroups: Subgroups,
    weights_layout: wgpu::BindGroupLayout,
    io_layouts: Mutex<HashMap<IoSpec, wgpu::BindGroupLayout>>,
    modules: Mutex<HashMap<Shader, wgpu::ShaderModule>>,
    pipelines: Mutex<HashMap<PipelineKey, wgpu::ComputePipeline>>,
    uploaded: AtomicU64,
    allocated: AtomicU64,
    dispatches: AtomicU64,
    submits: AtomicU64,
    read_back: AtomicU64,
}

/// What the engine has asked of the device so far (see [`GpuContext::counters`]); the difference
/// of two snapshots is what the work between them cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Compute dispatches recorded and submitted.
    pub dispatches: u64,
    /// Command buffers submitted to the queue.
    pub submits: u64,
    /// Bytes copied GPU → host.
    pub read_back: u64,
}

/// What happened between two readings, `later - earlier` (saturating: the other way round gives 0).
impl std::ops::Sub for Counters {
    type Output = Counters;
    fn sub(self, o: Counters) -> Counters {
        Counters {
            dispatches: self.dispatches.saturating_sub(o.dispatches),
            submits: self.submits.saturating_sub(o.submits),
            read_back: self.read_back.saturating_sub(o.read_back),
        }
    }
}

impl GpuContext {
    /// Open the adapter chosen by `WGPU_BACKEND` / `WGPU_ADAPTER_NAME` (else the default
    /// high-performance adapter) and create a device with WebGPU's default limits, raised only
    /// where the adapter allows and the engine benefits (binding and buffer sizes).
    pub fn new() -> Result<Self, GpuError> {
        Self::with_options(GpuOptions::default())
    }

    /// [`GpuContext::new`] with the optional features `options` allows.
    pub fn with_options(options: GpuOptions) -> Result<Self, GpuError> {
        pollster::block_on(Self::new_async(options))
    }

    async fn new_async(options: GpuOptions) -> Result<Self, GpuError> {
        let desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
        let backends = format!("{:?}", desc.backends);
        let instance = wgpu::Instance::new(desc);
        let adapter = match std::env::var("WGPU_ADAPTER_NAME") {
            Ok(wanted) if !wanted.is_empty() => {
                let adapters = instance.enumerate_adapters(wgpu::Backends::all()).await;
                let found: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
                let lower = wanted.to_lowercase();
                adapters
                    .into_iter()
                    .find(|a| a.get_info().name.to_lowercase().contains(&lower))
                    .ok_or(GpuError::AdapterNameNotFound { wanted, found })?
            }
            _ => instance
                .request_adapter(&wgpu::RequestAdapterOptions {
                    power_preference: wgpu::PowerPreference::from_env()
                        .unwrap_or(wgpu::PowerPreference::HighPerformance),
                    ..Default::default()
                })
                .await
                .map_err(|_| GpuError::NoAdapter { backends })?,
        };
        Self::from_adapter(adapter, options).await
    }

    async fn from_adapter(adapter: wgpu::Adapter, options: GpuOptions) -> Result<Self, GpuError> {
        let info = adapter.get_info();
        let have = adapter.limits();
        let limits = wgpu::Limits {
            max_storage_buffer_binding_size: have.max_storage_buffer_binding_size,
            max_buffer_size: have.max_buffer_size,
            ..Default::default()
        };
        // Optional features, each behind a capability check: timestamps for `--profile`,
        // subgroups for the matvec's reduction.
        let mut wanted = wgpu::Features::TIMESTAMP_QUERY;
        if options.subgroups != Subgroups::Off {
            wanted |= wgpu::Features::SUBGROUP;
        }
        let features = adapter.features() & wanted;
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("qwen35-wgpu"),
                required_features: features,
                required_limits: limits.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| GpuError::RequestDevice(e.to_string()))?;
        log::info!("GPU adapter: {} ({:?}, {:?})", info.name, info.backend, info.device_type);
        // Work that matters runs inside error scopes that become typed errors; anything else is
        // logged instead of wgpu's default panic, so an embedding application never aborts.
        device.on_uncaptured_error(std::sync::Arc::new(|e| log::error!("uncaptured wgpu error: {e}")));
        let weights_layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("weights"),
            entries: &[storage_entry(0, true)],
        });
        let mut ctx = Self {
            device,
            queue,
            info,
            limits,
            features,
            subgroup_size: None,
            subgroups: options.subgroups,
            weights_layout,
            io_layouts: Mutex::new(HashMap::new()),
            modules: Mutex::new(HashMap::new()),
            pipelines: Mutex::new(HashMap::new()),
            uploaded: AtomicU64::new(0),
            allocated: AtomicU64::new(0),
            dispatches: AtomicU64::new(0),
            submits: AtomicU64::new(0),
            read_back: AtomicU64::new(0),
        };
        if features.contains(wgpu::Features::SUBGROUP) {
            // The feature is optional: a device that cannot run the probe runs the portable
            // kernels (tests/kernels.rs checks that a device with the feature uses it).
            ctx.subgroup_size = ctx.measure_subgroup_size().unwrap_or_else(|e| {
                log::warn!("subgroup kernels off: {e}");
                None
            });
            log::info!("subgroup size {:?}", ctx.subgroup_size);
        }
        Ok(ctx)
    }

    /// The subgroup size `matvec_subgroup.wgsl` runs with on this device, measured once (a
    /// power of two from 4 to 128, the subgroups full and numbering the invocations in order),
    /// else `None` (no usable subgroups: the portable kernels run).
    fn measure_subgroup_size(&self) -> Result<Option<u32>, GpuError> {
        let mut cache = IoBindCache::with_arena(self, "probe arena", PARAMS_SLOT);
        let x = self.storage_buffer("probe x", 16, true)?;
        let y = self.storage_buffer("probe y", 16, true)?;
        let mut rec = Recorder::new(self, &mut cache);
        rec.dispatch(PipelineKey::plain(Kernel::SubgroupSizeProbe), &[0u32; 4], &[&x, &y], &[], [1, 1, 1])?;
        rec.submit()?;
        let got = read_f32(self, &y, 0, 2)?;
        let (size, irregular) = (got.first().copied().unwrap_or(0.0) as u32, got.get(1).copied().unwrap_or(1.0));
        Ok((size.is_power_of_two() && (4..=128).contains(&size) && irregular == 0.0).then_some(size))
    }

    /// The subgroup size the subgroup kernels run with, when the device has subgroups and
    /// [`GpuOptions::subgroups`] allowed them.
    pub fn subgroup_size(&self) -> Option<u32> {
        self.subgroup_size
    }

    /// Whether a one-token matvec whose row groups are `lanes` wide runs the subgroup kernel
    /// (None: the portable one), and if so whether with `SPLIT` (row groups wider than the
    /// subgroup the device measured, under [`Subgroups::Auto`]).
    pub fn subgroup_matvec(&self, lanes: u32) -> Option<bool> {
        let size = self.subgroup_size?;
        Some(self.subgroups == Subgroups::Auto && lanes > size)
    }

    /// Workgroups a dispatch should have to keep the device busy (kernels with a shape choice
    /// pick the largest workgroup tile that still gives this many). wgpu reports no core count:
    /// a CPU adapter (lavapipe) runs a workgroup per host thread, so twice the host's cores; a GPU
    /// gets 128 (four per core on a 32-core GPU).
    pub fn min_workgroups(&self) -> usize {
        if self.is_cpu() {
            2 * std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            128
        }
    }

    /// Bytes written host → GPU through this context so far (weights, adapters, per-step
    /// uniforms and token ids); benchmarks read it to show that an adapter swap uploads nothing.
    pub fn bytes_uploaded(&self) -> u64 {
        self.uploaded.load(Ordering::Relaxed)
    }

    /// Bytes of storage buffers created through this context so far (weights, adapters, caches,
    /// scratch; uniform and readback buffers aside): a running total, which buffers dropped since
    /// (a closed session's caches, an unloaded adapter) do not lower. Read it before and after
    /// creating something to learn what that holds.
    pub fn bytes_allocated(&self) -> u64 {
        self.allocated.load(Ordering::Relaxed)
    }

    /// Write `bytes` into `buffer` at `offset`, counted by [`GpuContext::bytes_uploaded`].
    pub fn write(&self, buffer: &wgpu::Buffer, offset: u64, bytes: &[u8]) {
        self.uploaded.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.queue.write_buffer(buffer, offset, bytes);
    }

    /// Submit one command buffer holding `dispatches` compute dispatches (counted).
    pub fn submit(&self, commands: wgpu::CommandBuffer, dispatches: u64) -> wgpu::SubmissionIndex {
        self.submits.fetch_add(1, Ordering::Relaxed);
        self.dispatches.fetch_add(dispatches, Ordering::Relaxed);
        self.queue.submit([commands])
    }

    /// Wait until submission `index` has run (not for anything submitted after it).
    pub fn wait_for(&self, index: wgpu::SubmissionIndex) -> Result<(), GpuError> {
        self.device
            .poll(wgpu::PollType::Wait { submission_index: Some(index), timeout: None })
            .map(|_| ())
            .map_err(|e| GpuError::Readback(e.to_string()))
    }

    /// Count `bytes` read back to the host.
    pub fn count_read_back(&self, bytes: u64) {
        self.read_back.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Dispatches, submits and bytes read back so far, counted where the engine does them.
    pub fn counters(&self) -> Counters {
        Counters {
            dispatches: self.dispatches.load(Ordering::Relaxed),
            submits: self.submits.load(Ordering::Relaxed),
            read_back: self.read_back.load(Ordering::Relaxed),
        }
    }

    /// True when the adapter is a software rasteriser (lavapipe, llvmpipe, WARP).
    pub fn is_cpu(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// The largest storage binding, in bytes.
    pub fn max_binding(&self) -> u64 {
        self.limits.max_storage_buffer_binding_size.min(self.limits.max_buffer_size)
    }

    /// Layout of group 1 (one read-only storage buffer: a weight chunk or parameter vector),
    /// shared by group 2 (the adapter slot: LoRA B of one projection).
    pub fn weights_layout(&self) -> &wgpu::BindGroupLayout {
        &self.weights_layout
    }

    /// The shared group-0 layout for a kernel's storage bindings.
    pub fn io_layout(&self, spec: IoSpec) -> wgpu::BindGroupLayout {
        let mut map = self.io_layouts.lock().unwrap_or_else(|e| e.into_inner());
        map.entry(spec)
            .or_insert_with(|| {
                let mut entries = vec![wgpu::BindGroupLayoutEntry {
                    binding: 0,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: true,
                        min_binding_size: None,
                    },
                    count: None,
                }];
                for (i, access) in spec.iter().enumerate() {
                    entries.push(storage_entry(i as u32 + 1, *access == Access::Read));
                }
                self.device
                    .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some("io"), entries: &entries })
            })
            .clone()
    }

    /// A group-1 bind group over one whole buffer.
    pub fn weights_bind_group(&self, buffer: &wgpu::Buffer, label: &str) -> wgpu::BindGroup {
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(label),
            layout: &self.weights_layout,
            entries: &[wgpu::BindGroupEntry { binding: 0, resource: buffer.as_entire_binding() }],
        })
    }

    /// The compute pipeline for `key`, created on first use.
    pub fn pipeline(&self, key: PipelineKey) -> Result<wgpu::ComputePipeline, GpuError> {
        if let Some(p) = self.pipelines.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
            return Ok(p.clone());
        }
        let kernel = key.kernel;
        let module = self.module(kernel.shader())?;
        let io = self.io_layout(kernel.io());
        let mut layouts: Vec<Option<&wgpu::BindGroupLayout>> = vec![Some(&io)];
        if kernel.has_weights() {
            layouts.push(Some(&self.weights_layout));
        }
        if kernel.has_lora() {
            layouts.push(Some(&self.weights_layout));
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let layout = self.device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(kernel.entry()),
            bind_group_layouts: &layouts,
            immediate_size: 0,
        });
        let constants = key.constants();
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(kernel.entry()),
            layout: Some(&layout),
            module: &module,
            entry_point: Some(kernel.entry()),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants: &constants,
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        if let Some(err) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Validation {
                during: format!("creating pipeline {key:?}"),
                message: err.to_string(),
            });
        }
        self.pipelines.lock().unwrap_or_else(|e| e.into_inner()).insert(key, pipeline.clone());
        Ok(pipeline)
    }

    fn module(&self, shader: Shader) -> Result<wgpu::ShaderModule, GpuError> {
        let mut map = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(m) = map.get(&shader) {
            return Ok(m.clone());
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(shader.file_name()),
            source: wgpu::ShaderSource::Wgsl(shader.source().into()),
        });
        if let Some(err) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Validation {
                during: format!("compiling {}", shader.file_name()),
                message: err.to_string(),
            });
        }
        map.insert(shader, module.clone());
        Ok(module)
    }

    /// Create a storage buffer, checking the size against the device limits first.
    pub fn storage_buffer(&self, label: &str, size: u64, binding: bool) -> Result<wgpu::Buffer, GpuError> {
        // A multiple of 16 bytes, so every buffer can also be bound as an array of vec4.
        let size = size.max(16).next_multiple_of(16);
        let limit = if binding { self.max_binding() } else { self.limits.max_buffer_size };
        if size > limit {
            return Err(GpuError::BufferTooLarge { name: label.to_string(), needed: size, limit });
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        match pollster::block_on(scope.pop()) {
            Some(err) => Err(GpuError::Validation {
                during: format!("allocating {label} ({size} bytes)"),
                message: err.to_string(),
            }),
            None => {
                self.allocated.fetch_add(size, Ordering::Relaxed);
                Ok(buffer)
            }
        }
    }

    /// Create a storage buffer holding `bytes` (zero-padded to a multiple of 16).
    pub fn upload(&self, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer, GpuError> {
        let buffer = self.storage_buffer(label, bytes.len() as u64, true)?;
        let whole = bytes.len() / 4 * 4;
        if whole > 0 {
            self.write(&buffer, 0, &bytes[..whole]);
        }
        if whole < bytes.len() {
            let mut tail = [0u8; 4];
            tail[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
            self.write(&buffer, whole as u64, &tail);
        }
        Ok(buffer)
    }
}

fn storage_entry(binding: u32, read_only: bool) -> wgpu::BindGroupLayoutEntry {
    wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }
}
