//! Reading the files a user hands the engine. Every one is untrusted: a path may name a FIFO
//! (opening it blocks), a device (`/dev/zero` never ends, `/dev/null` is empty), a directory, or
//! a sparse file of any size. So the type and the size come from the metadata before the file is
//! opened, the opened file is checked again, and no read goes past the bound, even if the file
//! grows meanwhile.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::FileError;

/// Largest JSON file read (`config.json`, `model.safetensors.index.json`,
/// `generation_config.json`, `adapter_config.json`): real ones are at most a few hundred KiB
/// (an MLX config with a quantization entry per module, an index of a thousand shards' names).
pub const MAX_JSON_BYTES: u64 = 16 << 20;

/// What the file type is, in words, for the error (`metadata` of a path that is not a file).
fn kind(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    "not a regular file"
}

/// Open `path` for reading after checking (without opening it) that it is a regular file (a
/// symlink is followed); returns the file and its length. `what` names the file in errors.
pub fn open_regular(path: &Path, what: &str) -> Result<(File, u64), FileError> {
    let io = |source| FileError::Io { path: path.to_path_buf(), source };
    let not_regular = |meta: &std::fs::Metadata| FileError::NotRegular {
        what: what.to_string(),
        path: path.to_path_buf(),
        kind: kind(meta),
    };
    let meta = std::fs::metadata(path).map_err(io)?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let file = File::open(path).map_err(io)?;
    // The path may have been replaced between the check and the open: check what was opened.
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    Ok((file, meta.len()))
}

/// The bytes of the regular file `path`, refused before any read when it is larger than `limit`
/// bytes. `what` names the file in errors (`"config.json"`).
pub fn read_bounded(path: &Path, limit: u64, what: &str) -> Result<Vec<u8>, FileError> {
    let (file, len) = open_regular(path, what)?;
    let too_large = |size: u64| FileError::TooLarge { what: what.to_string(), path: path.to_path_buf(), size, limit };
    if len > limit {
        return Err(too_large(len));
    }
    let mut buf = Vec::with_capacity(len as usize);
    // One byte past the limit tells a file that grew after the check.
    file.take(limit + 1).read_to_end(&mut buf).map_err(|source| FileError::Io { path: path.to_path_buf(), source })?;
    if buf.len() as u64 > limit {
        return Err(too_large(buf.len() as u64));
    }
    Ok(buf)
}

/// [`read_bounded`] for a UTF-8 text file (invalid UTF-8 is an `InvalidData` I/O error).
pub fn read_bounded_text(path: &Path, limit: u64, what: &str) -> Result<String, FileError> {
    let bytes = read_bounded(path, limit, what)?;
    String::from_utf8(bytes).map_err(|e| FileError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{what} is not UTF-8: {e}")),
    })
}

/// Move two staged files into place, `first` then `second` (each a (staged, final) pair). An
/// earlier `first` waits under `.old` until `second` is in, and goes back if either move fails,
/// so on an error return the directory holds the earlier pair (or none), never a new file beside
/// an old one. A final path that is not a file (a directory) is refused before anything moves.
/// On error: the path that could not be moved and why (the staged files are the caller's).
pub(crate) fn install_pair(
    (tmp, path): (&Path, &Path),
    (tmp2, path2): (&Path, &Path),
) -> Result<(), (PathBuf, std::io::Error)> {
    for p in [path, path2] {
        if std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir()) {
            let e = std::io::Error::new(std::io::ErrorKind::IsADirectory, "a directory holds the name");
            return Err((p.to_path_buf(), e));
        }
    }
    let mut old = path.as_os_str().to_owned();
    old.push(".old");
    let old = PathBuf::from(old);
    let had_old = std::fs::symlink_metadata(path).is_ok();
    if had_old {
        std::fs::rename(path, &old).map_err(|e| (path.to_path_buf(), e))?;
    }
    let restore = |failed: &Path, e: std::io::Error| {
        let back = if had_old { std::fs::rename(&old, path) } else { std::fs::remove_file(path) };
        match back {
            Ok(()) => (failed.to_path_buf(), e),
            Err(b) => {
                let why = format!("{e}; the earlier file could not be put back from {}: {b}", old.display());
                (failed.to_path_buf(), std::io::Error::new(e.kind(), why))
            }
        }
    };
    std::fs::rename(tmp, path).map_err(|e| restore(path, e))?;
    std::fs::rename(tmp2, path2).map_err(|e| restore(path2, e))?;
    if had_old {
        let _ = std::fs::remove_file(&old);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("qwen35-io-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn small_files_are_read_and_large_ones_refused_by_their_size() {
        let dir = temp("size");
        let path = dir.join("a.json");
        std::fs::write(&path, b"{\"a\": 1}").expect("write");
        assert_eq!(read_bounded(&path, 8, "a.json").expect("exactly the limit"), b"{\"a\": 1}");
        let e = read_bounded(&path, 7, "a.json").expect_err("one byte over");
        assert!(matches!(e, FileError::TooLarge { size: 8, limit: 7, .. }), "{e}");
        // A sparse file of 1 GiB: refused from its length, nothing read.
        let sparse = dir.join("sparse.json");
        std::fs::File::create(&sparse).and_then(|f| f.set_len(1 << 30)).expect("sparse");
        let e = read_bounded(&sparse, MAX_JSON_BYTES, "config.json").expect_err("sparse");
        assert!(matches!(e, FileError::TooLarge { size, .. } if size == 1 << 30), "{e}");
        let e = read_bounded(&dir, MAX_JSON_BYTES, "config.json").expect_err("a directory");
        assert!(matches!(e, FileError::NotRegular { kind: "a directory", .. }), "{e}");
        let e = read_bounded(&dir.join("none"), 10, "config.json").expect_err("missing");
        assert!(matches!(e, FileError::Io { .. }), "{e}");
    }

    #[cfg(unix)]
    #[test]
    fn devices_and_fifos_are_refused_without_opening_them() {
        for dev in ["/dev/null", "/dev/zero"] {
            let e = read_bounded(Path::new(dev), MAX_JSON_BYTES, "config.json").expect_err(dev);
            assert!(matches!(e, FileError::NotRegular { kind: "a character device", .. }), "{e}");
            assert!(e.to_string().contains("not a regular file"), "{e}");
        }
        let dir = temp("fifo");
        let fifo = dir.join("config.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().expect("run mkfifo");
        assert!(made.success(), "mkfifo {}", fifo.display());
        // Opening a FIFO with no writer blocks: the check must come first.
        let e = read_bounded(&fifo, MAX_JSON_BYTES, "config.json").expect_err("fifo");
        assert!(matches!(e, FileError::NotRegular { kind: "a FIFO", .. }), "{e}");
        // A symlink to a device is the device.
        let link = dir.join("link.json");
        std::os::unix::fs::symlink("/dev/zero", &link).expect("symlink");
        let e = read_bounded(&link, MAX_JSON_BYTES, "config.json").expect_err("link");
        assert!(matches!(e, FileError::NotRegular { .. }), "{e}");
    }
}
