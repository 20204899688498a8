//! Shared test support: the GPU (a failure in CI when absent), fixtures, comparisons.

#![allow(dead_code)]

pub mod tolerance;

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use qwen35_wgpu::GpuContext;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fixture model directory.
pub fn fixture_model(name: &str) -> PathBuf {
    root().join("tests/fixtures/models").join(name)
}

/// Whether a missing adapter is a failure: `CI` set to anything but empty, `0` or `false` (CI
/// services set `true`, some scripts `1`), or `QWEN35_REQUIRE_ADAPTER` set to anything but empty
/// or `0` (`cargo xtask test` sets `1`).
pub fn adapter_required() -> bool {
    let set = |name: &str, off: &[&str]| std::env::var(name).is_ok_and(|v| !v.is_empty() && !off.contains(&v.as_str()));
    set("CI", &["0", "false"]) || set("QWEN35_REQUIRE_ADAPTER", &["0"])
}

/// The shared GPU context. Without an adapter, a test panics when [`adapter_required`]: a
/// missing driver must turn CI red. Otherwise (a plain `cargo test` on a machine without a GPU)
/// it is skipped with a message. With `QWEN35_REJECT_CPU_ADAPTER=1` (set by `cargo xtask
/// test-gpu`), a software adapter is an error. `tests/gpu_policy.rs` checks this policy.
pub fn gpu() -> Option<Arc<GpuContext>> {
    static CTX: OnceLock<Result<Arc<GpuContext>, String>> = OnceLock::new();
    under_policy(CTX.get_or_init(|| GpuContext::new().map(Arc::new).map_err(|e| e.to_string())).clone())
}

/// A context of its own with `options` (not shared), under the same policy as [`gpu`].
pub fn gpu_with(options: qwen35_wgpu::GpuOptions) -> Option<Arc<GpuContext>> {
    under_policy(GpuContext::with_options(options).map(Arc::new).map_err(|e| e.to_string()))
}

/// [`gpu`]'s policy applied to an attempt to make a context.
fn under_policy(made: Result<Arc<GpuContext>, String>) -> Option<Arc<GpuContext>> {
    match made {
        Ok(ctx) => {
            if std::env::var("QWEN35_REJECT_CPU_ADAPTER").as_deref() == Ok("1") && ctx.is_cpu() {
                panic!("adapter {:?} is a CPU rasteriser; test-gpu needs a real GPU (or --allow-cpu)", ctx.info.name);
            }
            Some(ctx)
        }
        Err(e) => {
            if adapter_required() {
                panic!("no GPU adapter (CI or QWEN35_REQUIRE_ADAPTER is set): {e}");
            }
            eprintln!("SKIPPED: no GPU adapter ({e}); set CI=true to make this a failure");
            None
        }
    }
}

/// Tensors of a reference fixture file.
pub struct Reference {
    bytes: Vec<u8>,
}

impl Reference {
    /// Load `tests/fixtures/reference/<name>.safetensors`.
    pub fn load(name: &str) -> Self {
        let path = root().join("tests/fixtures/reference").join(format!("{name}.safetensors"));
        Self { bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())) }
    }

    fn view(&self, name: &str) -> (Vec<usize>, Vec<u8>, safetensors::Dtype) {
        let st = safetensors::SafeTensors::deserialize(&self.bytes).expect("reference file parses");
        let t = st.tensor(name).unwrap_or_else(|_| panic!("reference tensor {name} missing"));
        (t.shape().to_vec(), t.data().to_vec(), t.dtype())
    }

    /// An f32 tensor and its shape.
    pub fn f32(&self, name: &str) -> (Vec<usize>, Vec<f32>) {
        let (shape, data, dtype) = self.view(name);
        assert_eq!(dtype, safetensors::Dtype::F32, "{name}");
        (shape, data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }

    /// An i64 tensor as u32 token ids.
    pub fn ids(&self, name: &str) -> Vec<u32> {
        let (_, data, dtype) = self.view(name);
        assert_eq!(dtype, safetensors::Dtype::I64, "{name}");
        data.chunks_exact(8)
            .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as u32)
            .collect()
    }
}

/// ‖a − b‖ / ‖b‖ and max |a − b|.
pub fn rel_and_max(a: &[f32], b: &[f32]) -> (f32, f32) {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let mut num = 0f64;
    let mut den = 0f64;
    let mut max = 0f32;
    for (x, y) in a.iter().zip(b) {
        let d = (x - y) as f64;
        num += d * d;
        den += (*y as f64) * (*y as f64);
        max = max.max((x - y).abs());
        if x.is_nan() != y.is_nan() {
            return (f32::INFINITY, f32::INFINITY);
        }
    }
    ((num.sqrt() / den.sqrt().max(1e-30)) as f32, max)
}

/// Whether `ours` and `want` hold the same number of rows of `vocab` values, at least one (a
/// row-wise comparison by `zip` would pass an empty or short `ours`); the mismatch if not.
pub fn whole_rows(what: &str, ours: &[f32], want: &[f32], vocab: usize) -> Result<(), String> {
    if vocab > 0 && !want.is_empty() && want.len().is_multiple_of(vocab) && ours.len() == want.len() {
        return Ok(());
    }
    Err(format!(
        "{what}: expected {} values ({} rows of {vocab}), found {}",
        want.len(),
        want.len() / vocab.max(1),
        ours.len()
    ))
}

/// [`whole_rows`], asserted.
pub fn assert_whole_rows(what: &str, ours: &[f32], want: &[f32], vocab: usize) {
    if let Err(e) = whole_rows(what, ours, want, vocab) {
        panic!("{e}");
    }
}

/// Every row of `vocab` logits of `ours` against `want` within the logits tolerances
/// ([`tolerance::LOGITS_REL`], [`tolerance::LOGITS_MAX_ABS`]).
pub fn check_logits(what: &str, ours: &[f32], want: &[f32], vocab: usize) {
    use tolerance::{LOGITS_MAX_ABS, LOGITS_REL};
    assert_whole_rows(what, ours, want, vocab);
    for (pos, (o, w)) in ours.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
        let (rel, max) = rel_and_max(o, w);
        assert!(
            rel <= LOGITS_REL && max <= LOGITS_MAX_ABS,
            "{what} position {pos}: rel {rel:.3e} (≤ {LOGITS_REL}), max abs {max:.3e} (≤ {LOGITS_MAX_ABS})"
        );
    }
}

/// Element-wise `|ours − want| ≤ atol + rtol·|want|`, reporting the worst mismatches.
pub fn assert_close(what: &str, ours: &[f32], want: &[f32], atol: f32, rtol: f32) {
    assert_eq!(ours.len(), want.len(), "{what}: length");
    let mut bad: Vec<(usize, f32, f32, f32)> = ours
        .iter()
        .zip(want)
        .enumerate()
        .filter_map(|(i, (&o, &w))| {
            let err = (o - w).abs();
            let ok = err <= atol + rtol * w.abs();
            (!ok).then_some((i, o, w, err))
        })
        .collect();
    if !bad.is_empty() {
        bad.sort_by(|a, b| b.3.total_cmp(&a.3));
        let worst: Vec<String> =
            bad.iter().take(8).map(|(i, o, w, e)| format!("[{i}] ours {o} want {w} err {e:.3e}")).collect();
        panic!(
            "{what}: {} of {} values off (atol {atol}, rtol {rtol}); worst:\n  {}",
            bad.len(),
            ours.len(),
            worst.join("\n  ")
        );
    }
}

/// The modules a PEFT adapter directory's file adapts: its `lora_A` tensors, counted in the file
/// peft wrote (the oracle for the modules the engine reports covered).
pub fn lora_a_tensors(adapter: &Path) -> usize {
    let path = adapter.join("adapter_model.safetensors");
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    st.names().iter().filter(|n| n.contains(".lora_A.")).count()
}

/// Copy a fixture directory into a fresh temporary directory for a test to damage.
pub fn scratch_copy(src: &Path, tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("qwen35-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).expect("temp dir");
    for entry in std::fs::read_dir(src).expect("fixture dir") {
        let entry = entry.expect("entry");
        std::fs::copy(entry.path(), dst.join(entry.file_name())).expect("copy");
    }
    dst
}

/// The tensors of a safetensors file: (name, dtype, shape, bytes).
pub type Tensors = Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>;

/// Write `tensors` as a safetensors file.
pub fn write_tensors(path: &Path, tensors: Tensors) {
    let views: std::collections::HashMap<String, safetensors::tensor::TensorView> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write");
}

/// A copy of fixture model `name` whose `model.safetensors` is rewritten with `edit` applied to
/// its tensors.
pub fn damaged_model(name: &str, tag: &str, edit: impl FnOnce(&mut Tensors)) -> PathBuf {
    let dir = scratch_copy(&fixture_model(name), tag);
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).expect("read");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse");
    let mut tensors: Tensors =
        st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    edit(&mut tensors);
    write_tensors(&file, tensors);
    dir
}
