//! Installing Mesa's lavapipe (Vulkan on the CPU) when a machine has no GPU adapter.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

const SOURCES: &str = "/etc/apt/sources.list.d/debian.sources";
const MANUAL: &str = "install a Vulkan driver: on Debian/Ubuntu `apt-get install mesa-vulkan-drivers libvulkan1` \
(lavapipe; Debian 12: from bookworm-backports for Mesa 25), on macOS nothing is needed (Metal)";

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

fn apt(args: &[&str]) -> Result<()> {
    eprintln!("$ apt-get {}", args.join(" "));
    let status = Command::new("apt-get")
        .args(args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("running apt-get")?;
    if !status.success() {
        bail!("apt-get {} failed: {status}", args.join(" "));
    }
    Ok(())
}

/// `text` (a deb822 sources file) with `bookworm-backports` added to the first Suites line that
/// names `bookworm`; `None` when there is no such line.
fn with_backports(text: &str) -> Option<String> {
    let mut changed = false;
    let lines: Vec<String> = text
        .lines()
        .map(|l| {
            if !changed && l.starts_with("Suites:") && l.split_whitespace().any(|s| s == "bookworm") {
                changed = true;
                format!("{l} bookworm-backports")
            } else {
                l.to_string()
            }
        })
        .collect();
    changed.then(|| lines.join("\n") + "\n")
}

/// Add `bookworm-backports` to the Suites of the machine's existing Debian source, so that the
/// mirror it already uses serves Mesa 25 (1.3–2× faster kernels than bookworm's Mesa 22).
fn enable_backports() -> Result<bool> {
    let path = Path::new(SOURCES);
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(false);
    };
    if text.contains("bookworm-backports") {
        return Ok(true);
    }
    match with_backports(&text) {
        Some(new) => {
            std::fs::write(path, new).with_context(|| format!("writing {SOURCES}"))?;
            Ok(true)
        }
        None => Ok(false),
    }
}

/// Install lavapipe, or explain what to install.
pub fn install() -> Result<()> {
    install_mesa(&["mesa-vulkan-drivers", "libvulkan1"], "no GPU adapter", MANUAL)
}

/// Install Mesa's GL driver (llvmpipe through EGL), for the parity run on wgpu's GL backend.
pub fn install_gl() -> Result<()> {
    install_mesa(
        &["libgl1-mesa-dri", "libegl1", "libegl-mesa0"],
        "no GL adapter",
        "install Mesa's GL driver: on Debian/Ubuntu `apt-get install libgl1-mesa-dri libegl1 libegl-mesa0`",
    )
}

fn install_mesa(packages: &[&str], why: &str, manual: &str) -> Result<()> {
    let debian = Path::new("/etc/debian_version").exists();
    if !debian || !is_root() {
        bail!("{why} found; {manual}");
    }
    eprintln!("{why}: installing {}", packages.join(" "));
    let backports = enable_backports()?;
    apt(&["update", "-q"])?;
    let mut args = vec!["install", "-y", "-q"];
    if backports {
        args.extend(["-t", "bookworm-backports"]);
    }
    args.extend(packages);
    apt(&args)
}

#[cfg(test)]
mod tests {
    use super::with_backports;

    #[test]
    fn backports_join_the_bookworm_suites_line_only() {
        let src = "Types: deb\nSuites: bookworm bookworm-updates\nComponents: main\n\nSuites: bookworm-security\n";
        let out = with_backports(src).expect("has a bookworm line");
        assert!(out.contains("Suites: bookworm bookworm-updates bookworm-backports\n"));
        assert!(out.contains("Suites: bookworm-security\n"));
        assert_eq!(with_backports("Suites: trixie\n"), None);
    }
}
