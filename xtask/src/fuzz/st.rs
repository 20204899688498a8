//! Safetensors files taken apart and put back together, for mutations that keep the data section
//! but edit the header (the JSON is re-serialised and the length field recomputed).

use serde_json::{Map, Value};

/// A parsed safetensors file.
pub struct St {
    /// The header object (tensor entries and `__metadata__`).
    pub header: Map<String, Value>,
    /// The data section.
    pub data: Vec<u8>,
    /// The header's length field as found.
    pub header_len: u64,
}

/// One tensor entry: name, dtype, shape, data offsets.
pub struct Entry {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub begin: u64,
    pub end: u64,
}

impl St {
    /// Parse `bytes` (a valid file: the fixtures).
    pub fn parse(bytes: &[u8]) -> Option<Self> {
        let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let header_end = 8usize.checked_add(usize::try_from(n).ok()?)?;
        let header: Map<String, Value> = serde_json::from_slice(bytes.get(8..header_end)?).ok()?;
        Some(Self { header, data: bytes[header_end..].to_vec(), header_len: n })
    }

    /// The tensor entries in header order.
    pub fn entries(&self) -> Vec<Entry> {
        self.header
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .filter_map(|(k, v)| {
                let offs = v.get("data_offsets")?.as_array()?;
                Some(Entry {
                    name: k.clone(),
                    dtype: v.get("dtype")?.as_str()?.to_string(),
                    shape: v.get("shape")?.as_array()?.iter().filter_map(Value::as_u64).collect(),
                    begin: offs.first()?.as_u64()?,
                    end: offs.get(1)?.as_u64()?,
                })
            })
            .collect()
    }

    /// The header as JSON text.
    pub fn header_text(&self) -> String {
        serde_json::to_string(&self.header).unwrap_or_default()
    }

    /// The file with this header and data.
    pub fn to_bytes(&self) -> Vec<u8> {
        assemble(&self.header_text(), &self.data)
    }
}

/// A file of `header` (padded with spaces to a multiple of 8, as the reference writer does) and
/// `data`, with a correct length field.
pub fn assemble(header: &str, data: &[u8]) -> Vec<u8> {
    let mut h = header.as_bytes().to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + data.len());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

/// Byte size of a safetensors dtype.
pub fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        _ => return None,
    })
}

/// `value` in `dtype`'s little-endian encoding (floats only; others get the f32 bits truncated).
pub fn encode(dtype: &str, value: f32) -> Vec<u8> {
    match dtype {
        "F32" => value.to_le_bytes().to_vec(),
        "F64" => (value as f64).to_le_bytes().to_vec(),
        "BF16" => ((value.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        "F16" => half_bits(value).to_le_bytes().to_vec(),
        _ => value.to_le_bytes()[..dtype_size(dtype).unwrap_or(1).min(4) as usize].to_vec(),
    }
}

/// IEEE half bits of `v` (NaN, infinities and overflow kept as such; no rounding subtleties
/// needed for hostile values).
fn half_bits(v: f32) -> u16 {
    let b = v.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32;
    let man = b & 0x7f_ffff;
    if exp == 0xff {
        return sign | 0x7c00 | if man != 0 { 0x200 } else { 0 };
    }
    let e = exp - 127 + 15;
    if e >= 0x1f {
        sign | 0x7c00
    } else if e <= 0 {
        sign
    } else {
        sign | ((e as u16) << 10) | (man >> 13) as u16
    }
}
