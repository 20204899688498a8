//! The GPU layer: device selection, shared bind-group layouts, the shader and entry-point tables
//! with the pipeline cache, weight buffers and readback.

mod context;
mod dtype;
mod readback;
mod recorder;
mod registry;
mod tensor;

pub use context::{Access, Counters, GpuContext, GpuOptions, IoSpec, Subgroups};
pub use dtype::{Affine, Dtype, HalfType};
pub use readback::{read_f32, read_f32_many, read_f32_via, Staging};
pub use recorder::{grid_1d, IoBindCache, Profile, Recorder, Timed};
pub use registry::{
    matmul_overrides, matmul_variant, matvec_batch_variants, matvec_overrides, matvec_sg_variants, matvec_variant,
    matvec_variants, Kernel, KernelDesc, PipelineKey, Shader, ShaderDesc, KERNELS, MATMUL_TILES, MATVEC_BATCH_GLU,
    MATVEC_BATCH_NORM, MATVEC_BATCH_TOKENS, MATVEC_LANES, MATVEC_SPLIT, SHADERS,
};
pub use tensor::{AffineData, GpuVector, GpuWeight, WeightChunk};
