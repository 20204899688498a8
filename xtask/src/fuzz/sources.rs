//! The valid inputs the fuzzer starts from (tests/fixtures), and the mutation classes.

/// What is being loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A PEFT adapter directory.
    PeftDir,
    /// A lone PEFT `.safetensors` file (its `__metadata__` is its config).
    SingleFile,
    /// An MLX adapter directory.
    MlxDir,
    /// A model checkpoint directory.
    ModelDir,
}

impl Kind {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Kind::PeftDir => "peft-dir",
            Kind::SingleFile => "single-file",
            Kind::MlxDir => "mlx-dir",
            Kind::ModelDir => "model-dir",
        }
    }
}

/// A fixture to mutate.
pub struct Source {
    /// Short name.
    pub name: &'static str,
    /// What it is.
    pub kind: Kind,
    /// Path under tests/fixtures.
    pub rel: &'static str,
    /// The model (under tests/fixtures/models) an adapter is for.
    pub base: &'static str,
}

const fn src(name: &'static str, kind: Kind, rel: &'static str, base: &'static str) -> Source {
    Source { name, kind, rel, base }
}

/// Adapter fixtures and their models.
pub const ADAPTERS: &[Source] = &[
    src("all12_r8", Kind::PeftDir, "adapters/all12_r8", "gva_tied_f32"),
    src("gdn_mlp_r4_rslora", Kind::PeftDir, "adapters/gdn_mlp_r4_rslora", "gva_tied_f32"),
    src("layers_0_3", Kind::PeftDir, "adapters/layers_0_3", "gva_tied_f32"),
    src("patterns_r16", Kind::PeftDir, "adapters/patterns_r16", "gva_tied_f32"),
    src("odd_r4", Kind::PeftDir, "adapters/odd_r4", "odd_untied_f32"),
    src("mlx_q4_lora", Kind::PeftDir, "adapters/mlx_q4_lora", "mlx_q4_g64"),
    src("meta_only", Kind::SingleFile, "adapters/meta_only.safetensors", "gva_tied_f32"),
    src("layers_0_3_file", Kind::SingleFile, "adapters/layers_0_3/adapter_model.safetensors", "gva_tied_f32"),
    src("odd_r4_file", Kind::SingleFile, "adapters/odd_r4/adapter_model.safetensors", "odd_untied_f32"),
    src("mlx_q4_mlx_lora", Kind::MlxDir, "adapters/mlx_q4_mlx_lora", "mlx_q4_g64"),
];

/// Model fixtures.
pub const MODELS: &[Source] = &[
    src("gva_tied_f32", Kind::ModelDir, "models/gva_tied_f32", ""),
    src("odd_untied_f32", Kind::ModelDir, "models/odd_untied_f32", ""),
    src("mlx_q4_g64", Kind::ModelDir, "models/mlx_q4_g64", ""),
    src("vlm_bf16_sharded", Kind::ModelDir, "models/vlm_bf16_sharded", ""),
    src("ct_w4a16_g64", Kind::ModelDir, "models/ct_w4a16_g64", ""),
];

/// Each base model the adapter worker loads, with the good adapter kept active on it.
pub const BASES: &[(&str, &str)] = &[
    ("gva_tied_f32", "adapters/layers_0_3"),
    ("odd_untied_f32", "adapters/odd_r4"),
    ("mlx_q4_g64", "adapters/mlx_q4_mlx_lora"),
];

/// Adapter mutation classes, repeated by weight: input `i` gets `ADAPTER_CLASSES[i % len]`, and
/// its variant (which boundary, which value) is `i / len`, so successive inputs of a class walk
/// its variants in order.
pub const ADAPTER_CLASSES: &[&str] = &[
    "bitflip",
    "bitflip",
    "bitflip",
    "truncate",
    "truncate",
    "header-len",
    "offsets",
    "offsets",
    "dtype",
    "shape",
    "shape",
    "dup-key",
    "key-edit",
    "key-edit",
    "metadata",
    "values",
    "config-value",
    "config-value",
    "config-value",
    "config-text",
    "config-pattern",
    "fs-special",
    "api-scale",
];

/// Model mutation classes (as [`ADAPTER_CLASSES`]).
pub const MODEL_CLASSES: &[&str] = &[
    "bitflip",
    "truncate",
    "header-len",
    "offsets",
    "dtype",
    "shape",
    "dup-key",
    "key-edit",
    "values",
    "config-value",
    "config-value",
    "config-size",
    "config-size",
    "config-text",
    "fs-special",
    "index-json",
];
