//! Qwen 3.5 inference on the GPU through wgpu, with WGSL kernels.
//!
//! Scope: the Qwen 3.5 dense text decoder (Gated DeltaNet + gated attention layers) loaded from a
//! Hugging Face checkpoint directory (VLM or text-only layout, sharded or not, f32/bf16/f16),
//! batched prefill and cached decode, greedy and seeded sampling, text in and out with the
//! model's tokenizer and chat template, PEFT LoRA adapters resident on the GPU and switched by
//! bind group, and learning from feedback into a live LoRA adapter ([`learn`]).
//!
//! Not done yet: MoE variants (typed `Unsupported`), vision inputs, learning below the last
//! layer.
//!
//! ```no_run
//! use std::sync::Arc;
//! use qwen35_wgpu::{GpuContext, Model, Session, SessionOptions, GenerateParams};
//! let ctx = Arc::new(GpuContext::new()?);
//! let model = Arc::new(Model::load(ctx, "path/to/Qwen3.5-0.8B".as_ref())?);
//! let mut session = Session::new(model, SessionOptions::default())?;
//! let tokens = session.generate(&[1, 2, 3], &GenerateParams::default(), |_| true)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod backend;
pub mod error;
pub mod gpu;
pub mod io;
pub mod kernels;
pub mod learn;
pub mod lora;
pub mod model;
#[doc(hidden)]
pub mod reference;
pub mod runtime;
pub mod text;
mod wgpu_backend;

pub use backend::{ActiveAdapterInfo, AdapterId, AdapterSwitch, AdapterWeight, BackendError, LlmBackend, ModelInfo};
pub use error::{AdapterError, FileError, GpuError, LearnError, ModelError, RunError};
pub use gpu::{GpuContext, GpuOptions, Subgroups};
pub use learn::{FeedbackEvent, LearnOptions, LearnReport, Signal, TokenEvent, TrainSpec};
pub use lora::{AdapterInfo, LayerScales, LoraAdapter, Proj};
pub use model::{LoadOptions, Model, QuantizeRecipe, TextConfig};
pub use runtime::{ActiveAdapter, Batch, CancelFlag, GenerateParams, Logits, Sampler, Session, SessionOptions};
pub use text::{ChatDelta, ChatMessage, ChatPrompt, ChatReply, ChatRequest, TextError, TextTokenizer, ToolCall};
pub use wgpu_backend::{SessionId, WgpuBackend, DEFAULT_SNAPSHOT_BUDGET, MAX_SESSIONS};
