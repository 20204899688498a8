//! Running the model: per-session caches and scratch, the layer loop, sampling, generation.

mod adapters;
mod batch;
pub(crate) mod cache;
pub(crate) mod forward;
mod generate;
mod prompt_cache;
mod sampler;
pub(crate) mod session;

pub use adapters::ActiveAdapter;
pub use batch::{Batch, MAX_BATCH_SESSIONS};
pub use cache::rope_table;
pub use generate::{CancelFlag, GenerateParams};
pub use prompt_cache::{PromptCache, PromptCacheStats, MAX_SNAPSHOTS};
pub(crate) use sampler::SplitMix64;
pub use sampler::{argmax, Sampler, MIN_TEMPERATURE};
pub use session::{Logits, Session, SessionOptions, StateSnapshot, MAX_BATCH, MAX_CONTEXT};
