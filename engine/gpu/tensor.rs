//! Weights on the GPU. Matrices keep their checkpoint dtype (bf16/f16 packed two per `u32`,
//! widened in the shader; affine-quantized codes with their scales and biases); a matrix larger
//! than one storage binding is split by rows.

use crate::error::GpuError;
use crate::gpu::{Affine, Dtype, GpuContext};

/// One row range of a weight matrix, in its own buffer and bind group.
pub struct WeightChunk {
    /// First row (output feature) held by this chunk.
    pub row_start: usize,
    /// Rows held.
    pub rows: usize,
    /// Their dtype.
    pub dtype: Dtype,
    /// The bytes of those rows, in the checkpoint dtype. Affine weights: the packed codes of
    /// every row, then from `u32` index `sb` one word per (row, group): the scale in the low
    /// 16 bits, the bias in the high 16 bits.
    pub buffer: wgpu::Buffer,
    /// Affine weights: the `u32` index of the first (scale, bias) word (a multiple of 4); 0
    /// otherwise.
    pub sb: u32,
    /// Group-1 bind group over `buffer`.
    pub bind_group: wgpu::BindGroup,
}

/// An affine-quantized matrix on the host, as MLX stores it: `rows × cols·bits/32` packed codes,
/// `rows × cols/group` scales and biases (16-bit, of `format.scales`).
#[derive(Clone, Debug)]
pub struct AffineData {
    /// Bits, group and scale dtype.
    pub format: Affine,
    /// Packed codes, low bits first along each row.
    pub words: Vec<u32>,
    /// Scale of each (row, group).
    pub scales: Vec<u16>,
    /// Bias of each (row, group).
    pub biases: Vec<u16>,
}

/// A `[rows, cols]` matrix (nn.Linear weight or embedding table) on the GPU.
pub struct GpuWeight {
    /// The checkpoint dtype, kept exactly: every chunk's, or the first chunk's when a
    /// concatenated weight joins projections of different dtypes ([`GpuWeight::concat`];
    /// kernels use [`WeightChunk::dtype`]).
    pub dtype: Dtype,
    /// Rows (output features / vocabulary entries).
    pub rows: usize,
    /// Columns (input features / hidden size).
    pub cols: usize,
    /// Row chunks, each within the device's storage binding limit.
    pub chunks: Vec<WeightChunk>,
}

/// Rows per chunk for rows of `row_bytes` within `max_chunk_bytes` and the binding limit.
fn rows_per_chunk(ctx: &GpuContext, name: &str, row_bytes: u64, max_chunk_bytes: u64) -> Result<usize, GpuError> {
    // Room for the 16-byte alignment of an affine chunk's scales.
    let limit = max_chunk_bytes.min(ctx.max_binding().saturating_sub(16));
    if row_bytes > limit {
        return Err(GpuError::BufferTooLarge { name: name.to_string(), needed: row_bytes, limit });
    }
    Ok((limit / row_bytes.max(1)).max(1) as usize)
}

fn check_len(name: &str, what: &'static str, expected: usize, found: usize) -> Result<(), GpuError> {
    if expected != found {
        return Err(GpuError::WeightSize { name: name.to_string(), what, expected, found });
    }
    Ok(())
}

impl GpuWeight {
    /// Upload `[rows, cols]` raw bytes of the float dtype `dtype`, split into chunks of at most
    /// `max_chunk_bytes` (the binding limit unless a test asks for less).
    pub fn upload(
        ctx: &GpuContext,
        name: &str,
        dtype: Dtype,
        rows: usize,
        cols: usize,
        bytes: &[u8],
        max_chunk_bytes: u64,
    ) -> Result<Self, GpuError> {
        if let Dtype::Affine(_) = dtype {
            return Err(GpuError::WeightSize {
                name: name.to_string(),
                what: "codes without scales",
                expected: 0,
                found: bytes.len(),
            });
        }
        let total = dtype.matrix_bytes(rows, cols).ok_or_else(|| GpuError::WeightShape {
            name: name.to_string(),
            rows,
            cols,
            dtype: format!("{dtype:?}"),
        })?;
        check_len(name, "data (bytes)", total, bytes.len())?;
        let row_bytes = dtype.row_bytes(cols);
        let per = rows_per_chunk(ctx, name, row_bytes as u64, max_chunk_bytes)?;
        let mut chunks = Vec::new();
        let mut row_start = 0;
        while row_start < rows {
            let n = per.min(rows - row_start);
            let begin = row_start * row_bytes;
            let label = format!("{name}[{row_start}..{}]", row_start + n);
            let buffer = ctx.upload(&label, &bytes[begin..begin + n * row_bytes])?;
            let bind_group = ctx.weights_bind_group(&buffer, &label);
            chunks.push(WeightChunk { row_start, rows: n, dtype, buffer, sb: 0, bind_group });
            row_start += n;
        }
        Ok(Self { dtype, rows, cols, chunks })
    }

    /// Upload an affine-quantized `[rows, cols]` matrix.
    pub fn upload_affine(
        ctx: &GpuContext,
        name: &str,
        rows: usize,
        cols: usize,
        data: &AffineData,
        max_chunk_bytes: u64,
    ) -> Result<Self, GpuError> {
        let (a, words, scales, biases) = (data.format, &data.words, &data.scales, &data.biases);
        if !a.decodable() {
            return Err(GpuError::AffineFormat { name: name.to_string(), bits: a.bits, group: a.group });
        }
        if Dtype::Affine(a).matrix_bytes(rows, cols).is_none() {
            return Err(GpuError::WeightShape { name: name.to_string(), rows, cols, dtype: format!("{a:?}") });
        }
        let row_words = cols * a.bits as usize / 32;
        let groups = cols / a.group as usize;
        check_len(name, "codes (u32)", rows * row_words, words.len())?;
        check_len(name, "scales", rows * groups, scales.len())?;
        check_len(name, "biases", rows * groups, biases.len())?;
        let per = rows_per_chunk(ctx, name, a.row_bytes(cols) as u64, max_chunk_bytes)?;
        let mut chunks = Vec::new();
        let mut row_start = 0;
        while row_start < rows {
            let n = per.min(rows - row_start);
            let sb = (n * row_words).next_multiple_of(4);
            let mut data = Vec::with_capacity(sb + n * groups);
            data.extend_from_slice(&words[row_start * row_words..(row_start + n) * row_words]);
            data.resize(sb, 0);
            let g = row_start * groups..(row_start + n) * groups;
            data.extend(scales[g.clone()].iter().zip(&biases[g]).map(|(&s, &b)| s as u32 | (b as u32) << 16));
            let label = format!("{name}[{row_start}..{}]", row_start + n);
            let buffer = ctx.upload(&label, bytemuck::cast_slice(&data))?;
            let bind_group = ctx.weights_bind_group(&buffer, &label);
            chunks.push(WeightChunk { row_start, rows: n, dtype: Dtype::Affine(a), buffer, sb: sb as u32, bind_group });
            row_start += n;
        }
        Ok(Self { dtype: Dtype::Affine(a), rows, cols, chunks })
    }

    /// The weights `parts` (same columns) as one, rows in order: their chunks, renumbered. A
    /// row range of one part's dtype runs in that dtype's kernels (one dispatch per chunk).
    pub fn concat(parts: Vec<GpuWeight>) -> Option<GpuWeight> {
        let first = parts.first()?;
        let (dtype, cols) = (first.dtype, first.cols);
        let mut rows = 0;
        let mut chunks = Vec::new();
        for part in parts {
            if part.cols != cols {
                return None;
            }
            for mut c in part.chunks {
                c.row_start += rows;
                chunks.push(c);
            }
            rows += part.rows;
        }
        Some(GpuWeight { dtype, rows, cols, chunks })
    }

    /// Bytes held on the GPU.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.buffer.size()).sum()
    }
}

/// A small f32 parameter vector (norm weights, conv taps, gate parameters) with its group-1
/// bind group.
pub struct GpuVector {
    /// The buffer.
    pub buffer: wgpu::Buffer,
    /// Group-1 bind group over it.
    pub bind_group: wgpu::BindGroup,
}

impl GpuVector {
    /// Upload f32 values.
    pub fn upload(ctx: &GpuContext, name: &str, values: &[f32]) -> Result<Self, GpuError> {
        let buffer = ctx.upload(name, bytemuck::cast_slice(values))?;
        let bind_group = ctx.weights_bind_group(&buffer, name);
        Ok(Self { buffer, bind_group })
    }
}
