//! One module per WGSL family: the uniform `Params` mirrored from the shader and the function
//! that records a dispatch. Pipelines are cached by [`PipelineKey`].

pub mod attention;
pub mod gdn;
pub mod learn;
pub mod matmul;
pub mod misc;
pub mod norm;

use crate::gpu::{Access, IoSpec};
use crate::model::Dtype;

use Access::{Read as R, ReadWrite as W};

/// A WGSL source file under `wgsl/`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Shader {
    /// `matmul.wgsl`
    Matmul,
    /// `matvec.wgsl`
    Matvec,
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
}

impl Shader {
    /// Every shader, for the naga translation tests.
    pub const ALL: [Shader; 20] = [
        Shader::Matmul,
        Shader::Matvec,
        Shader::Norm,
        Shader::AttentionPrep,
        Shader::Attention,
        Shader::GdnConv,
        Shader::GdnRule,
        Shader::Embed,
        Shader::Swiglu,
        Shader::Stream,
        Shader::CeGrad,
        Shader::MatmulDx,
        Shader::LoraGrad,
        Shader::Backward,
        Shader::Adamw,
        Shader::AttentionBwd,
        Shader::NormRopeBwd,
        Shader::Argmax,
        Shader::GdnStep,
        Shader::Topk,
    ];

    /// The file name under `wgsl/`.
    pub fn file_name(self) -> &'static str {
        match self {
            Shader::Matmul => "matmul.wgsl",
            Shader::Matvec => "matvec.wgsl",
            Shader::Norm => "norm.wgsl",
            Shader::AttentionPrep => "attention_prep.wgsl",
            Shader::Attention => "attention.wgsl",
            Shader::GdnConv => "gdn_conv.wgsl",
            Shader::GdnRule => "gdn_rule.wgsl",
            Shader::Embed => "embed.wgsl",
            Shader::Swiglu => "swiglu.wgsl",
            Shader::Stream => "stream.wgsl",
            Shader::CeGrad => "ce_grad.wgsl",
            Shader::MatmulDx => "matmul_dx.wgsl",
            Shader::LoraGrad => "lora_grad.wgsl",
            Shader::Backward => "backward.wgsl",
            Shader::Adamw => "adamw.wgsl",
            Shader::AttentionBwd => "attention_bwd.wgsl",
            Shader::NormRopeBwd => "norm_rope_bwd.wgsl",
            Shader::Argmax => "argmax.wgsl",
            Shader::GdnStep => "gdn_step.wgsl",
            Shader::Topk => "topk.wgsl",
        }
    }

    /// The WGSL text the device compiles: `prelude.wgsl` (shared helpers), then for the linear
    /// kernels `linear.wgsl` (their parameters, bindings and weight decoder), then the file.
    pub fn source(self) -> String {
        let mut src = String::from(include_str!("../../wgsl/prelude.wgsl"));
        if matches!(self, Shader::Matmul | Shader::Matvec) {
            src.push_str(include_str!("../../wgsl/linear.wgsl"));
        }
        src.push_str(self.body());
        src
    }

    /// The file's own text, compiled into the library.
    fn body(self) -> &'static str {
        match self {
            Shader::Matmul => include_str!("../../wgsl/matmul.wgsl"),
            Shader::Matvec => include_str!("../../wgsl/matvec.wgsl"),
            Shader::Norm => include_str!("../../wgsl/norm.wgsl"),
            Shader::AttentionPrep => include_str!("../../wgsl/attention_prep.wgsl"),
            Shader::Attention => include_str!("../../wgsl/attention.wgsl"),
            Shader::GdnConv => include_str!("../../wgsl/gdn_conv.wgsl"),
            Shader::GdnRule => include_str!("../../wgsl/gdn_rule.wgsl"),
            Shader::Embed => include_str!("../../wgsl/embed.wgsl"),
            Shader::Swiglu => include_str!("../../wgsl/swiglu.wgsl"),
            Shader::Stream => include_str!("../../wgsl/stream.wgsl"),
            Shader::CeGrad => include_str!("../../wgsl/ce_grad.wgsl"),
            Shader::MatmulDx => include_str!("../../wgsl/matmul_dx.wgsl"),
            Shader::LoraGrad => include_str!("../../wgsl/lora_grad.wgsl"),
            Shader::Backward => include_str!("../../wgsl/backward.wgsl"),
            Shader::Adamw => include_str!("../../wgsl/adamw.wgsl"),
            Shader::AttentionBwd => include_str!("../../wgsl/attention_bwd.wgsl"),
            Shader::NormRopeBwd => include_str!("../../wgsl/norm_rope_bwd.wgsl"),
            Shader::Argmax => include_str!("../../wgsl/argmax.wgsl"),
            Shader::GdnStep => include_str!("../../wgsl/gdn_step.wgsl"),
            Shader::Topk => include_str!("../../wgsl/topk.wgsl"),
        }
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
    /// RMSNorm with `(1 + w)`.
    RmsNorm,
    /// Gated RMSNorm of the GDN output, in place.
    RmsNormGated,
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
    /// `dx = dy · W` (the input gradient of a linear layer).
    MatmulDx,
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
}

impl Kernel {
    /// Every entry point, for the naga translation tests.
    pub const ALL: [Kernel; 30] = [
        Kernel::Matmul,
        Kernel::Matvec,
        Kernel::MatmulLora,
        Kernel::MatvecLora,
        Kernel::RmsNorm,
        Kernel::RmsNormGated,
        Kernel::PrepQ,
        Kernel::PrepKv,
        Kernel::Attend,
        Kernel::ConvSilu,
        Kernel::DeltaRule,
        Kernel::Embed,
        Kernel::Swiglu,
        Kernel::StreamRead,
        Kernel::CeGrad,
        Kernel::MatmulDx,
        Kernel::LoraGrad,
        Kernel::RmsNormBwd,
        Kernel::SwigluBwd,
        Kernel::SumSquares,
        Kernel::AdamW,
        Kernel::AttnBwdQ,
        Kernel::AttnBwdKv,
        Kernel::NormRopeBwd,
        Kernel::ArgmaxBlocks,
        Kernel::ArgmaxFinal,
        Kernel::GdnDecode,
        Kernel::TopkMask,
        Kernel::TopkBlocks,
        Kernel::TopkFinal,
    ];
}

impl Kernel {
    /// The shader file holding the entry point.
    pub fn shader(self) -> Shader {
        match self {
            Kernel::Matmul | Kernel::MatmulLora => Shader::Matmul,
            Kernel::Matvec | Kernel::MatvecLora => Shader::Matvec,
            Kernel::RmsNorm | Kernel::RmsNormGated => Shader::Norm,
            Kernel::PrepQ | Kernel::PrepKv => Shader::AttentionPrep,
            Kernel::Attend => Shader::Attention,
            Kernel::ConvSilu => Shader::GdnConv,
            Kernel::DeltaRule => Shader::GdnRule,
            Kernel::Embed => Shader::Embed,
            Kernel::Swiglu => Shader::Swiglu,
            Kernel::StreamRead => Shader::Stream,
            Kernel::CeGrad => Shader::CeGrad,
            Kernel::MatmulDx => Shader::MatmulDx,
            Kernel::LoraGrad => Shader::LoraGrad,
            Kernel::RmsNormBwd | Kernel::SwigluBwd => Shader::Backward,
            Kernel::SumSquares | Kernel::AdamW => Shader::Adamw,
            Kernel::AttnBwdQ | Kernel::AttnBwdKv => Shader::AttentionBwd,
            Kernel::NormRopeBwd => Shader::NormRopeBwd,
            Kernel::ArgmaxBlocks | Kernel::ArgmaxFinal => Shader::Argmax,
            Kernel::GdnDecode => Shader::GdnStep,
            Kernel::TopkMask | Kernel::TopkBlocks | Kernel::TopkFinal => Shader::Topk,
        }
    }

    /// The entry point's name.
    pub fn entry(self) -> &'static str {
        match self {
            Kernel::Matmul => "matmul",
            Kernel::Matvec => "matvec",
            Kernel::MatmulLora => "matmul_lora",
            Kernel::MatvecLora => "matvec_lora",
            Kernel::RmsNorm => "rms_norm",
            Kernel::RmsNormGated => "rms_norm_gated",
            Kernel::PrepQ => "prep_q",
            Kernel::PrepKv => "prep_kv",
            Kernel::Attend => "attend",
            Kernel::ConvSilu => "conv_silu",
            Kernel::DeltaRule => "delta_rule",
            Kernel::Embed => "embed",
            Kernel::Swiglu => "swiglu",
            Kernel::StreamRead => "stream_read",
            Kernel::CeGrad => "ce_grad",
            Kernel::MatmulDx => "matmul_dx",
            Kernel::LoraGrad => "lora_grad",
            Kernel::RmsNormBwd => "rms_norm_bwd",
            Kernel::SwigluBwd => "swiglu_bwd",
            Kernel::SumSquares => "sum_squares",
            Kernel::AdamW => "adamw",
            Kernel::AttnBwdQ => "attn_bwd_q",
            Kernel::AttnBwdKv => "attn_bwd_kv",
            Kernel::NormRopeBwd => "norm_rope_bwd",
            Kernel::ArgmaxBlocks => "argmax_blocks",
            Kernel::ArgmaxFinal => "argmax_final",
            Kernel::GdnDecode => "gdn_decode",
            Kernel::TopkMask => "topk_mask",
            Kernel::TopkBlocks => "topk_blocks",
            Kernel::TopkFinal => "topk_final",
        }
    }

    /// Group-0 storage bindings (binding 1 onwards), matching the WGSL declarations.
    pub fn io(self) -> IoSpec {
        match self {
            Kernel::Matmul | Kernel::RmsNorm | Kernel::RmsNormGated => &[R, W],
            Kernel::Matvec | Kernel::MatvecLora => &[R, W, R, R],
            Kernel::Embed | Kernel::Swiglu | Kernel::StreamRead => &[R, W],
            Kernel::ArgmaxBlocks | Kernel::ArgmaxFinal => &[R, W],
            Kernel::GdnDecode => &[R, R, W, R, W, W],
            Kernel::TopkMask => &[W, W, R],
            Kernel::TopkBlocks | Kernel::TopkFinal => &[W, W],
            Kernel::MatmulLora => &[R, W, R],
            Kernel::PrepQ => &[R, R, W],
            Kernel::PrepKv => &[R, R, W, R, W],
            Kernel::Attend => &[R, R, R, R, W],
            Kernel::ConvSilu => &[R, W, R, W],
            Kernel::DeltaRule => &[R, R, R, W, R, W],
            Kernel::CeGrad => &[W, R, W],
            Kernel::MatmulDx | Kernel::SumSquares => &[R, W],
            Kernel::LoraGrad | Kernel::RmsNormBwd => &[R, R, W],
            Kernel::SwigluBwd => &[R, R, W, W],
            Kernel::AdamW => &[R, W, W, W, W, R],
            Kernel::AttnBwdQ => &[R, R, R, R, R, W, W],
            Kernel::AttnBwdKv => &[R, R, R, R, R, W, W, W],
            Kernel::NormRopeBwd => &[R, R, W],
        }
    }

    /// Whether the kernel binds a group-1 weight buffer.
    pub fn has_weights(self) -> bool {
        matches!(
            self,
            Kernel::Matmul
                | Kernel::Matvec
                | Kernel::MatmulLora
                | Kernel::MatvecLora
                | Kernel::RmsNorm
                | Kernel::RmsNormGated
                | Kernel::PrepQ
                | Kernel::PrepKv
                | Kernel::ConvSilu
                | Kernel::DeltaRule
                | Kernel::GdnDecode
                | Kernel::Embed
                | Kernel::MatmulDx
                | Kernel::RmsNormBwd
                | Kernel::NormRopeBwd
        )
    }

    /// Whether the kernel binds a group-2 adapter slot (LoRA B).
    pub fn has_lora(self) -> bool {
        matches!(self, Kernel::MatmulLora | Kernel::MatvecLora)
    }

    /// Whether the shader has the `ACCUMULATE` override.
    fn has_accumulate(self) -> bool {
        matches!(self, Kernel::Matmul | Kernel::Matvec | Kernel::MatmulLora | Kernel::MatvecLora | Kernel::MatmulDx)
    }

    /// The shape variants a kernel is compiled in (`PipelineKey::variant`).
    pub fn variants(self) -> &'static [u32] {
        match self {
            Kernel::Matvec | Kernel::MatvecLora => crate::kernels::matmul::matvec_variants(),
            Kernel::Matmul | Kernel::MatmulLora => &crate::kernels::matmul::MATMUL_ROWS,
            _ => &[0],
        }
    }

    fn has_dtype(self) -> bool {
        self.has_accumulate() || self == Kernel::Embed
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
    /// matvec also `FUSE`, see `matmul::matvec_variant`; matmul: `TM`, the tokens per
    /// tile); 0 for kernels without one. [`Kernel::variants`] lists the valid values.
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
        if self.kernel.has_dtype() {
            c.push(("W_DTYPE", self.dtype.shader_code() as f64));
        }
        if self.kernel.has_accumulate() {
            c.push(("ACCUMULATE", if self.accumulate { 1.0 } else { 0.0 }));
        }
        match self.kernel {
            Kernel::Matvec | Kernel::MatvecLora => {
                let (lanes, fuse) = crate::kernels::matmul::matvec_overrides(self.variant);
                c.push(("LANES", lanes as f64));
                c.push(("NORM", (fuse & 1) as f64));
                c.push(("GLU", (fuse >> 1 & 1) as f64));
            }
            Kernel::Matmul | Kernel::MatmulLora => c.push(("TM", self.variant as f64)),
            _ => {}
        }
        c
    }
}
