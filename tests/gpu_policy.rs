//! The suite's rule for a machine without a GPU adapter (`common::gpu`): in CI, or under
//! `cargo xtask test` (`QWEN35_REQUIRE_ADAPTER=1`), every GPU test fails; in a plain `cargo test`
//! it is skipped with a message. Checked by running this binary's own GPU test again with
//! `WGPU_ADAPTER_NAME` naming no adapter, so that the context cannot be created; and
//! `QWEN35_REJECT_CPU_ADAPTER=1` (`cargo xtask test-gpu`) failing them on a software adapter.

mod common;

use std::process::Command;

/// A GPU test: it needs the shared context and nothing else.
#[test]
fn a_gpu_test() {
    let Some(ctx) = common::gpu() else { return };
    assert!(!ctx.info.name.is_empty());
}

/// A GPU test with a context of its own.
#[test]
fn a_gpu_with_test() {
    let Some(ctx) = common::gpu_with(qwen35_wgpu::GpuOptions::default()) else { return };
    assert!(!ctx.info.name.is_empty());
}

/// Run `test` (one of the two above) in a child with `env` set and the policy's other variables
/// removed, without an adapter when `no_adapter`; its success and output.
fn child(test: &str, no_adapter: bool, env: &[(&str, &str)]) -> (bool, String) {
    let mut child = Command::new(std::env::current_exe().expect("test binary"));
    child.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    if no_adapter {
        child.env("WGPU_ADAPTER_NAME", "no adapter has this name (qwen35 gpu_policy test)");
    }
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
    for test in ["a_gpu_test", "a_gpu_with_test"] {
        for env in [[("CI", "true")], [("CI", "1")], [("QWEN35_REQUIRE_ADAPTER", "1")]] {
            let (ok, text) = child(test, true, &env);
            assert!(
                !ok && text.contains("no GPU adapter"),
                "{test} {env:?}: a missing adapter must fail the test:\n{text}"
            );
        }
        for env in [&[][..], &[("CI", "false")], &[("QWEN35_REQUIRE_ADAPTER", "0")]] {
            let (ok, text) = child(test, true, env);
            assert!(
                ok && text.contains("SKIPPED: no GPU adapter"),
                "{test} {env:?}: a plain run skips with a message:\n{text}"
            );
        }
    }
}

/// Under `cargo xtask test-gpu` (`QWEN35_REJECT_CPU_ADAPTER=1`) a software adapter fails both
/// kinds of test, and a real one passes them.
#[test]
fn test_gpu_rejects_a_cpu_adapter() {
    let Some(ctx) = common::gpu() else { return };
    for test in ["a_gpu_test", "a_gpu_with_test"] {
        let (ok, text) = child(test, false, &[("QWEN35_REJECT_CPU_ADAPTER", "1")]);
        if ctx.is_cpu() {
            assert!(!ok && text.contains("CPU rasteriser"), "{test}: {} must be refused:\n{text}", ctx.info.name);
        } else {
            assert!(ok, "{test}: {} is a GPU:\n{text}", ctx.info.name);
        }
    }
}
