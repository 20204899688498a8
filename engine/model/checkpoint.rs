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
                if n.contains('/') || n.contains('\\') || n.contains("..") {
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
            let header = read_header(path, i)?;
            files.push((path.clone(), header.data_start));
            for (name, entry) in header.entries {
                if tensors.contains_key(&name) {
                    return Err(ModelError::BadSafetensors {
                        path: path.clone(),
                        message: format!("tensor {name} appears twice (in this header or an earlier shard's)"),
                    });
                }
                tensors.insert(name, entry);
            }
            metadata.extend(header.metadata);
        }
        Ok(Self { files, tensors, metadata })
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

    /// Read a tensor's raw little-endian bytes.
    pub fn read(&self, entry: &TensorEntry) -> Result<Vec<u8>, ModelError> {
        let (path, data_start) = &self.files[entry.file];
        let io = |source| ModelError::Io { path: path.clone(), source };
        let (mut f, _) = open_regular(path, "safetensors file")?;
        f.seek(SeekFrom::Start(data_start + entry.begin)).map_err(io)?;
        let mut buf = vec![0u8; (entry.end - entry.begin) as usize];
        f.read_exact(&mut buf).map_err(io)?;
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

fn read_text(path: &Path) -> Result<String, ModelError> {
    Ok(read_bounded_text(path, MAX_JSON_BYTES, "model.safetensors.index.json")?)
}

fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
        _ => return None,
    })
}

struct Header {
    data_start: u64,
    entries: Vec<(String, TensorEntry)>,
    metadata: HashMap<String, String>,
}

/// One tensor of the header as written: `{"dtype": …, "shape": […], "data_offsets": [b, e]}`
/// (other fields ignored, as the reference parser does).
#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// What the header's JSON object holds, parsed in one pass without an intermediate tree (a
/// header of a million vision-tower keys costs its entries, not a `serde_json::Value` each).
struct RawHeader {
    entries: Vec<(String, RawEntry)>,
    metadata: HashMap<String, String>,
}

impl<'de> serde::Deserialize<'de> for RawHeader {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawHeader;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<RawHeader, A::Error> {
                use serde::de::Error;
                let mut entries = Vec::new();
                let mut metadata = None;
                while let Some(name) = map.next_key::<String>()? {
                    if name == "__metadata__" {
                        if metadata.is_some() {
                            return Err(A::Error::custom("__metadata__ appears twice"));
                        }
                        // mlx's save_safetensors writes null when there is no metadata.
                        let m: Option<HashMap<String, String>> = map
                            .next_value()
                            .map_err(|e| A::Error::custom(format!("__metadata__ is not a map of strings: {e}")))?;
                        metadata = Some(m.unwrap_or_default());
                        continue;
                    }
                    let entry: RawEntry = map.next_value().map_err(|e| A::Error::custom(format!("{name}: {e}")))?;
                    entries.push((name, entry));
                }
                Ok(RawHeader { entries, metadata: metadata.unwrap_or_default() })
            }
        }
        d.deserialize_map(V)
    }
}

fn read_header(path: &Path, file: usize) -> Result<Header, ModelError> {
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
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).map_err(io)?;
    let raw: RawHeader = serde_json::from_slice(&header).map_err(|e| bad(format!("header is not valid: {e}")))?;
    drop(header);
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;
    let mut out = Vec::with_capacity(raw.entries.len());
    for (name, e) in raw.entries {
        let (begin, end) = e.data_offsets;
        if begin > end || end > data_len {
            return Err(bad(format!("{name}: data_offsets [{begin}, {end}] outside the {data_len}-byte data section")));
        }
        let shape: Vec<usize> = e
            .shape
            .iter()
            .map(|&d| usize::try_from(d).ok())
            .collect::<Option<_>>()
            .ok_or_else(|| bad(format!("{name}: a dimension of shape {:?} does not fit in usize", e.shape)))?;
        let numel = e.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        // A dtype this parser does not know (a future float8 in a vision tower, say) is only an
        // error if the tensor is read; its bytes still take their place in the data section.
        if let Some(size) = dtype_size(&e.dtype) {
            let want = numel.and_then(|n| n.checked_mul(size));
            if want != Some(end - begin) {
                let want = want.map_or("more than 2^64".to_string(), |w| w.to_string());
                return Err(bad(format!(
                    "{name}: shape {shape:?} of {} needs {want} bytes, data_offsets give {}",
                    e.dtype,
                    end - begin
                )));
            }
        }
        let entry = TensorEntry { dtype: e.dtype, shape, file, begin, end };
        out.push((name, entry));
    }
    check_layout(&out, data_len).map_err(bad)?;
    Ok(Header { data_start, entries: out, metadata: raw.metadata })
}

/// The tensors must tile the data section exactly, as the reference parser requires: sorted by
/// offset, each begins where the previous ends, the first at 0 and the last at the end of the
/// file. A header length one byte off then fails here instead of loading every weight shifted.
fn check_layout(entries: &[(String, TensorEntry)], data_len: u64) -> Result<(), String> {
    let mut spans: Vec<(u64, u64, usize)> =
        entries.iter().enumerate().map(|(i, (_, e))| (e.begin, e.end, i)).collect();
    spans.sort_unstable();
    let mut at = 0u64;
    for &(begin, end, i) in &spans {
        if begin != at {
            let name = &entries[i].0;
            return Err(if begin < at {
                format!("{name}: data_offsets [{begin}, {end}] overlap the tensor before it (which ends at {at})")
            } else {
                format!("{name}: data_offsets [{begin}, {end}] leave a gap after byte {at}")
            });
        }
        at = end;
    }
    if at != data_len {
        return Err(format!(
            "the tensors end at byte {at} of a {data_len}-byte data section (header length or file size is off)"
        ));
    }
    Ok(())
}
