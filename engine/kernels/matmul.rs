//! Every nn.Linear: `matmul.wgsl` (tiled, several tokens) or `matvec.wgsl` (one token).

use crate::error::GpuError;
use crate::gpu::{grid_1d, GpuWeight, Recorder};
use crate::kernels::{Kernel, PipelineKey};

/// Mirrors `Params` in `matmul.wgsl`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub struct MatmulParams {
    /// Rows of x (tokens).
    pub m: u32,
    /// Rows of this weight chunk.
    pub n: u32,
    /// Input features.
    pub k: u32,
    /// First element of x.
    pub x_offset: u32,
    /// Row stride of x.
    pub x_stride: u32,
    /// Element of y where row 0, column 0 of this chunk goes.
    pub y_offset: u32,
    /// Row stride of y.
    pub y_stride: u32,
    /// LoRA rank r (0 without an adapter).
    pub lora_rank: u32,
    /// First column of this projection's rank in t.
    pub lora_t_offset: u32,
    /// Row stride of t (the input group's total rank).
    pub lora_t_stride: u32,
    /// Row of B where this weight chunk starts.
    pub lora_row_offset: u32,
    /// The adapter's effective scale (user scale × alpha / r).
    pub lora_scale: f32,
    /// Epsilon of the fused RMSNorm (matvec).
    pub eps: f32,
}

/// The block norm a single-token linear layer applies to x first (`NORM` in `matvec.wgsl`).
#[derive(Clone, Copy)]
pub struct FusedNorm<'a> {
    /// The RMSNorm1p weight `[K]` (f32).
    pub weight: &'a wgpu::Buffer,
    /// Epsilon.
    pub eps: f32,
}

/// What a single-token linear layer fuses in, saving the dispatches that would do it.
#[derive(Clone, Copy)]
pub struct Fuse<'a> {
    /// The block's RMSNorm1p of x, before the product.
    pub norm: Option<FusedNorm<'a>>,
    /// SwiGLU after the product (`GLU`): `y = silu(y) · result`, y holding gate_proj's output
    /// (up_proj writing into it).
    pub glu: bool,
}

impl Fuse<'_> {
    /// Nothing fused.
    pub const NONE: Fuse<'static> = Fuse { norm: None, glu: false };

    /// The `variant` bits: 1 = norm, 2 = SwiGLU.
    pub fn code(&self) -> u32 {
        u32::from(self.norm.is_some()) | u32::from(self.glu) << 1
    }
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
    ALL.get_or_init(|| MATVEC_LANES.iter().flat_map(|&l| (0..4).map(move |f| matvec_variant(l, f))).collect())
}

/// The LoRA expand fused into a linear layer: `y += scale · t[:, offset..offset+r] · Bᵀ`.
pub struct LoraExpand<'a> {
    /// Shrink output `[m, t_stride]` (`t = x · Aᵀ` for the whole input group).
    pub t: &'a wgpu::Buffer,
    /// First column of this projection's rank in t.
    pub t_offset: usize,
    /// Row stride of t.
    pub t_stride: usize,
    /// Rank r.
    pub rank: usize,
    /// Effective scale.
    pub scale: f32,
    /// Group-2 bind group over B `[out, r]` (f32).
    pub b: &'a wgpu::BindGroup,
}

/// Where a linear layer reads and writes.
pub struct LinearIo<'a> {
    /// Input activations `[m, k]`, row stride `k`.
    pub x: &'a wgpu::Buffer,
    /// First element of x.
    pub x_offset: usize,
    /// Tokens.
    pub m: usize,
    /// Output `[m, y_stride]`.
    pub y: &'a wgpu::Buffer,
    /// First element of y.
    pub y_offset: usize,
    /// Row stride of y (the layer's output width unless writing into a wider buffer).
    pub y_stride: usize,
    /// Add into y instead of overwriting it (fused residual add).
    pub accumulate: bool,
}

/// The `LANES` variants of `matvec.wgsl`: invocations along K per row group (rows per workgroup
/// = 8 · 64 / LANES).
pub const MATVEC_LANES: [u32; 4] = [8, 16, 32, 64];

/// Invocations along K for a chunk of `n` rows: the most rows per workgroup (64, 32, 16, then 8)
/// that still gives the device `min_groups` workgroups. More rows per workgroup read x once for
/// more rows, stream 128 contiguous bytes per row and step (8 lanes × 16 bytes) and leave fewer
/// partial sums to reduce; fewer rows keep a narrow projection (the LoRA shrinks: a few dozen
/// rows) spread over the device.
pub fn matvec_lanes(n: usize, min_groups: usize) -> u32 {
    for lanes in [8, 16, 32] {
        if n.div_ceil(8 * 64 / lanes as usize) >= min_groups {
            return lanes;
        }
    }
    64
}

/// The `TM` variants of `matmul.wgsl`: tokens per tile.
pub const MATMUL_ROWS: [u32; 2] = [64, 128];

/// Tokens per matmul tile for `m` tokens: 128 (8 × 4 outputs per invocation) unless half a
/// tile would be rows computed only to be dropped.
pub fn matmul_rows(m: usize) -> u32 {
    if m <= 64 {
        64
    } else {
        128
    }
}

/// Record `y (+)= x Wᵀ [+ s·t·Bᵀ]`, one dispatch per weight chunk. Without `lora` the plain
/// pipelines run (no LoRA code at all).
pub fn linear(rec: &mut Recorder, w: &GpuWeight, io: &LinearIo, lora: Option<&LoraExpand>) -> Result<(), GpuError> {
    linear_with(rec, w, io, lora, Fuse::NONE)
}

/// [`linear`] with a fused norm or SwiGLU; those exist for single-token steps only.
pub fn linear_with(
    rec: &mut Recorder,
    w: &GpuWeight,
    io: &LinearIo,
    lora: Option<&LoraExpand>,
    fuse: Fuse,
) -> Result<(), GpuError> {
    let bad = if fuse.code() != 0 && io.m != 1 {
        Some(format!("a fused norm or SwiGLU needs one token, got {}", io.m))
    } else if fuse.glu && io.accumulate {
        Some("SwiGLU cannot also accumulate".to_string())
    } else {
        None
    };
    if let Some(message) = bad {
        return Err(GpuError::Validation { during: "recording a linear layer".into(), message });
    }
    let (eps, aux) = fuse.norm.map_or((0.0, io.x), |n| (n.eps, n.weight));
    let kernel = match (io.m == 1, lora.is_some()) {
        (true, false) => Kernel::Matvec,
        (false, false) => Kernel::Matmul,
        (true, true) => Kernel::MatvecLora,
        (false, true) => Kernel::MatmulLora,
    };
    let max = rec.ctx().limits.max_compute_workgroups_per_dimension;
    for chunk in &w.chunks {
        let variant = if io.m == 1 {
            matvec_variant(matvec_lanes(chunk.rows, rec.ctx().min_workgroups()), fuse.code())
        } else {
            matmul_rows(io.m)
        };
        let key = PipelineKey { kernel, dtype: w.dtype, accumulate: io.accumulate, variant };
        let params = MatmulParams {
            m: io.m as u32,
            n: chunk.rows as u32,
            k: w.cols as u32,
            x_offset: io.x_offset as u32,
            x_stride: w.cols as u32,
            y_offset: (io.y_offset + chunk.row_start) as u32,
            y_stride: io.y_stride as u32,
            lora_rank: lora.map_or(0, |l| l.rank as u32),
            lora_t_offset: lora.map_or(0, |l| l.t_offset as u32),
            lora_t_stride: lora.map_or(0, |l| l.t_stride as u32),
            lora_row_offset: chunk.row_start as u32,
            lora_scale: lora.map_or(0.0, |l| l.scale),
            eps,
        };
        let groups = if io.m == 1 {
            grid_1d((chunk.rows as u32).div_ceil(8 * 64 / matvec_overrides(variant).0), max)
        } else {
            [(chunk.rows as u32).div_ceil(64), (io.m as u32).div_ceil(variant), 1]
        };
        match (lora, io.m == 1) {
            (None, false) => rec.dispatch(key, &params, &[io.x, io.y], &[&chunk.bind_group], groups)?,
            (Some(l), false) => rec.dispatch(key, &params, &[io.x, io.y, l.t], &[&chunk.bind_group, l.b], groups)?,
            // matvec binds t and the norm weight always (x where unused).
            (None, true) => rec.dispatch(key, &params, &[io.x, io.y, io.x, aux], &[&chunk.bind_group], groups)?,
            (Some(l), true) => {
                rec.dispatch(key, &params, &[io.x, io.y, l.t, aux], &[&chunk.bind_group, l.b], groups)?
            }
        }
        rec.weight_bytes(chunk.buffer.size());
    }
    Ok(())
}
