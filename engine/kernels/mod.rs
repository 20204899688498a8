//! One module per WGSL family: the uniform `Params` mirrored from the shader and the function
//! that records a dispatch. The entry points themselves are described in one table,
//! `gpu::registry` (re-exported here); pipelines are cached by [`PipelineKey`].

pub mod attention;
pub mod gdn;
pub mod learn;
pub mod matmul;
pub mod misc;
pub mod norm;

pub use crate::gpu::{Kernel, KernelDesc, PipelineKey, Shader, ShaderDesc, KERNELS, SHADERS};
