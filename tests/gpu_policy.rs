//! The suite's rule for a machine without a GPU adapter (`common::gpu`): in CI, or under
//! `cargo xtask test` (`QWEN35_REQUIRE_ADAPTER=1`), every GPU test fails; in a plain `cargo test`
//! it is skipped with a message. Checked by running this binary's own GPU test again with
//! `WGPU_ADAPTER_NAME` naming no adapter, so that the context cannot be created.

mod common;

use std::process::Command;

/// A GPU test: it needs the context and nothing else.
#[test]
fn a_gpu_test() {
    let Some(ctx) = common::gpu() else { return };
    assert!(!ctx.info.name.is_empty());
}

/// Run [`a_gpu_test`] in a child without an adapter, with `env` set and the policy's other
/// variables removed; its success and output.
fn without_adapter(env: &[(&str, &str)]) -> (bool, String) {
    let mut child = Command::new(std::env::current_exe().expect("test binary"));
    child.args(["--exact", "a_gpu_test", "--nocapture", "--test-threads=1"]);
    child.env("WGPU_ADAPTER_NAME", "no adapter has this name (qwen35 gpu_policy test)");
    for var in ["CI", "QWEN35_REQUIRE_ADAPTER", "QWEN35_REJECT_CPU_ADAPTER"] {
        child.env_remove(var);
    }
    child.envs(env.iter().copied());
    let out = child.output().expect("run the test binary");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn a_missing_adapter_fails_in_ci_and_under_xtask_and_is_skipped_otherwise() {
    for env in [[("CI", "true")], [("CI", "1")], [("QWEN35_REQUIRE_ADAPTER", "1")]] {
        let (ok, text) = without_adapter(&env);
        assert!(!ok && text.contains("no GPU adapter"), "{env:?}: a missing adapter must fail the test:\n{text}");
    }
    for env in [&[][..], &[("CI", "false")], &[("QWEN35_REQUIRE_ADAPTER", "0")]] {
        let (ok, text) = without_adapter(env);
        assert!(ok && text.contains("SKIPPED: no GPU adapter"), "{env:?}: a plain run skips with a message:\n{text}");
    }
}
