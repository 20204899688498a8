//! Safetensors files read lazily: headers are parsed and checked up front, tensor bytes are read
//! on demand with one seek each. Files are untrusted: the header size is bounded and every
//! offset is checked against the file length before anything is allocated.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::ModelError;
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
        self.shape.iter().product()
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
        let files: Vec<PathBuf> = if index.is_file() {
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
        } else if single.is_file() {
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
            tensors.extend(header.entries);
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
        let mut f = File::open(path).map_err(io)?;
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
    std::fs::read_to_string(path).map_err(|source| ModelError::Io { path: path.to_path_buf(), source })
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

fn read_header(path: &Path, file: usize) -> Result<Header, ModelError> {
    let io = |source| ModelError::Io { path: path.to_path_buf(), source };
    let bad = |message: String| ModelError::BadSafetensors { path: path.to_path_buf(), message };
    let mut f = File::open(path).map_err(io)?;
    let file_len = f.metadata().map_err(io)?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad(format!("file of {file_len} bytes is shorter than the 8-byte header length")))?;
    let header_len = u64::from_le_bytes(n);
    if header_len > MAX_HEADER_BYTES {
        return Err(bad(format!("header of {header_len} bytes exceeds the {MAX_HEADER_BYTES}-byte bound")));
    }
    if header_len + 8 > file_len {
        return Err(bad(format!("header of {header_len} bytes runs past the end of a {file_len}-byte file")));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).map_err(io)?;
    let json: serde_json::Value =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let obj = json.as_object().ok_or_else(|| bad("header is not a JSON object".into()))?;
    let data_start = 8 + header_len;
    let data_len = file_len - data_start;
    let mut out = Vec::new();
    let mut metadata = HashMap::new();
    for (name, v) in obj {
        if name == "__metadata__" {
            // mlx's save_safetensors writes null when there is no metadata.
            if v.is_null() {
                continue;
            }
            let map = v.as_object().ok_or_else(|| bad("__metadata__ is not an object".into()))?;
            for (k, v) in map {
                let v = v.as_str().ok_or_else(|| bad(format!("__metadata__.{k} is not a string")))?;
                metadata.insert(k.clone(), v.to_string());
            }
            continue;
        }
        let dtype = v.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad(format!("{name}: no dtype")))?;
        let shape: Vec<usize> = v
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad(format!("{name}: no shape")))?
            .iter()
            .map(|d| d.as_u64().map(|x| x as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| bad(format!("{name}: shape is not a list of integers")))?;
        let offs = v
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .filter(|o| o.len() == 2)
            .and_then(|o| Some((o[0].as_u64()?, o[1].as_u64()?)))
            .ok_or_else(|| bad(format!("{name}: data_offsets is not [begin, end]")))?;
        let (begin, end) = offs;
        if begin > end || end > data_len {
            return Err(bad(format!("{name}: data_offsets [{begin}, {end}] outside the {data_len}-byte data section")));
        }
        // A dtype this parser does not know (a future float8 in a vision tower, say) is only an
        // error if the tensor is read.
        let numel = shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d as u64));
        let want = dtype_size(dtype).map(|size| numel.and_then(|n| n.checked_mul(size)));
        if want.is_some_and(|w| w != Some(end - begin)) {
            return Err(bad(format!(
                "{name}: shape {shape:?} of {dtype} needs {:?} bytes, data_offsets give {}",
                want.flatten(),
                end - begin
            )));
        }
        out.push((name.clone(), TensorEntry { dtype: dtype.to_string(), shape, file, begin, end }));
    }
    Ok(Header { data_start, entries: out, metadata })
}
