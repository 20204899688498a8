//! One fuzz input built on disk: a copy of a fixture with one mutation, a pure function of
//! (seed, domain, index).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use super::mutate_json::{self, Flavor};
use super::mutate_st::{self, Mutated};
use super::rng::Rng;
use super::sources::{Kind, Source, ADAPTERS, ADAPTER_CLASSES, MODELS, MODEL_CLASSES};
use super::st::St;

/// Adapters or models.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    /// Adapter loading on a loaded model.
    Adapter,
    /// Model loading.
    Model,
}

impl Domain {
    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Domain::Adapter => "adapter",
            Domain::Model => "model",
        }
    }

    /// From its name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "adapter" => Some(Domain::Adapter),
            "model" => Some(Domain::Model),
            _ => None,
        }
    }
}

/// A built input.
pub struct Built {
    /// The path to load.
    pub target: PathBuf,
    /// The fixture it came from.
    pub source: &'static Source,
    /// The mutation class.
    pub class: &'static str,
    /// What exactly was done.
    pub detail: String,
    /// The adapter scale to load with.
    pub scale: f32,
    /// The format forbids the result: a successful load is a fault.
    pub must_fail: bool,
    /// Bytes of input that justify allocations (JSON files count at most [`JSON_CAP`]).
    pub justified: u64,
}

/// A JSON config larger than this justifies nothing more (no real config is near it).
pub const JSON_CAP: u64 = 8 << 20;

/// The class of input `index`: a rare header-bloat, else round-robin over the table.
fn class_of(domain: Domain, index: u64) -> (&'static str, usize) {
    let table = match domain {
        Domain::Adapter => ADAPTER_CLASSES,
        Domain::Model => MODEL_CLASSES,
    };
    if index % 499 == 498 {
        return ("header-bloat", (index / 499) as usize);
    }
    (table[(index % table.len() as u64) as usize], (index / table.len() as u64) as usize)
}

fn copy_dir(from: &Path, to: &Path) -> io::Result<()> {
    fs::create_dir_all(to)?;
    for e in fs::read_dir(from)? {
        let e = e?;
        fs::copy(e.path(), to.join(e.file_name()))?;
    }
    Ok(())
}

/// Make a FIFO at `path`.
pub fn mkfifo(path: &Path) -> io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    if unsafe { libc::mkfifo(c.as_ptr(), 0o644) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Build input `index` of `domain` under `dir` (emptied first), from the fixtures at `fixtures`.
pub fn build(domain: Domain, seed: u64, index: u64, fixtures: &Path, dir: &Path) -> io::Result<Built> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    let mut rng = Rng::new(seed, domain as u64 + 1, index);
    let sources = match domain {
        Domain::Adapter => ADAPTERS,
        Domain::Model => MODELS,
    };
    let source = rng.pick(sources);
    let (class, variant) = class_of(domain, index);
    let from = fixtures.join(source.rel);
    // A lone file goes in a directory of its own, so no adapter_config.json lies beside it.
    let target = match source.kind {
        Kind::SingleFile => dir.join(format!("fuzz-{index}.safetensors")),
        _ => dir.join(format!("fuzz-{index}")),
    };
    match source.kind {
        Kind::SingleFile => {
            fs::copy(&from, &target)?;
        }
        _ => copy_dir(&from, &target)?,
    }
    let weights = weights_file(source.kind, &target, &mut rng)?;
    let config = match source.kind {
        Kind::PeftDir | Kind::MlxDir => Some(target.join("adapter_config.json")),
        Kind::ModelDir => Some(target.join("config.json")),
        Kind::SingleFile => None,
    };
    let flavor = match source.kind {
        Kind::MlxDir => Flavor::Mlx,
        Kind::ModelDir => Flavor::Model,
        _ => Flavor::Peft,
    };
    let mut scale = 1.0f32;
    let mut must_fail = false;
    let bytes = fs::read(&weights)?;
    let st =
        St::parse(&bytes).ok_or_else(|| io::Error::other(format!("{} is not a valid fixture", weights.display())))?;
    let mut write = |m: Mutated| -> io::Result<String> {
        fs::write(&weights, &m.bytes)?;
        must_fail = m.must_fail;
        Ok(m.detail)
    };
    let prefix = if domain == Domain::Adapter { "base_model.model.model." } else { "model." };
    // A lone file's config is its __metadata__.
    let class = match (class, config.is_some()) {
        ("config-value" | "config-text" | "config-pattern", false) => "metadata",
        ("config-pattern", true) if !matches!(flavor, Flavor::Peft) => "config-value",
        (c, _) => c,
    };
    let detail = match class {
        "bitflip" => write(mutate_st::bitflip(&bytes, &st, &mut rng))?,
        "truncate" => write(mutate_st::truncate(&bytes, &st, variant))?,
        "header-len" => write(mutate_st::header_len(&bytes, &st, variant))?,
        "offsets" => write(mutate_st::offsets(&bytes, &mut rng, variant))?,
        "dtype" => write(mutate_st::dtype(&bytes, &mut rng, variant))?,
        "shape" => write(mutate_st::shape(&bytes, &mut rng, variant))?,
        "dup-key" => write(mutate_st::dup_key(&bytes, &mut rng, variant))?,
        "key-edit" => write(mutate_st::key_edit(&bytes, &mut rng, variant))?,
        "metadata" => write(mutate_st::metadata(&bytes, variant))?,
        "values" => write(mutate_st::values(&bytes, &mut rng, variant))?,
        "header-bloat" => write(mutate_st::header_bloat(&bytes, prefix, variant))?,
        "config-value" | "config-text" | "config-pattern" | "config-size" => {
            let path = config.as_deref().unwrap_or(&target);
            let text = fs::read_to_string(path)?;
            let (new, what) = match class {
                "config-value" => {
                    let (t, w) = mutate_json::config_value(&text, flavor, variant);
                    (t.into_bytes(), w)
                }
                "config-text" => mutate_json::config_text(&text, variant),
                "config-size" => {
                    let (t, w) = mutate_json::config_size(&text, variant);
                    (t.into_bytes(), w)
                }
                _ => {
                    let (t, w) = mutate_json::config_pattern(&text, &mut rng, variant);
                    (t.into_bytes(), w)
                }
            };
            fs::write(path, new)?;
            what
        }
        "fs-special" => fs_special(&target, &weights, config.as_deref(), variant)?,
        "index-json" => index_json(&target, &weights, variant)?,
        _ => {
            scale = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, f32::MAX, 0.0, -1.0, 1e-45, 1e10]
                [variant % 10];
            format!("load with scale {scale}")
        }
    };
    let justified = justified_bytes(&target);
    Ok(Built { target, source, class, detail, scale, must_fail, justified })
}

/// The safetensors file a mutation edits (a random shard of a sharded model).
fn weights_file(kind: Kind, target: &Path, rng: &mut Rng) -> io::Result<PathBuf> {
    Ok(match kind {
        Kind::SingleFile => target.to_path_buf(),
        Kind::PeftDir => target.join("adapter_model.safetensors"),
        Kind::MlxDir => target.join("adapters.safetensors"),
        Kind::ModelDir => {
            let mut shards: Vec<PathBuf> = fs::read_dir(target)?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            shards.sort();
            rng.pick(&shards).clone()
        }
    })
}

/// Replace a file (the weights, the config, or the input itself) by something that is not a
/// regular file of its own: links to devices and system files, FIFOs, directories, loops, sparse
/// giants.
fn fs_special(target: &Path, weights: &Path, config: Option<&Path>, variant: usize) -> io::Result<String> {
    use std::os::unix::fs::symlink;
    let whom: [(&str, &Path); 3] = [("weights", weights), ("config", config.unwrap_or(weights)), ("input", target)];
    let (who, path) = whom[(variant / 12) % whom.len()];
    let what = match variant % 12 {
        0 => "symlink to /dev/zero",
        1 => "symlink to /etc/passwd",
        2 => "symlink to /dev/null",
        3 => "symlink to a FIFO",
        4 => "a FIFO",
        5 => "a directory",
        6 => "a dangling symlink",
        7 => "a symlink loop",
        8 => "an empty file",
        9 => "a sparse 1 GiB file",
        10 => "symlink to /dev/urandom",
        _ => "symlink to the real file",
    };
    let parent = target.parent().unwrap_or(target);
    let real = parent.join("real");
    // Links within the input are relative, so a saved reproducer can be moved.
    let up = if path.parent() == Some(parent) { "" } else { "../" };
    let local = |name: &str| PathBuf::from(format!("{up}{name}"));
    if variant % 12 == 11 {
        fs::rename(path, &real)?;
    } else if path.is_dir() {
        fs::remove_dir_all(path)?;
    } else {
        fs::remove_file(path)?;
    }
    match variant % 12 {
        0 => symlink("/dev/zero", path)?,
        1 => symlink("/etc/passwd", path)?,
        2 => symlink("/dev/null", path)?,
        3 => {
            let fifo = parent.join("fifo");
            mkfifo(&fifo)?;
            symlink(local("fifo"), path)?;
        }
        4 => mkfifo(path)?,
        5 => fs::create_dir(path)?,
        6 => symlink(local("missing"), path)?,
        7 => symlink(path.file_name().unwrap_or_default(), path)?,
        8 => fs::write(path, b"")?,
        9 => fs::File::create(path)?.set_len(1 << 30)?,
        10 => symlink("/dev/urandom", path)?,
        _ => symlink(local("real"), path)?,
    }
    Ok(format!("{who} is {what}"))
}

/// A hostile `model.safetensors.index.json` (a single-file model gets an index over its file
/// first).
fn index_json(target: &Path, weights: &Path, variant: usize) -> io::Result<String> {
    let index = target.join("model.safetensors.index.json");
    let mut v: serde_json::Value = match fs::read_to_string(&index) {
        Ok(t) => serde_json::from_str(&t).map_err(io::Error::other)?,
        Err(_) => {
            let bytes = fs::read(weights)?;
            let st = St::parse(&bytes).ok_or_else(|| io::Error::other("fixture"))?;
            let map: serde_json::Map<String, serde_json::Value> =
                st.entries().into_iter().map(|e| (e.name, serde_json::json!("model.safetensors"))).collect();
            serde_json::json!({ "metadata": {}, "weight_map": map })
        }
    };
    let first = v["weight_map"].as_object().and_then(|m| m.keys().next().cloned()).unwrap_or_default();
    let mut set_first = |shard: &str| {
        if let Some(m) = v["weight_map"].as_object_mut() {
            m.insert(first.clone(), serde_json::json!(shard));
        }
    };
    let what = match variant % 12 {
        0 => {
            set_first("../model.safetensors");
            "a shard named ../model.safetensors"
        }
        1 => {
            set_first("/etc/passwd");
            "a shard named /etc/passwd"
        }
        2 => {
            set_first("missing.safetensors");
            "a missing shard"
        }
        3 => {
            mkfifo(&target.join("fifo.safetensors"))?;
            set_first("fifo.safetensors");
            "a shard that is a FIFO"
        }
        4 => {
            std::os::unix::fs::symlink("/dev/zero", target.join("zero.safetensors"))?;
            set_first("zero.safetensors");
            "a shard linked to /dev/zero"
        }
        5 => {
            v["weight_map"] = serde_json::json!([]);
            "weight_map is an array"
        }
        6 => {
            v["weight_map"] = serde_json::json!({});
            "weight_map is empty"
        }
        7 => {
            if let Some(m) = v["weight_map"].as_object_mut() {
                m.insert(first.clone(), serde_json::json!(7));
            }
            "a shard name that is a number"
        }
        8 => {
            if let Some(m) = v["weight_map"].as_object_mut() {
                for k in 0..100_000 {
                    m.insert(format!("model.extra.{k}"), serde_json::json!(format!("s{k}.safetensors")));
                }
            }
            "100,000 distinct missing shards"
        }
        9 => {
            let copy = target.join("copy.safetensors");
            fs::copy(weights, &copy)?;
            set_first("copy.safetensors");
            "a shard duplicated under another name (every tensor twice)"
        }
        10 => {
            set_first("");
            "an empty shard name"
        }
        _ => {
            fs::write(&index, b"{\"weight_map\": ")?;
            return Ok("index.json truncated".into());
        }
    };
    fs::write(&index, serde_json::to_string(&v).map_err(io::Error::other)?)?;
    Ok(what.into())
}

/// Bytes of the regular files of `target` (one level), JSON counted at most [`JSON_CAP`].
fn justified_bytes(target: &Path) -> u64 {
    let size = |p: &Path| -> u64 {
        let Ok(m) = fs::metadata(p) else { return 0 };
        if !m.is_file() {
            return 0;
        }
        if p.extension().is_some_and(|x| x == "json") {
            m.len().min(JSON_CAP)
        } else {
            m.len()
        }
    };
    if target.is_dir() {
        fs::read_dir(target).map(|r| r.flatten().map(|e| size(&e.path())).sum()).unwrap_or(0)
    } else {
        size(target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixtures() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
    }

    fn contents(dir: &Path) -> Vec<(String, Vec<u8>)> {
        let mut out: Vec<(String, Vec<u8>)> = Vec::new();
        for e in fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            let m = fs::symlink_metadata(&p).map(|m| m.file_type());
            let name = e.file_name().to_string_lossy().into_owned();
            if m.as_ref().is_ok_and(|t| t.is_dir()) {
                out.extend(contents(&p).into_iter().map(|(n, b)| (format!("{name}/{n}"), b)));
            } else if m.as_ref().is_ok_and(|t| t.is_file()) && fs::metadata(&p).is_ok_and(|m| m.len() < 1 << 26) {
                out.push((name, fs::read(&p).unwrap_or_default()));
            } else {
                out.push((name, fs::read_link(&p).map(|l| l.display().to_string().into_bytes()).unwrap_or_default()));
            }
        }
        out.sort();
        out
    }

    /// Every class builds from every fixture, and an input is the same bytes when rebuilt (a
    /// reproducer is the input that failed).
    #[test]
    fn inputs_build_and_are_deterministic() {
        let tmp = std::env::temp_dir().join(format!("xtask-fuzz-test-{}", std::process::id()));
        for domain in [Domain::Adapter, Domain::Model] {
            for i in 0..300 {
                let a = build(domain, 7, i, &fixtures(), &tmp.join("a")).unwrap_or_else(|e| panic!("input {i}: {e}"));
                build(domain, 7, i, &fixtures(), &tmp.join("b")).unwrap_or_else(|e| panic!("input {i}: {e}"));
                let same = contents(&tmp.join("a")) == contents(&tmp.join("b"));
                assert!(same, "{domain:?} input {i} differs when rebuilt: {}", a.detail);
            }
        }
        let _ = fs::remove_dir_all(&tmp);
    }
}
