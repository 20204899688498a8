//! Safetensors files read lazily: headers are parsed and checked up front, tensor bytes are read
//! on demand with one seek each. Files are untrusted: the header size is bounded and every
//! offset is checked against the file length before anything is allocated.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::ModelError;
use crate::io::{open_regular, read_bounded_text, MAX_JSON_BYTES};
use crate::model::Dtype;

/// Largest safetensors JSON header accepted (the reference implementation's bound).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

/// One tensor's place in a file.
#[derive(Clone, Debug)]
pub struct TensorEntry {
    /// The dtype string in the header (`"BF16"`, …).
    pub dtype: String,
    /// The shape.
    pub shape: Vec<usize>,
    /// The checkpoint it belongs to ([`Checkpoint::read`] refuses another's entry).
    checkpoint: u64,
    file: usize,
    begin: u64,
    end: u64,
}

impl TensorEntry {
    /// Elements in the tensor.
    pub fn numel(&self) -> usize {
        // Saturating: the header check bounds the bytes of every known dtype, not of the others.
        self.shape.iter().fold(1usize, |n, &d| n.saturating_mul(d))
    }
}

/// The tensors of one or more safetensors files, by name.
pub struct Checkpoint {
    /// Unique per opened checkpoint, in each of its entries.
    id: u64,
    files: Vec<(PathBuf, u64)>,
    tensors: HashMap<String, TensorEntry>,
    metadata: HashMap<String, String>,
}

impl Checkpoint {
    /// Open `model.safetensors` or every shard of `model.safetensors.index.json` in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self, ModelError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        // `exists` (not `is_file`): a FIFO, device or directory under the name is reported as
        // such by the reader, not as a missing file.
        let files: Vec<PathBuf> = if index.exists() {
            let text = read_text(&index)?;
            let json: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| ModelError::BadJson { file: index.display().to_string(), message: e.to_string() })?;
            let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| ModelError::BadJson {
                file: index.display().to_string(),
                message: "no \"weight_map\" object".into(),
            })?;
            let mut names: Vec<String> = map.values().filter_map(|v| v.as_str().map(String::from)).collect();
            names.sort();
            names.dedup();
            for n in &names {
                // One plain file name: no separator, no `..`, and (on Windows) no drive or root
                // that would make `dir.join` leave the model directory.
                let mut parts = Path::new(n).components();
                let plain = matches!(parts.next(), Some(std::path::Component::Normal(_))) && parts.next().is_none();
                if !plain || n.contains('/') || n.contains('\\') || n.contains("..") {
                    return Err(ModelError::BadJson {
                        file: index.display().to_string(),
                        message: format!("shard name {n:?} is not a plain file name"),
                    });
                }
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            let gguf = std::fs::read_dir(dir)
                .map(|entries| entries.flatten().any(|e| e.path().extension().is_some_and(|x| x == "gguf")))
                .unwrap_or(false);
            if gguf {
                return Err(ModelError::Unsupported {
                    what: format!(
                        "GGUF files in {} (safetensors checkpoints load: Hugging Face, MLX, compressed-tensors)",
                        dir.display()
                    ),
                });
            }
            return Err(ModelError::NoWeights { dir: dir.to_path_buf() });
        };
        Self::open_files(&files)
    }

    /// Open the given safetensors files as one checkpoint.
    pub fn open_files(paths: &[PathBuf]) -> Result<Self, ModelError> {
        let mut files = Vec::new();
        let mut tensors = HashMap::new();
        let mut metadata = HashMap::new();
        for (i, path) in paths.iter().enumerate() {
            let data_start = read_header(path, i, &mut tensors, &mut metadata)?;
            files.push((path.clone(), data_start));
        }
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tensors.values_mut().for_each(|e: &mut TensorEntry| e.checkpoint = id);
        Ok(Self { id, files, tensors, metadata })
    }

    /// The `__metadata__` string map of the header(s).
    pub fn metadata(&self) -> &HashMap<String, String> {
        &self.metadata
    }

    /// The entry for `name`, if present.
    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// Every tensor name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The prefix of the text model's tensors: `model.language_model.` (a Hugging Face VLM
    /// save), `language_model.model.` (MLX) or `model.` (a text-only save).
    pub fn text_prefix(&self) -> &'static str {
        if self.names().any(|n| n.starts_with("model.language_model.")) {
            "model.language_model."
        } else if self.names().any(|n| n.starts_with("language_model.model.")) {
            "language_model.model."
        } else {
            "model."
        }
    }

    /// A tensor's raw little-endian bytes, values unchecked (the adapter parser checks its own
    /// bound and names the value).
    pub(crate) fn read_raw(&self, entry: &TensorEntry) -> Result<Vec<u8>, ModelError> {
        if entry.checkpoint != self.id {
            return Err(ModelError::ForeignEntry { expected: self.id, found: entry.checkpoint });
        }
        let (path, data_start) = self
            .files
            .get(entry.file)
            .ok_or(ModelError::ForeignEntry { expected: self.id, found: entry.checkpoint })?;
        let io = |source| ModelError::Io { path: path.clone(), source };
        let (mut f, _) = open_regular(path, "safetensors file")?;
        f.seek(SeekFrom::Start(data_start + entry.begin)).map_err(io)?;
        let len = usize::try_from(entry.end - entry.begin).unwrap_or(usize::MAX);
        // The header sizes this read: a host that cannot hold it is an error, not an abort.
        let mut buf = Vec::new();
        buf.try_reserve_exact(len).map_err(|_| {
            io(std::io::Error::new(std::io::ErrorKind::OutOfMemory, format!("{len} bytes of tensor data")))
        })?;
        buf.resize(len, 0);
        f.read_exact(&mut buf).map_err(io)?;
        Ok(buf)
    }

    /// Read a tensor's raw little-endian bytes; a float element that is NaN, infinite or above
    /// [`MAX_CHECKPOINT_WEIGHT`] in magnitude is an error naming the tensor.
    pub fn read(&self, entry: &TensorEntry) -> Result<Vec<u8>, ModelError> {
        let buf = self.read_raw(entry)?;
        if let Some(index) = first_bad_weight(&entry.dtype, &buf) {
            let tensor = self
                .tensors
                .iter()
                .find(|(_, e)| e.file == entry.file && e.begin == entry.begin)
                .map_or_else(String::new, |(n, _)| n.clone());
            return Err(ModelError::WeightOutOfRange { tensor, index, limit: MAX_CHECKPOINT_WEIGHT });
        }
        Ok(buf)
    }

    /// Read a tensor as f32 after checking its shape (small parameter vectors).
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let entry = self.checked(name, shape)?;
        let dtype = Dtype::from_safetensors(&entry.dtype)
            .ok_or_else(|| ModelError::UnsupportedDtype { name: name.to_string(), found: entry.dtype.clone() })?;
        dtype
            .to_f32(&self.read(entry)?)
            .ok_or_else(|| ModelError::UnsupportedDtype { name: name.to_string(), found: entry.dtype.clone() })
    }

    /// The entry for `name` after checking it exists with `shape`.
    pub fn checked(&self, name: &str, shape: &[usize]) -> Result<&TensorEntry, ModelError> {
        let entry = self
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.to_string(), candidates: vec![name.to_string()] })?;
        if entry.shape != shape {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: entry.shape.clone(),
            });
        }
        Ok(entry)
    }
}

/// Largest `|w|` of a checkpoint weight. Trained weights stay below ~10² (norm gains, GDN
/// parameters, quantization scales far below); 10⁶ refuses the NaN, infinite and 1e38-style
/// values whose products overflow f32, so a model that loads computes finite logits.
pub const MAX_CHECKPOINT_WEIGHT: f32 = 1e6;

/// The first element of little-endian float data (F32, F64, BF16, F16) that is NaN, infinite or
/// of magnitude above [`MAX_CHECKPOINT_WEIGHT`] (other dtypes have none). For each dtype the magnitude's
/// bits order as the magnitudes do, so one integer compare per element decides.
fn first_bad_weight(dtype: &str, bytes: &[u8]) -> Option<usize> {
    let limit32 = MAX_CHECKPOINT_WEIGHT.to_bits();
    match dtype {
        "F32" => {
            bytes.chunks_exact(4).position(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7fff_ffff > limit32)
        }
        "F64" => {
            let limit = f64::from(MAX_CHECKPOINT_WEIGHT).to_bits();
            bytes.chunks_exact(8).position(|b| {
                u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) & 0x7fff_ffff_ffff_ffff > limit
            })
        }
        "BF16" => {
            let limit = (limit32 >> 16) as u16;
            bytes.chunks_exact(2).position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7fff > limit)
        }
        // The largest finite f16 (65504) is below the bound: only NaN and infinity.
        "F16" => bytes.chunks_exact(2).position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00),
        _ => None,
    }
}

fn read_text(path: &Path) -> Result<String, ModelError> {
    Ok(read_bounded_text(path, MAX_JSON_BYTES, "model.safetensors.index.json")?)
}

/// Bits per element of every dtype the safetensors format defines (`Dtype::bitsize`).
fn dtype_bits(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "C64" | "F64" | "I64" | "U64" => 64,
        "F32" | "I32" | "U32" => 32,
        "F16" | "BF16" | "I16" | "U16" => 16,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 8,
        "F6_E2M3" | "F6_E3M2" => 6,
        "F4" => 4,
        _ => return None,
    })
}

/// One tensor of the header as written: `{"dtype": …, "shape": […], "data_offsets": [b, e]}`
/// (other fields ignored, as the reference parser does).
#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// Parses a header's JSON object in one streaming pass straight into the checkpoint's map: no
/// `serde_json::Value` tree and no copy of the header text (a header of a million vision-tower
/// keys costs its entries only). Every entry is checked as it arrives.
struct HeaderSeed<'a> {
    file: usize,
    data_len: u64,
    tensors: &'a mut HashMap<String, TensorEntry>,
    metadata: &'a mut HashMap<String, String>,
    /// (begin, end) of every tensor of this file, for the layout check.
    spans: &'a mut Vec<(u64, u64)>,
}

impl<'de> serde::de::DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for HeaderSeed<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object of tensor entries")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        use serde::de::Error;
        let mut seen_metadata = false;
        while let Some(name) = map.next_key::<String>()? {
            if name == "__metadata__" {
                if std::mem::replace(&mut seen_metadata, true) {
                    return Err(A::Error::custom("__metadata__ appears twice"));
                }
                // mlx's save_safetensors writes null when there is no metadata.
                let m: Option<HashMap<String, String>> = map
                    .next_value()
                    .map_err(|e| A::Error::custom(format!("__metadata__ is not a map of strings: {e}")))?;
                self.metadata.extend(m.unwrap_or_default());
                continue;
            }
            let e: RawEntry = map.next_value().map_err(|e| A::Error::custom(format!("{name}: {e}")))?;
            let entry = checked_entry(&name, e, self.file, self.data_len).map_err(A::Error::custom)?;
            if self.tensors.contains_key(&name) {
                return Err(A::Error::custom(format!(
                    "tensor {name} appears twice (in this header or an earlier shard's)"
                )));
            }
            self.spans.push((entry.begin, entry.end));
            self.tensors.insert(name, entry);
        }
        Ok(())
    }
}

/// The entry after checking its offsets against the data section and its size against dtype
/// and shape (checked arithmetic).
fn checked_entry(name: &str, e: RawEntry, file: usize, data_len: u64) -> Result<TensorEntry, String> {
    let (begin, end) = e.data_offsets;
    if begin > end || end > data_len {
        return Err(format!("{name}: data_offsets [{begin}, {end}] outside the {data_len}-byte data section"));
    }
    let shape: Vec<usize> = e
        .shape
        .iter()
        .map(|&d| usize::try_from(d).ok())
        .collect::<Option<_>>()
        .ok_or_else(|| format!("{name}: a dimension of shape {:?} does not fit in usize", e.shape))?;
    // Every dtype the safetensors format defines is accepted here, each with the reference
    // parser's size check (a sub-byte tensor ends on a byte boundary); a string it does not
    // define makes the file invalid. Whether the loader can use a tensor's dtype is checked when
    // it is read.
    let Some(bits) = dtype_bits(&e.dtype) else {
        return Err(format!("{name}: dtype {:?} is not a safetensors dtype", e.dtype));
    };
    let nbits = e.shape.iter().try_fold(bits, |acc, &d| acc.checked_mul(d));
    let want = nbits.filter(|b| b % 8 == 0).map(|b| b / 8);
    if want != Some(end - begin) {
        let want = match nbits {
            None => "more than 2^64 bits".to_string(),
            Some(b) if b % 8 != 0 => format!("{b} bits (not whole bytes)"),
            Some(b) => format!("{} bytes", b / 8),
        };
        return Err(format!(
            "{name}: shape {shape:?} of {} needs {want}, data_offsets give {} bytes",
            e.dtype,
            end - begin
        ));
    }
    Ok(TensorEntry { dtype: e.dtype, shape, checkpoint: 0, file, begin, end })
}

/// Read and check the header of file number `file` into `tensors` and `metadata`; returns where
/// its data section starts.
fn read_header(
    path: &Path,
    file: usize,
    tensors: &mut HashMap<String, TensorEntry>,
    metadata: &mut HashMap<String, String>,
) -> Result<u64, ModelError> {
    use serde::de::DeserializeSeed;
    let io = |source| ModelError::Io { path: path.to_path_buf(), source };
    let bad = |message: String| ModelError::BadSafetensors { path: path.to_path_buf(), message };
    let (mut f, file_len) = open_regular(path, "safetensors file")?;
    // The length field is file content (the first 8 bytes of whatever a symlink points at):
    // errors print the file's size and the bounds, never the field.
    if file_len < 8 {
        return Err(bad(format!("file of {file_len} bytes is shorter than the 8-byte header length")));
    }
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(io)?;
    let header_len = u64::from_le_bytes(n);
    if header_len == 0 {
        return Err(bad("the header length is 0".into()));
    }
    if header_len > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "the header length exceeds the {MAX_HEADER_BYTES}-byte bound (file of {file_len} bytes)"
        )));
    }
    if header_len > file_len - 8 {
        return Err(bad(format!("the header length runs past the end of the {file_len}-byte file")));
    }
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;
    let mut spans = Vec::new();
    let seed = HeaderSeed { file, data_len, tensors, metadata, spans: &mut spans };
    // Exactly header_len bytes: the JSON must end there (trailing spaces are the writers' padding).
    let reader = std::io::BufReader::new((&mut f).take(header_len));
    let mut de = serde_json::Deserializer::from_reader(reader);
    seed.deserialize(&mut de).and_then(|()| de.end()).map_err(|e| bad(format!("header is not valid: {e}")))?;
    check_layout(&mut spans, data_len).map_err(|m| {
        // Name the tensor at fault (only on this error path: the spans carry no names).
        let named = tensors.iter().find(|(_, e)| e.file == file && m.at == (e.begin, e.end));
        bad(match named {
            Some((name, _)) => format!("{name}: {}", m.message),
            None => m.message,
        })
    })?;
    Ok(data_start)
}

/// A layout error and the span it is about.
struct LayoutError {
    at: (u64, u64),
    message: String,
}

/// The tensors must tile the data section exactly, as the reference parser requires: sorted by
/// offset, each begins where the previous ends, the first at 0 and the last at the end of the
/// file. A header length one byte off then fails here instead of loading every weight shifted.
fn check_layout(spans: &mut [(u64, u64)], data_len: u64) -> Result<(), LayoutError> {
    spans.sort_unstable();
    let mut at = 0u64;
    for &(begin, end) in spans.iter() {
        if begin != at {
            let message = if begin < at {
                format!("data_offsets [{begin}, {end}] overlap the tensor before it (which ends at {at})")
            } else {
                format!("data_offsets [{begin}, {end}] leave a gap after byte {at}")
            };
            return Err(LayoutError { at: (begin, end), message });
        }
        at = end;
    }
    if at != data_len {
        return Err(LayoutError {
            at: (u64::MAX, u64::MAX),
            message: format!(
                "the tensors end at byte {at} of a {data_len}-byte data section (header length or file size is off)"
            ),
        });
    }
    Ok(())
}
