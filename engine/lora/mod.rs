//! LoRA adapters: PEFT parsing ([`peft`]), MLX adapters ([`mlx`]), the twelve targetable projections ([`target`]) and the
//! GPU-resident form that sessions bind per (layer, projection) ([`adapter`]).
//!
//! Adapter files are untrusted. The bounds below are checked before anything is allocated or
//! uploaded, so a hostile file is a typed [`crate::AdapterError`], and an adapter that loads
//! gives finite products: with `|w| ≤ MAX_WEIGHT`, `|alpha / r| ≤ MAX_SCALING` and a user scale
//! `|s| ≤ MAX_SCALE`, one LoRA term `s·(alpha/r)·B·(A·x)` of a rank-64 adapter on a 16,384-wide
//! input with activations of 10⁴ is at most 10⁶·64·10⁴·(16,384·10⁴·10⁴) ≈ 10²⁴, far below
//! `f32::MAX` ≈ 3.4·10³⁸.

pub mod adapter;
pub mod mlx;
pub(crate) mod pattern;
pub mod peft;
pub mod set;
pub mod target;

pub use adapter::{AdapterInfo, LoraAdapter, LoraGroup, LoraMember, RankPart};
pub use peft::{ConfigSource, ModuleDelta, ParsedAdapter, PeftConfig};
pub use set::{LayerScales, MAX_SET};
pub use target::{InputGroup, Proj};

/// Largest LoRA rank accepted (config `r`, `rank_pattern`, metadata, tensor shapes, trainable
/// adapters): 256× the ranks real adapters use; [`MAX_ADAPTER_ELEMENTS`] bounds the whole file.
pub const MAX_RANK: usize = 1 << 16;
/// Largest `|alpha / r|` (`|alpha / √r|` with rsLoRA, an MLX `scale`): real PEFT adapters use
/// 0.5–16, 128 at the extreme (alpha 128 at rank 1 with rsLoRA); mlx-lm trains at scale 20.
pub const MAX_SCALING: f64 = 1e3;
/// Largest `|scale|` a session applies an adapter with (1 is the trained strength; ±a few is the
/// useful range).
pub const MAX_SCALE: f32 = 1e3;
/// Most elements over every factor of one adapter, checked from the file's header before any
/// value is read: 2^31 (8 GiB as f32) holds rank 512 on every projection of a 9B model, while a
/// header of many rank-65,536 factors would otherwise have the host hold hundreds of GiB.
pub const MAX_ADAPTER_ELEMENTS: usize = 1 << 31;
/// Largest `|w|` of a `lora_A` / `lora_B` element: A starts at `1/√in` (Kaiming), B at 0, and
/// trained factors stay below ~10; 10⁴ refuses 1e38-style values that overflow in the product.
pub const MAX_WEIGHT: f32 = 1e4;
/// Most entries of `rank_pattern`, `alpha_pattern` and list-valued config fields (a 64-layer
/// model has 768 projections).
pub const MAX_PATTERN_KEYS: usize = 4096;
/// Most patterns of one config that need a compiled regex (each costs ~20 KB; real configs have
/// a handful, since module-name keys are matched without one).
pub const MAX_COMPILED_PATTERNS: usize = 256;
/// Largest `adapter_config.json` read (real ones are a few KiB).
pub const MAX_CONFIG_BYTES: u64 = 4 << 20;
