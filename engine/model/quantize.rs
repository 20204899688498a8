//! Quantization at load: bf16/f16/f32 matrices to MLX's affine layout, with exactly the
//! arithmetic of `mlx.core.quantize` (mlx `backend/cpu/quantized.cpp`), so a checkpoint quantized
//! here holds the same codes, scales and biases as one `mlx_lm.convert` writes.

use crate::gpu::{Affine, AffineData, Dtype, HalfType};

/// Which matrices a load-time quantization converts, and to what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantizeRecipe {
    /// 8-bit, group 64: mlx-lm's default convert with `--q-bits 8`.
    Q8,
    /// 4-bit, group 64: mlx-lm's default convert.
    Q4,
    /// Ours: 4-bit group 64 for the MLP and the GDN `in_proj_qkv`/`in_proj_z`; 8-bit group 64
    /// for the tensors quantization hurts most (the GDN `out_proj`, every attention projection,
    /// the embedding and so the tied lm_head); the tiny per-head GDN gates `in_proj_a`/`in_proj_b`
    /// kept in their 16-bit dtype (as the community recipes and Qwen's own FP8 exclusions do).
    Q4Quality,
}

impl QuantizeRecipe {
    /// The recipe's name on the command line (`q8`, `q4`, `q4-quality`).
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "q8" => Some(QuantizeRecipe::Q8),
            "q4" => Some(QuantizeRecipe::Q4),
            "q4-quality" => Some(QuantizeRecipe::Q4Quality),
            _ => None,
        }
    }

    /// Bits and group of the matrix `name` (its checkpoint name, `….weight`) with `cols`
    /// inputs, or `None` to keep it as it is. mlx-lm's rule for the plain recipes: every Linear
    /// and the embedding whose input width the group divides (conv weights, norms and the GDN
    /// gate parameters are not matrices here and are never quantized).
    pub fn spec(self, name: &str, cols: usize) -> Option<(u32, u32)> {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        let is = |suffixes: &[&str]| suffixes.iter().any(|s| module.ends_with(s));
        let (bits, group) = match self {
            QuantizeRecipe::Q8 => (8, 64),
            QuantizeRecipe::Q4 => (4, 64),
            QuantizeRecipe::Q4Quality if is(&["linear_attn.in_proj_a", "linear_attn.in_proj_b"]) => return None,
            QuantizeRecipe::Q4Quality
                if is(&[
                    "linear_attn.out_proj",
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.o_proj",
                    "embed_tokens",
                    "lm_head",
                ]) =>
            {
                (8, 64)
            }
            QuantizeRecipe::Q4Quality => (4, 64),
        };
        cols.is_multiple_of(group as usize).then_some((bits, group))
    }
}

fn to_half(t: HalfType, v: f32) -> u16 {
    match t {
        HalfType::BF16 => half::bf16::from_f32(v).to_bits(),
        HalfType::F16 => half::f16::from_f32(v).to_bits(),
    }
}

/// The 16-bit type a quantized matrix of `dtype` keeps its scales and biases in: the checkpoint
/// dtype for bf16 and f16 (as mlx), bf16 for f32 (the kernels decode 16-bit scales).
pub fn scale_type(dtype: Dtype) -> HalfType {
    match dtype {
        Dtype::F16 => HalfType::F16,
        _ => HalfType::BF16,
    }
}

/// [`quantize_affine`] of a float matrix's raw bytes, one row widened at a time; `None` if
/// `dtype` is not a float dtype, or `bits` / `group` are not ones the kernels decode
/// ([`Affine::BITS`], [`Affine::GROUPS`]) with `cols` a multiple of `group`, or a row of
/// `cols` values does not fit in `usize` bytes.
pub fn quantize_bytes(bytes: &[u8], dtype: Dtype, cols: usize, bits: u32, group: u32) -> Option<AffineData> {
    let format = Affine { bits, group, scales: scale_type(dtype) };
    if !quantizable(format, cols) {
        return None;
    }
    let row_bytes = dtype.matrix_bytes(1, cols)?;
    let rows = bytes.len() / row_bytes.max(1);
    let mut out = AffineData {
        format,
        words: Vec::with_capacity(rows * cols * bits as usize / 32),
        scales: Vec::with_capacity(rows * cols / group as usize),
        biases: Vec::with_capacity(rows * cols / group as usize),
    };
    for row in bytes.chunks_exact(row_bytes.max(1)) {
        let q = quantize_rows(&dtype.to_f32(row)?, format);
        out.words.extend(q.words);
        out.scales.extend(q.scales);
        out.biases.extend(q.biases);
    }
    Some(out)
}

/// Quantize `values` (`rows × cols`, row-major, the checkpoint's values widened to f32) to
/// `format`: `bits`-bit codes in groups of `group` along each row, scales and biases stored in
/// `format.scales` (the checkpoint dtype for bf16/f16 files). Per group, as mlx does it: the scale spans min to
/// max over `2^bits − 1` steps (at least 1e-7), signed so that the edge of larger magnitude is
/// hit exactly (`q0 = rint(edge / scale)`, then `scale = edge / q0`, `bias = edge`, or bias 0
/// when q0 is 0); codes are `rint((w − bias) / scale)` clamped to the range, with the f32 scale
/// and bias (before they are rounded to 16 bits). `None` unless `bits` and `group` are ones the
/// kernels decode ([`Affine::BITS`], [`Affine::GROUPS`]) and `cols` is a multiple of `group`.
pub fn quantize_affine(values: &[f32], cols: usize, format: Affine) -> Option<AffineData> {
    quantizable(format, cols).then(|| quantize_rows(values, format))
}

/// Whether rows of `cols` inputs quantize to `format`: a width and group the kernels decode, and
/// whole groups.
fn quantizable(format: Affine, cols: usize) -> bool {
    format.decodable() && cols.is_multiple_of(format.group as usize)
}

/// [`quantize_affine`] once [`quantizable`] holds.
fn quantize_rows(values: &[f32], format: Affine) -> AffineData {
    let Affine { bits, group, scales } = format;
    let n_bins = ((1u32 << bits) - 1) as f32;
    let per = (32 / bits) as usize;
    let group = group as usize;
    let mut words = Vec::with_capacity(values.len() / per);
    let mut s_out = Vec::with_capacity(values.len() / group);
    let mut b_out = Vec::with_capacity(values.len() / group);
    for g in values.chunks_exact(group) {
        let (mut w_min, mut w_max) = (f32::INFINITY, f32::NEG_INFINITY);
        for &w in g {
            w_max = w_max.max(w);
            w_min = w_min.min(w);
        }
        let mask = w_min.abs() > w_max.abs();
        let mut scale = ((w_max - w_min) / n_bins).max(1e-7);
        if !mask {
            scale = -scale;
        }
        let edge = if mask { w_min } else { w_max };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0.0;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        for pack in g.chunks_exact(per) {
            let mut word = 0u32;
            for (k, &w) in pack.iter().enumerate() {
                let q = ((w - bias) / scale).round_ties_even().clamp(0.0, n_bins);
                word |= (q as u32) << (k as u32 * bits);
            }
            words.push(word);
        }
        s_out.push(to_half(scales, scale));
        b_out.push(to_half(scales, bias));
    }
    AffineData { format, words, scales: s_out, biases: b_out }
}
