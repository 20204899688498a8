//! LoRA adapters: PEFT parsing ([`peft`]), MLX adapters ([`mlx`]), the twelve targetable projections ([`target`]) and the
//! GPU-resident form that sessions bind per (layer, projection) ([`adapter`]).

pub mod adapter;
pub mod mlx;
pub mod peft;
pub mod target;

pub use adapter::{AdapterInfo, LoraAdapter, LoraGroup, LoraMember};
pub use peft::{ConfigSource, ModuleDelta, ParsedAdapter, PeftConfig};
pub use target::{InputGroup, Proj};
