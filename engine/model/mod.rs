//! Loading a Hugging Face Qwen 3.5 checkpoint directory: config, safetensors, typed weights.

mod checkpoint;
pub(crate) mod config;
mod mlx_save;
mod quant;
pub mod quantize;
mod weights;

pub use crate::gpu::Dtype;
pub use checkpoint::{Checkpoint, TensorEntry, MAX_CHECKPOINT_WEIGHT};
pub use config::{LayerType, TextConfig};
pub use mlx_save::{save_mlx, MlxSaveReport};
pub use quant::{QuantConfig, QuantSpec};
pub use quantize::QuantizeRecipe;
pub use weights::{AttnWeights, GdnWeights, Layer, LoadOptions, Mixer, Mlp, Model};
