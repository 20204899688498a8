//! Element types of weight buffers: the checkpoint dtypes, kept as they are on the GPU, and the
//! affine-quantized layout of MLX checkpoints.

/// The 16-bit float type of affine scales and biases (the checkpoint's activation dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HalfType {
    /// bfloat16.
    BF16,
    /// IEEE f16.
    F16,
}

/// Affine quantization as MLX stores it: `bits`-bit unsigned codes packed low bits first into
/// `u32` words along the input, and per group of `group` inputs a scale and a bias, so that
/// `w = scale · q + bias`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Affine {
    /// Bits per weight: 4 or 8.
    pub bits: u32,
    /// Inputs per scale/bias pair: 32, 64 or 128.
    pub group: u32,
    /// The dtype of the scales and biases.
    pub scales: HalfType,
}

impl Affine {
    /// The bit widths the kernels decode.
    pub const BITS: [u32; 2] = [4, 8];
    /// The group sizes the kernels decode.
    pub const GROUPS: [u32; 3] = [32, 64, 128];

    /// Bytes of packed codes plus one `u32` (scale, bias) per group, for a row of `cols` inputs.
    pub fn row_bytes(self, cols: usize) -> usize {
        cols * self.bits as usize / 8 + cols / self.group as usize * 4
    }

    /// Whether the kernels decode this format: bits in [`Affine::BITS`], group in
    /// [`Affine::GROUPS`].
    pub fn decodable(self) -> bool {
        Self::BITS.contains(&self.bits) && Self::GROUPS.contains(&self.group)
    }
}

/// A tensor dtype the engine loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE f32.
    F32,
    /// bfloat16, kept exact on the GPU (packed two per `u32`).
    BF16,
    /// IEEE f16, packed two per `u32`.
    F16,
    /// Affine-quantized (matrices only; see [`Affine`]).
    Affine(Affine),
}

impl Dtype {
    /// Parse a safetensors dtype string; `None` for dtypes the engine does not load.
    pub fn from_safetensors(s: &str) -> Option<Self> {
        match s {
            "F32" => Some(Dtype::F32),
            "BF16" => Some(Dtype::BF16),
            "F16" => Some(Dtype::F16),
            _ => None,
        }
    }

    /// Bytes on the GPU for one row of `cols` elements.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            Dtype::F32 => 4 * cols,
            Dtype::BF16 | Dtype::F16 => 2 * cols,
            Dtype::Affine(a) => a.row_bytes(cols),
        }
    }

    /// Bytes of `rows` rows of `cols` elements ([`Dtype::row_bytes`] each); `None` past `usize`.
    pub fn matrix_bytes(self, rows: usize, cols: usize) -> Option<usize> {
        let row = match self {
            Dtype::F32 => cols.checked_mul(4)?,
            Dtype::BF16 | Dtype::F16 => cols.checked_mul(2)?,
            Dtype::Affine(a) => {
                (cols.checked_mul(a.bits as usize)? / 8).checked_add(cols / a.group.max(1) as usize * 4)?
            }
        };
        rows.checked_mul(row)
    }

    /// The override constants of the weight decoder (`weights.wgsl`): `W_DTYPE`, then for
    /// affine weights `Q_BITS`, `Q_GROUP` and `Q_F16` (their defaults otherwise).
    pub fn shader_constants(self) -> [(&'static str, f64); 4] {
        let (code, bits, group, f16) = match self {
            Dtype::F32 => (0, 4, 64, false),
            Dtype::BF16 => (1, 4, 64, false),
            Dtype::F16 => (2, 4, 64, false),
            Dtype::Affine(a) => (3, a.bits, a.group, a.scales == HalfType::F16),
        };
        [("W_DTYPE", code as f64), ("Q_BITS", bits as f64), ("Q_GROUP", group as f64), ("Q_F16", f16 as u32 as f64)]
    }

    /// Widen little-endian raw bytes of a float dtype to f32 (exact); `None` for affine data,
    /// which needs its scales and biases.
    pub fn to_f32(self, bytes: &[u8]) -> Option<Vec<f32>> {
        Some(match self {
            Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            Dtype::F16 => {
                bytes.chunks_exact(2).map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()).collect()
            }
            Dtype::Affine(_) => return None,
        })
    }
}

impl HalfType {
    /// Parse a safetensors dtype string (`BF16`, `F16`); `None` for any other.
    pub fn from_safetensors(s: &str) -> Option<Self> {
        match s {
            "BF16" => Some(HalfType::BF16),
            "F16" => Some(HalfType::F16),
            _ => None,
        }
    }

    /// Widen one value.
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            HalfType::BF16 => half::bf16::from_bits(bits).to_f32(),
            HalfType::F16 => half::f16::from_bits(bits).to_f32(),
        }
    }
}
