//! Running the model: per-session caches and scratch, the layer loop, sampling, generation.

mod cache;
mod forward;
mod generate;
mod sampler;
mod session;

pub use cache::rope_table;
pub use generate::GenerateParams;
pub use sampler::{argmax, Sampler};
pub use session::{ActiveAdapter, Logits, Session, SessionOptions};
