//! The committed header is what cbindgen makes of `src/lib.rs` now (`cargo xtask header`
//! rewrites it).

use std::path::PathBuf;

#[test]
fn header_is_current() {
    let crate_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen")
        .write(&mut generated);
    let path = crate_dir.join("include/qwen35_wgpu.h");
    if std::env::var_os("QE_WRITE_HEADER").is_some() {
        std::fs::write(&path, &generated).expect("writing include/qwen35_wgpu.h");
        return;
    }
    let committed = std::fs::read(&path).expect("include/qwen35_wgpu.h");
    assert!(generated == committed, "include/qwen35_wgpu.h is stale: run `cargo xtask header` and commit the result");
}
