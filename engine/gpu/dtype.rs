//! Element types of weight buffers: the checkpoint dtypes, kept as they are on the GPU.

/// A tensor dtype the engine loads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE f32.
    F32,
    /// bfloat16, kept exact on the GPU (packed two per `u32`).
    BF16,
    /// IEEE f16, packed two per `u32`.
    F16,
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

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
        }
    }

    /// The `W_DTYPE` override value in the shaders.
    pub fn shader_code(self) -> u32 {
        match self {
            Dtype::F32 => 0,
            Dtype::BF16 => 1,
            Dtype::F16 => 2,
        }
    }

    /// Widen little-endian raw bytes to f32 (exact for every supported dtype).
    pub fn to_f32(self, bytes: &[u8]) -> Vec<f32> {
        match self {
            Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
                .collect(),
            Dtype::F16 => {
                bytes.chunks_exact(2).map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()).collect()
            }
        }
    }
}
