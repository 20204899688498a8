//! The GPU layer: device selection, shared bind-group layouts, the pipeline cache, weight
//! buffers and readback.

mod context;
mod readback;
mod recorder;
mod tensor;

pub use context::{Access, Counters, GpuContext, IoSpec};
pub use readback::{read_f32, read_f32_via, Staging};
pub use recorder::{grid_1d, IoBindCache, Profile, Recorder, Timed};
pub use tensor::{GpuVector, GpuWeight, WeightChunk};
