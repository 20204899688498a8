//! The shaders and their entry points: one table each ([`SHADERS`], [`KERNELS`]) with what a
//! pipeline needs (file, entry point, bindings, overrides, variants), and the typed key of the
//! pipeline cache. `kernels/` records dispatches of these entry points.

use crate::gpu::{Access, Dtype, IoSpec};

use Access::{Read as R, ReadWrite as W};

/// A WGSL source file under `wgsl/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shader {
    /// `matmul.wgsl`
    Matmul,
    /// `matvec.wgsl`
    Matvec,
    /// `matvec_batch.wgsl`
    MatvecBatch,
    /// `norm.wgsl`
    Norm,
    /// `attention_prep.wgsl`
    AttentionPrep,
    /// `attention.wgsl`
    Attention,
    /// `gdn_conv.wgsl`
    GdnConv,
    /// `gdn_rule.wgsl`
    GdnRule,
    /// `embed.wgsl`
    Embed,
    /// `swiglu.wgsl`
    Swiglu,
    /// `stream.wgsl`
    Stream,
    /// `ce_grad.wgsl`
    CeGrad,
    /// `matmul_dx.wgsl`
    MatmulDx,
    /// `lora_grad.wgsl`
    LoraGrad,
    /// `backward.wgsl`
    Backward,
    /// `adamw.wgsl`
    Adamw,
    /// `attention_bwd.wgsl`
    AttentionBwd,
    /// `norm_rope_bwd.wgsl`
    NormRopeBwd,
    /// `argmax.wgsl`
    Argmax,
    /// `gdn_step.wgsl`
    GdnStep,
    /// `topk.wgsl`
    Topk,
    /// `attention_one.wgsl`
    AttentionOne,
    /// `matvec_subgroup.wgsl` (appended to `matvec.wgsl`; needs `Features::SUBGROUP`)
    MatvecSubgroup,
}

/// A shader file: its name under `wgsl/` and its text, compiled into the library.
pub struct ShaderDesc {
    /// The shader.
    pub shader: Shader,
    /// The file name under `wgsl/`.
    pub file: &'static str,
    /// The file's own text.
    pub body: &'static str,
}

/// Every shader file, in [`Shader`] order.
pub const SHADERS: [ShaderDesc; 23] = [
    ShaderDesc { shader: Shader::Matmul, file: "matmul.wgsl", body: include_str!("../../wgsl/matmul.wgsl") },
    ShaderDesc { shader: Shader::Matvec, file: "matvec.wgsl", body: include_str!("../../wgsl/matvec.wgsl") },
    ShaderDesc {
        shader: Shader::MatvecBatch,
        file: "matvec_batch.wgsl",
        body: include_str!("../../wgsl/matvec_batch.wgsl"),
    },
    ShaderDesc { shader: Shader::Norm, file: "norm.wgsl", body: include_str!("../../wgsl/norm.wgsl") },
    ShaderDesc {
        shader: Shader::AttentionPrep,
        file: "attention_prep.wgsl",
        body: include_str!("../../wgsl/attention_prep.wgsl"),
    },
    ShaderDesc { shader: Shader::Attention, file: "attention.wgsl", body: include_str!("../../wgsl/attention.wgsl") },
    ShaderDesc { shader: Shader::GdnConv, file: "gdn_conv.wgsl", body: include_str!("../../wgsl/gdn_conv.wgsl") },
    ShaderDesc { shader: Shader::GdnRule, file: "gdn_rule.wgsl", body: include_str!("../../wgsl/gdn_rule.wgsl") },
    ShaderDesc { shader: Shader::Embed, file: "embed.wgsl", body: include_str!("../../wgsl/embed.wgsl") },
    ShaderDesc { shader: Shader::Swiglu, file: "swiglu.wgsl", body: include_str!("../../wgsl/swiglu.wgsl") },
    ShaderDesc { shader: Shader::Stream, file: "stream.wgsl", body: include_str!("../../wgsl/stream.wgsl") },
    ShaderDesc { shader: Shader::CeGrad, file: "ce_grad.wgsl", body: include_str!("../../wgsl/ce_grad.wgsl") },
    ShaderDesc { shader: Shader::MatmulDx, file: "matmul_dx.wgsl", body: include_str!("../../wgsl/matmul_dx.wgsl") },
    ShaderDesc { shader: Shader::LoraGrad, file: "lora_grad.wgsl", body: include_str!("../../wgsl/lora_grad.wgsl") },
    ShaderDesc { shader: Shader::Backward, file: "backward.wgsl", body: include_str!("../../wgsl/backward.wgsl") },
    ShaderDesc { shader: Shader::Adamw, file: "adamw.wgsl", body: include_str!("../../wgsl/adamw.wgsl") },
    ShaderDesc {
        shader: Shader::AttentionBwd,
        file: "attention_bwd.wgsl",
        body: include_str!("../../wgsl/attention_bwd.wgsl"),
    },
    ShaderDesc {
        shader: Shader::NormRopeBwd,
        file: "norm_rope_bwd.wgsl",
        body: include_str!("../../wgsl/norm_rope_bwd.wgsl"),
    },
    ShaderDesc { shader: Shader::Argmax, file: "argmax.wgsl", body: include_str!("../../wgsl/argmax.wgsl") },
    ShaderDesc { shader: Shader::GdnStep, file: "gdn_step.wgsl", body: include_str!("../../wgsl/gdn_step.wgsl") },
    ShaderDesc { shader: Shader::Topk, file: "topk.wgsl", body: include_str!("../../wgsl/topk.wgsl") },
    ShaderDesc {
        shader: Shader::AttentionOne,
        file: "attention_one.wgsl",
        body: include_str!("../../wgsl/attention_one.wgsl"),
    },
    ShaderDesc {
        shader: Shader::MatvecSubgroup,
        file: "matvec_subgroup.wgsl",
        body: include_str!("../../wgsl/matvec_subgroup.wgsl"),
    },
];

impl Shader {
    /// Every shader (the table's order).
    pub fn all() -> impl Iterator<Item = Shader> {
        SHADERS.iter().map(|d| d.shader)
    }

    /// The file name under `wgsl/`.
    pub fn file_name(self) -> &'static str {
        SHADERS[self as usize].file
    }

    /// The WGSL text the device compiles: `prelude.wgsl` (shared helpers), then for the kernels
    /// that read checkpoint weights `weights.wgsl` (the weight binding and decoder), then for
    /// the linear kernels `linear.wgsl` (their parameters and bindings), for the attention
    /// kernels `attention_common.wgsl` (parameters, the head RMS) and for those reading the KV
    /// cache `attention_cached.wgsl` (its bindings, the online softmax), for the shaders with
    /// workgroup tree reductions `reduce.wgsl`, then the file (`matvec_subgroup.wgsl` after the
    /// whole of `matvec.wgsl`, whose kernels it varies).
    pub fn source(self) -> String {
        let mut src = String::from(include_str!("../../wgsl/prelude.wgsl"));
        let linear = matches!(self, Shader::Matmul | Shader::Matvec | Shader::MatvecSubgroup | Shader::MatvecBatch);
        if linear || matches!(self, Shader::Embed | Shader::MatmulDx) {
            src.push_str(include_str!("../../wgsl/weights.wgsl"));
        }
        if linear {
            src.push_str(include_str!("../../wgsl/linear.wgsl"));
        }
        if let Some(base) = self.extends() {
            src.push_str(SHADERS[base as usize].body);
        }
        if matches!(self, Shader::AttentionPrep | Shader::Attention | Shader::AttentionOne) {
            src.push_str(include_str!("../../wgsl/attention_common.wgsl"));
        }
        if matches!(self, Shader::Attention | Shader::AttentionOne) {
            src.push_str(include_str!("../../wgsl/attention_cached.wgsl"));
        }
        if self.reduces() {
            src.push_str(include_str!("../../wgsl/reduce.wgsl"));
        }
        src.push_str(SHADERS[self as usize].body);
        src
    }

    /// Whether the shader takes `reduce.wgsl`'s workgroup tree reductions (over its `const WG`).
    fn reduces(self) -> bool {
        matches!(
            self,
            Shader::Norm
                | Shader::AttentionPrep
                | Shader::Attention
                | Shader::AttentionOne
                | Shader::CeGrad
                | Shader::Backward
                | Shader::Adamw
                | Shader::AttentionBwd
                | Shader::NormRopeBwd
        )
    }

    /// The shader whose whole file this one is appended to (its entry points are in the module
    /// too): `matvec.wgsl` for `matvec_subgroup.wgsl`.
    pub fn extends(self) -> Option<Shader> {
        (self == Shader::MatvecSubgroup).then_some(Shader::Matvec)
    }

    /// Whether the shader uses subgroup operations (compiled only on a device with
    /// `Features::SUBGROUP`; every kernel has a portable twin).
    pub fn needs_subgroups(self) -> bool {
        self == Shader::MatvecSubgroup
    }
}

/// A compute entry point.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Tiled matrix-matrix product (prefill).
    Matmul,
    /// Matrix-vector product (one token).
    Matvec,
    /// `Matmul` with the LoRA expand fused in.
    MatmulLora,
    /// `Matvec` with the LoRA expand fused in.
    MatvecLora,
    /// Matrix product for 2 to 8 tokens with every weight read once (short prompts).
    MatvecBatch,
    /// `MatvecBatch` with the LoRA expand fused in.
    MatvecBatchLora,
    /// RMSNorm with `(1 + w)`.
    RmsNorm,
    /// Gated RMSNorm of the GDN output, in place.
    RmsNormGated,
    /// `RmsNorm` that also writes the LoRA shrink of the normalised rows.
    RmsNormShrink,
    /// q norm + RoPE.
    PrepQ,
    /// k norm + RoPE, K/V cache write.
    PrepKv,
    /// Causal GQA attention with the sigmoid output gate.
    Attend,
    /// GDN causal depthwise conv + SiLU.
    ConvSilu,
    /// GDN gated delta rule.
    DeltaRule,
    /// Embedding gather.
    Embed,
    /// SwiGLU product.
    Swiglu,
    /// Streaming read (bandwidth yardstick).
    StreamRead,
    /// Softmax cross-entropy and its logit gradient, in place.
    CeGrad,
    /// `dx = dy · W` (the input gradient of a linear layer), whole or one slice of its reduction.
    MatmulDx,
    /// The sum of a split `MatmulDx`'s slices into dx.
    MatmulDxSum,
    /// A LoRA weight gradient: a sum of outer products over tokens.
    LoraGrad,
    /// Backward of RMSNorm1p.
    RmsNormBwd,
    /// Backward of SwiGLU.
    SwigluBwd,
    /// Squared norm of a gradient (for clipping).
    SumSquares,
    /// The AdamW update with clipping and the anchor pull.
    AdamW,
    /// Attention backward for the queries and the output gate.
    AttnBwdQ,
    /// Attention backward for the keys and values.
    AttnBwdKv,
    /// Backward of the per-head q/k norm and RoPE.
    NormRopeBwd,
    /// Greedy choice, first pass: one candidate per block of logits.
    ArgmaxBlocks,
    /// Greedy choice, second pass: the chosen id into the next step's input.
    ArgmaxFinal,
    /// GDN conv + delta rule + gated norm for one token.
    GdnDecode,
    /// Sampling candidates: the history's logits copied out and masked.
    TopkMask,
    /// Sampling candidates: the k best of each block of logits.
    TopkBlocks,
    /// Sampling candidates: the k best of the blocks' candidates.
    TopkFinal,
    /// `GdnDecode` that also writes out_proj's LoRA shrink split by head.
    GdnDecodeLora,
    /// One token's attention over a split of the cached keys: q/k norm + RoPE, cache write, the
    /// split's unnormalised part.
    AttendOne,
    /// One token's attention: each head's `AttendOne` parts combined and gated.
    AttendOneMerge,
    /// `AttendOneMerge` that also writes o_proj's LoRA shrink split by head.
    AttendOneMergeLora,
    /// `AttendOne` for each row of a batched step, on pooled caches.
    AttendRows,
    /// `AttendOneMerge` for each row of a batched step.
    AttendRowsMerge,
    /// `AttendRowsMerge` that also writes each row's o_proj LoRA shrink split by head.
    AttendRowsMergeLora,
    /// Embedding gather from a table split in up to 4 bindings, in one dispatch.
    EmbedSplit,
    /// `Matvec` reducing by subgroup shuffles (no barrier).
    MatvecSg,
    /// `MatvecLora` reducing by subgroup shuffles.
    MatvecSgLora,
    /// The subgroup size the device runs `matvec_subgroup.wgsl` with.
    SubgroupSizeProbe,
}

/// Everything the engine knows about one entry point: the one place a kernel is described.
pub struct KernelDesc {
    /// The entry point.
    pub kernel: Kernel,
    /// The shader file holding it.
    pub shader: Shader,
    /// Its name in the file.
    pub entry: &'static str,
    /// Group-0 storage bindings (binding 1 onwards), matching the WGSL declarations.
    pub io: IoSpec,
    /// Whether it binds a group-1 weight buffer.
    pub weights: bool,
    /// Whether it binds a group-2 adapter slot (LoRA B; LoRA A for the split shrinks of
    /// `gdn_decode_lora`, `attend_one_merge_lora` and `attend_rows_merge_lora` and the shrink of
    /// `rms_norm_shrink`).
    pub lora: bool,
    /// Whether the shader has the `ACCUMULATE` override.
    pub accumulate: bool,
    /// Whether the shader has the `W_DTYPE` override.
    pub dtype: bool,
    /// The shape variants it is compiled in (`PipelineKey::variant`).
    pub variants: fn() -> &'static [u32],
}

fn no_variants() -> &'static [u32] {
    &[0]
}

fn matmul_tile_variants() -> &'static [u32] {
    &MATMUL_TILES
}

/// Every entry point, in [`Kernel`] order.
pub const KERNELS: [KernelDesc; 45] = [
    KernelDesc {
        kernel: Kernel::Matmul,
        shader: Shader::Matmul,
        entry: "matmul",
        io: &[R, W],
        weights: true,
        lora: false,
        accumulate: true,
        dtype: true,
        variants: matmul_tile_variants,
    },
    KernelDesc {
        kernel: Kernel::Matvec,
        shader: Shader::Matvec,
        entry: "matvec",
        io: &[R, W, R, R, R],
        weights: true,
        lora: false,
        accumulate: true,
        dtype: true,
        variants: matvec_variants,
    },
    KernelDesc {
        kernel: Kernel::MatmulLora,
        shader: Shader::Matmul,
        entry: "matmul_lora",
        io: &[R, W, R],
        weights: true,
        lora: true,
        accumulate: true,
        dtype: true,
        variants: matmul_tile_variants,
    },
    KernelDesc {
        kernel: Kernel::MatvecLora,
        shader: Shader::Matvec,
        entry: "matvec_lora",
        io: &[R, W, R, R, R],
        weights: true,
        lora: true,
        accumulate: true,
        dtype: true,
        variants: matvec_variants,
    },
    KernelDesc {
        kernel: Kernel::MatvecBatch,
        shader: Shader::MatvecBatch,
        entry: "matvec_batch",
        io: &[R, W, R, R],
        weights: true,
        lora: false,
        accumulate: true,
        dtype: true,
        variants: matvec_batch_variants,
    },
    KernelDesc {
        kernel: Kernel::MatvecBatchLora,
        shader: Shader::MatvecBatch,
        entry: "matvec_batch_lora",
        io: &[R, W, R, R],
        weights: true,
        lora: true,
        accumulate: true,
        dtype: true,
        variants: matvec_batch_variants,
    },
    KernelDesc {
        kernel: Kernel::RmsNorm,
        shader: Shader::Norm,
        entry: "rms_norm",
        io: &[R, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::RmsNormGated,
        shader: Shader::Norm,
        entry: "rms_norm_gated",
        io: &[R, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::RmsNormShrink,
        shader: Shader::Norm,
        entry: "rms_norm_shrink",
        io: &[R, W, W],
        weights: true,
        lora: true,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::PrepQ,
        shader: Shader::AttentionPrep,
        entry: "prep_q",
        io: &[R, R, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::PrepKv,
        shader: Shader::AttentionPrep,
        entry: "prep_kv",
        io: &[R, R, W, R, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::Attend,
        shader: Shader::Attention,
        entry: "attend",
        io: &[R, R, W, W, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::ConvSilu,
        shader: Shader::GdnConv,
        entry: "conv_silu",
        io: &[R, W, R, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::DeltaRule,
        shader: Shader::GdnRule,
        entry: "delta_rule",
        io: &[R, R, R, W, R, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::Embed,
        shader: Shader::Embed,
        entry: "embed",
        io: &[R, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: true,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::Swiglu,
        shader: Shader::Swiglu,
        entry: "swiglu",
        io: &[R, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::StreamRead,
        shader: Shader::Stream,
        entry: "stream_read",
        io: &[R, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::CeGrad,
        shader: Shader::CeGrad,
        entry: "ce_grad",
        io: &[W, R, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::MatmulDx,
        shader: Shader::MatmulDx,
        entry: "matmul_dx",
        io: &[R, W],
        weights: true,
        lora: false,
        accumulate: true,
        dtype: true,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::MatmulDxSum,
        shader: Shader::MatmulDx,
        entry: "matmul_dx_sum",
        io: &[R, W],
        weights: false,
        lora: false,
        accumulate: true,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::LoraGrad,
        shader: Shader::LoraGrad,
        entry: "lora_grad",
        io: &[R, R, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::RmsNormBwd,
        shader: Shader::Backward,
        entry: "rms_norm_bwd",
        io: &[R, R, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::SwigluBwd,
        shader: Shader::Backward,
        entry: "swiglu_bwd",
        io: &[R, R, W, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::SumSquares,
        shader: Shader::Adamw,
        entry: "sum_squares",
        io: &[R, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::AdamW,
        shader: Shader::Adamw,
        entry: "adamw",
        io: &[R, W, W, W, W, R],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::AttnBwdQ,
        shader: Shader::AttentionBwd,
        entry: "attn_bwd_q",
        io: &[R, R, R, R, R, W, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::AttnBwdKv,
        shader: Shader::AttentionBwd,
        entry: "attn_bwd_kv",
        io: &[R, R, R, R, R, W, W, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::NormRopeBwd,
        shader: Shader::NormRopeBwd,
        entry: "norm_rope_bwd",
        io: &[R, R, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::ArgmaxBlocks,
        shader: Shader::Argmax,
        entry: "argmax_blocks",
        io: &[R, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::ArgmaxFinal,
        shader: Shader::Argmax,
        entry: "argmax_final",
        io: &[R, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::GdnDecode,
        shader: Shader::GdnStep,
        entry: "gdn_decode",
        io: &[R, R, W, R, W, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::TopkMask,
        shader: Shader::Topk,
        entry: "topk_mask",
        io: &[W, W, R],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::TopkBlocks,
        shader: Shader::Topk,
        entry: "topk_blocks",
        io: &[W, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::TopkFinal,
        shader: Shader::Topk,
        entry: "topk_final",
        io: &[W, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::GdnDecodeLora,
        shader: Shader::GdnStep,
        entry: "gdn_decode_lora",
        io: &[R, R, W, R, W, W],
        weights: true,
        lora: true,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::AttendOne,
        shader: Shader::AttentionOne,
        entry: "attend_one",
        io: &[R, R, W, W, W, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::AttendOneMerge,
        shader: Shader::AttentionOne,
        entry: "attend_one_merge",
        io: &[R, R, W, W, W, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::AttendOneMergeLora,
        shader: Shader::AttentionOne,
        entry: "attend_one_merge_lora",
        io: &[R, R, W, W, W, W],
        weights: true,
        lora: true,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::AttendRows,
        shader: Shader::AttentionOne,
        entry: "attend_rows",
        io: &[R, R, W, W, W, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::AttendRowsMerge,
        shader: Shader::AttentionOne,
        entry: "attend_rows_merge",
        io: &[R, R, W, W, W, W],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::AttendRowsMergeLora,
        shader: Shader::AttentionOne,
        entry: "attend_rows_merge_lora",
        io: &[R, R, W, W, W, W],
        weights: true,
        lora: true,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::EmbedSplit,
        shader: Shader::Embed,
        entry: "embed_split",
        io: &[R, W, R, R, R],
        weights: true,
        lora: false,
        accumulate: false,
        dtype: true,
        variants: no_variants,
    },
    KernelDesc {
        kernel: Kernel::MatvecSg,
        shader: Shader::MatvecSubgroup,
        entry: "matvec_sg",
        io: &[R, W, R, R, R],
        weights: true,
        lora: false,
        accumulate: true,
        dtype: true,
        variants: matvec_sg_variants,
    },
    KernelDesc {
        kernel: Kernel::MatvecSgLora,
        shader: Shader::MatvecSubgroup,
        entry: "matvec_sg_lora",
        io: &[R, W, R, R, R],
        weights: true,
        lora: true,
        accumulate: true,
        dtype: true,
        variants: matvec_sg_variants,
    },
    KernelDesc {
        kernel: Kernel::SubgroupSizeProbe,
        shader: Shader::MatvecSubgroup,
        entry: "subgroup_size_probe",
        io: &[R, W],
        weights: false,
        lora: false,
        accumulate: false,
        dtype: false,
        variants: no_variants,
    },
];

impl Kernel {
    /// Its description.
    pub fn desc(self) -> &'static KernelDesc {
        &KERNELS[self as usize]
    }

    /// Every entry point (the table's order).
    pub fn all() -> impl Iterator<Item = Kernel> {
        KERNELS.iter().map(|d| d.kernel)
    }

    /// The shader file holding the entry point.
    pub fn shader(self) -> Shader {
        self.desc().shader
    }

    /// The entry point's name.
    pub fn entry(self) -> &'static str {
        self.desc().entry
    }

    /// Group-0 storage bindings (binding 1 onwards), matching the WGSL declarations.
    pub fn io(self) -> IoSpec {
        self.desc().io
    }

    /// Whether the kernel binds a group-1 weight buffer.
    pub fn has_weights(self) -> bool {
        self.desc().weights
    }

    /// Whether the kernel binds a group-2 adapter slot (LoRA B, or A for a split shrink).
    pub fn has_lora(self) -> bool {
        self.desc().lora
    }

    /// The shape variants a kernel is compiled in (`PipelineKey::variant`).
    pub fn variants(self) -> &'static [u32] {
        (self.desc().variants)()
    }
}

/// Typed key of the pipeline cache: the entry point plus its override constants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PipelineKey {
    /// The entry point.
    pub kernel: Kernel,
    /// Weight dtype (`W_DTYPE`), for kernels that read checkpoint-dtype weights.
    pub dtype: Dtype,
    /// `ACCUMULATE` (matmul kernels): add into the output instead of overwriting it.
    pub accumulate: bool,
    /// A kernel-specific shape variant (matvec: `LANES`, the invocations along K per row group;
    /// matvec also `FUSE`, see `matmul::matvec_variant`; matmul: `TM` and `TN`, the tokens and
    /// outputs per tile, see [`matmul_variant`]); 0 for kernels without one. [`Kernel::variants`] lists the valid values.
    pub variant: u32,
}

impl PipelineKey {
    /// A kernel without overrides.
    pub fn plain(kernel: Kernel) -> Self {
        Self { kernel, dtype: Dtype::F32, accumulate: false, variant: 0 }
    }

    /// The override constants this key sets.
    pub fn constants(&self) -> Vec<(&'static str, f64)> {
        let mut c = Vec::new();
        if self.kernel.desc().dtype {
            c.extend(self.dtype.shader_constants());
        }
        if self.kernel.desc().accumulate {
            c.push(("ACCUMULATE", if self.accumulate { 1.0 } else { 0.0 }));
        }
        match self.kernel {
            Kernel::Matvec | Kernel::MatvecLora | Kernel::MatvecSg | Kernel::MatvecSgLora => {
                let (lanes, fuse) = matvec_overrides(self.variant);
                c.push(("LANES", lanes as f64));
                c.push(("NORM", (fuse & 1) as f64));
                c.push(("GLU", (fuse >> 1 & 1) as f64));
                if matches!(self.kernel, Kernel::MatvecSg | Kernel::MatvecSgLora) {
                    c.push(("SPLIT", (fuse >> 2 & 1) as f64));
                }
            }
            Kernel::Matmul | Kernel::MatmulLora => {
                let (tm, tn) = matmul_overrides(self.variant);
                c.push(("TM", tm as f64));
                c.push(("TN", tn as f64));
            }
            Kernel::MatvecBatch | Kernel::MatvecBatchLora => {
                let (lanes, code) = matvec_overrides(self.variant);
                c.push(("LANES", lanes as f64));
                c.push(("TOK", (code & !(MATVEC_BATCH_GLU | MATVEC_BATCH_NORM)) as f64));
                c.push(("GLU", u32::from(code & MATVEC_BATCH_GLU != 0) as f64));
                c.push(("NORM", u32::from(code & MATVEC_BATCH_NORM != 0) as f64));
            }
            _ => {}
        }
        c
    }
}

/// The `LANES` variants of `matvec.wgsl`: invocations along K per row group (rows per workgroup
/// = 8 · 64 / LANES).
pub const MATVEC_LANES: [u32; 4] = [8, 16, 32, 64];

/// The tiles of `matmul.wgsl` as [`matmul_variant`]s: every `TM` with 64 or 128 outputs (4 or 8
/// per invocation).
pub const MATMUL_TILES: [u32; 8] = [
    matmul_variant(16, 64),
    matmul_variant(32, 64),
    matmul_variant(64, 64),
    matmul_variant(128, 64),
    matmul_variant(16, 128),
    matmul_variant(32, 128),
    matmul_variant(64, 128),
    matmul_variant(128, 128),
];

/// The `variant` of a matmul pipeline: `TM` tokens by `TN` outputs per tile.
pub const fn matmul_variant(tm: u32, tn: u32) -> u32 {
    tm | tn << 8
}

/// `TM` and `TN` of a matmul variant.
pub fn matmul_overrides(variant: u32) -> (u32, u32) {
    (variant & 0xff, variant >> 8)
}

/// The `variant` of a matvec pipeline: `LANES` and `FUSE`.
pub fn matvec_variant(lanes: u32, fuse: u32) -> u32 {
    lanes | fuse << 8
}

/// `LANES` and `FUSE` of a matvec pipeline variant.
pub fn matvec_overrides(variant: u32) -> (u32, u32) {
    (variant & 0xff, variant >> 8)
}

/// Every matvec pipeline variant (for the naga translation test).
pub fn matvec_variants() -> &'static [u32] {
    static ALL: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    by_lanes(&ALL, 0..4)
}

/// Every `LANES` paired with every code of `codes` (the variant's second byte), built once into
/// `all`.
fn by_lanes(
    all: &'static std::sync::OnceLock<Vec<u32>>,
    codes: impl IntoIterator<Item = u32> + Clone,
) -> &'static [u32] {
    all.get_or_init(|| {
        MATVEC_LANES.iter().flat_map(|&l| codes.clone().into_iter().map(move |c| matvec_variant(l, c))).collect()
    })
}

/// `FUSE` bit of the subgroup matvec whose row groups span several subgroups (`SPLIT` in
/// `matvec_subgroup.wgsl`).
pub const MATVEC_SPLIT: u32 = 4;

/// Every subgroup-matvec pipeline variant: the matvec's, each also with [`MATVEC_SPLIT`].
pub fn matvec_sg_variants() -> &'static [u32] {
    static ALL: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    by_lanes(&ALL, 0..2 * MATVEC_SPLIT)
}

/// The `TOK` variants of `matvec_batch.wgsl`: token rows per dispatch.
pub const MATVEC_BATCH_TOKENS: [u32; 3] = [2, 4, 8];

/// Bit of a batched-matvec variant's second byte (beside `TOK`): SwiGLU on the way out (`GLU`).
pub const MATVEC_BATCH_GLU: u32 = 16;

/// Bit of a batched-matvec variant's second byte (beside `TOK`): the block's RMSNorm1p of x
/// first (`NORM`).
pub const MATVEC_BATCH_NORM: u32 = 32;

/// Every batched-matvec pipeline variant (`LANES | (TOK | GLU | NORM) << 8`).
pub fn matvec_batch_variants() -> &'static [u32] {
    static ALL: std::sync::OnceLock<Vec<u32>> = std::sync::OnceLock::new();
    let fuses = [0, MATVEC_BATCH_GLU, MATVEC_BATCH_NORM, MATVEC_BATCH_NORM | MATVEC_BATCH_GLU];
    by_lanes(&ALL, MATVEC_BATCH_TOKENS.iter().flat_map(move |&t| fuses.map(|f| t | f)))
}
