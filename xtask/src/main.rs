//! Project automation: `cargo xtask <command>`.

mod bench;
mod bench_model;
#[cfg(unix)]
mod fuzz;
mod lavapipe;

/// Counts allocations for the fuzz worker's per-input ceiling (see fuzz/alloc.rs).
#[cfg(unix)]
#[global_allocator]
static ALLOC: fuzz::alloc::Counting = fuzz::alloc::Counting;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

const HELP: &str = "\
cargo xtask <command>

  test                 set up a GPU (installs Mesa lavapipe as root on Debian/Ubuntu when no
                       adapter exists), then run every test (also `test-long`'s) on Vulkan
                       (Linux), the parity tests once more on GL (installing Mesa's GL driver
                       when missing), the C API's test program (bindings/c/tests/api_test.c, built
                       with the system cc), the fuzzer's check of its own fault detection, then
                       `fuzz --short`; with CI=true a missing adapter fails
  test-long            the tests too slow for `test` (`#[ignore]`d with a reason: decoding to a
                       4,096-token context limit), on the adapter and in the build `test` uses
  test-gpu [--allow-cpu]
                       run every test (a release build; the long ones and the C API's, a debug
                       build, included) on this machine's real adapter (Metal on Apple Silicon);
                       refuses a CPU adapter unless --allow-cpu
  header               regenerate bindings/c/include/qwen35_wgpu.h with cbindgen (a test fails
                       when the committed header is stale)
  xcframework          macOS only: the C API as a static library for aarch64 and x86_64 macOS,
                       lipo'd, with the header and module map, as
                       bindings/swift/Qwen35Wgpu.xcframework (bindings/swift/Package.swift uses it)
  fixtures             regenerate tests/fixtures (models, PEFT adapters, reference outputs) with
                       transformers + peft (creates target/fixtures-venv with pinned
                       torch/transformers/peft/tokenizers; CPU only), and the MLX checkpoints with
                       mlx-lm (creates target/mlx-venv with pinned mlx/mlx-lm; CPU only)
  train-demo           train the embedded demo model, its tokenizer and its two LoRA adapters on a
                       synthetic corpus, and record transformers + peft generations (~20 min, CPU)
  bench [--quick] [--profile] [--compare BIN]
                       this engine, transformers + peft and llama.cpp (llama-cpp-python built from
                       source) on the same 0.8B-dimension random model and rank-16 adapter, plus the
                       streaming-read and host-read floors, the model at q8/q4 (mlx-lm's conversions)
                       with mlx-lm on the CPU as a peer, and a 4B-dimension q4 model's GPU memory;
                       writes BENCHMARKS.md (--quick: tiny
                       sizes, one repeat; --profile: GPU time per kernel family from timestamp
                       queries; --compare: also run an earlier build of the bench example)
  fuzz [--adapters N] [--models N] [--seed S] [--short] [--timeout SECS] [--check-every K]
                       mutate the fixture adapters (PEFT dir, lone .safetensors, MLX dir) and
                       model directories (bit flips, truncation at every header boundary, length
                       field, offsets, dtype/shape edits, duplicate keys, hostile config values and
                       text, pattern maps, FIFOs/symlinks) and load each in a worker process: every
                       input must give a typed error or a load with finite logits, with no panic,
                       abort, hang (watchdog, default 10 s), allocation (one, or the live peak)
                       over 64 MiB + 8x the input's bytes (JSON counts at most 8 MiB), or load of
                       a file the safetensors format forbids; after a failed adapter load the
                       active adapter, its scale and the resident list must be unchanged (checked
                       every input) and its logits bit-identical (every K inputs, default 32, and
                       after every success). Default 100,000 adapters + 2,000 models; --short
                       3,000 + 100 (CI, ~2 min on 2 cores). Writes target/fuzz/summary.json and
                       reproducers under target/fuzz/faults/ (info.json: how to rerun); exits 1 on
                       any fault. The dev build keeps overflow checks (overflow is a panic);
                       `cargo run --release -p xtask -- fuzz` is ~1.6x faster
  bench-model [DIR]    write the bench's random bf16 model at the 0.8B dimensions to DIR
                       (default target/bench/qwen35-0.8b-random) and its rank-16 adapter on all 12
                       projections to DIR-lora-r16, in Rust from a seed: no Python or network
                       (make_fixtures.py's layout and initialisation, other random values), for
                       running `target/release/examples/bench --model DIR --adapter DIR-lora-r16`
                       on a machine without torch, e.g. a lent GPU machine
  probe                print the adapter wgpu picks (exit 1 if none)
";

/// Pinned oracle versions (the fixtures committed were made with these).
const PY_PINS: &[&str] = &[
    "torch==2.15.0",
    "transformers==5.23.0",
    "peft==0.21.2",
    "safetensors==0.8.0",
    "tokenizers==0.23.3",
    "compressed-tensors==0.20.1",
    "numpy",
];

/// Pinned MLX oracle versions (the MLX fixtures committed were made with these). mlx-cpu is mlx's
/// CPU backend, a separate wheel on Linux only; transformers is mlx-lm's own dependency.
const MLX_PINS: &[&str] = &[
    "mlx==0.32.4",
    "mlx-cpu==0.32.4; sys_platform == 'linux'",
    "mlx-lm==0.32.2",
    "transformers==5.23.0",
    "safetensors==0.8.0",
    "numpy==2.4.6",
];

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("test") => test(),
        Some("test-long") => test_long(),
        Some("test-gpu") => test_gpu(args.iter().any(|a| a == "--allow-cpu")),
        Some("header") => {
            let mut cmd = cargo();
            cmd.args(["test", "-p", "qwen35-wgpu-c", "--test", "header"]).env("QE_WRITE_HEADER", "1");
            run(cmd)
        }
        Some("xcframework") => xcframework(),
        Some("fixtures") => {
            python(&[
                "make_fixtures.py",
                "make_adapters.py",
                "make_adapter_sets.py",
                "make_learn.py",
                "make_peft_semantics.py",
                "make_sampling.py",
                "make_long_context.py",
                "make_chat.py",
            ])?;
            mlx_fixtures()
        }
        Some("train-demo") => python(&["train_demo.py"]),
        Some("bench") => {
            let compare = args.iter().position(|a| a == "--compare").map(|i| {
                args.get(i + 1).map(PathBuf::from).context("--compare needs the path of an earlier bench binary")
            });
            let opts = bench::Options {
                quick: args.iter().any(|a| a == "--quick"),
                profile: args.iter().any(|a| a == "--profile"),
                compare: compare.transpose()?,
            };
            bench::run(&root(), &venv()?, &mlx_venv()?, &opts)
        }
        Some("bench-model") => {
            let dir = args.get(1).map(PathBuf::from).unwrap_or_else(|| root().join("target/bench/qwen35-0.8b-random"));
            bench_model::write(&dir, &bench_model::QWEN35_0_8B, 8)
        }
        Some("probe") => probe(),
        #[cfg(unix)]
        Some("fuzz") => fuzz::run(&root(), &args[1..]),
        #[cfg(unix)]
        Some("fuzz-worker") => fuzz::worker(&args[1..]),
        _ => {
            print!("{HELP}");
            if args.is_empty() {
                Ok(())
            } else {
                bail!("unknown command {:?}", args[0])
            }
        }
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

fn run(mut cmd: Command) -> Result<()> {
    eprintln!("$ {cmd:?}");
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// The backend the suite runs on: `WGPU_BACKEND` when set, else Vulkan on Linux (a fresh Debian
/// machine also offers llvmpipe through GL, which wgpu would otherwise take), else wgpu's choice.
fn test_backend() -> Option<String> {
    std::env::var("WGPU_BACKEND").ok().or_else(|| cfg!(target_os = "linux").then(|| "vulkan".to_string()))
}

/// Adapter probe in a child process, so that a driver installed meanwhile is seen.
fn adapter() -> Option<(String, bool)> {
    adapter_on(test_backend())
}

/// The adapter wgpu picks on `backend` (its own choice when `None`).
fn adapter_on(backend: Option<String>) -> Option<(String, bool)> {
    let exe = std::env::current_exe().ok()?;
    let mut probe = Command::new(exe);
    probe.arg("probe");
    if let Some(backend) = backend {
        probe.env("WGPU_BACKEND", backend);
    }
    let out = probe.output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let cpu = text.contains("(Cpu)");
    Some((text, cpu))
}

fn probe() -> Result<()> {
    match qwen35_wgpu::GpuContext::new() {
        Ok(ctx) => {
            println!("{} [{:?}] ({:?})", ctx.info.name, ctx.info.backend, ctx.info.device_type);
            Ok(())
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1)
        }
    }
}

/// An adapter for the suite, installing lavapipe when there is none.
fn setup_adapter() -> Result<()> {
    let found = match adapter() {
        Some(found) => found,
        None => {
            lavapipe::install()?;
            adapter().context("Mesa lavapipe was installed but wgpu still finds no adapter")?
        }
    };
    eprintln!("GPU adapter: {}", found.0);
    Ok(())
}

/// `cargo test` with a missing adapter made a failure, on the suite's backend.
fn cargo_test(args: &[&str]) -> Command {
    let mut cmd = cargo();
    cmd.arg("test").args(args).env("QWEN35_REQUIRE_ADAPTER", "1");
    if let Some(backend) = test_backend() {
        cmd.env("WGPU_BACKEND", backend);
    }
    cmd
}

fn test() -> Result<()> {
    setup_adapter()?;
    run(cargo_test(&["--workspace"]))?;
    run(cargo_test(&["--test", "context_limit", "--", "--ignored"]))?;
    if cfg!(target_os = "linux") && std::env::var("WGPU_BACKEND").is_err() {
        parity_on_gl()?;
    }
    c_api_test()?;
    fuzz_short()
}

/// Build the C API (cdylib), compile bindings/c/tests/api_test.c against it with the system
/// C compiler and run it on the demo model with transformers + peft's answers to its question
/// (`reference/demo.json`); its exit code is the result.
fn c_api_test() -> Result<()> {
    if !cfg!(unix) {
        eprintln!("skipping the C API test: it is built with a Unix cc");
        return Ok(());
    }
    let root = root();
    let mut build = cargo();
    build.args(["build", "-p", "qwen35-wgpu-c"]);
    run(build)?;
    let lib_dir = root.join("target/debug");
    let out = root.join("target/c-api-test");
    let scratch = out.join("scratch");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).context("creating target/c-api-test")?;
    let exe = out.join("api_test");
    let mut cc = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
    cc.args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1", "-o"])
        .arg(&exe)
        .arg(root.join("bindings/c/tests/api_test.c"))
        .arg("-I")
        .arg(root.join("bindings/c/include"))
        .arg("-L")
        .arg(&lib_dir)
        .args(["-lqwen35_wgpu_c", "-lpthread", "-lm"])
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()));
    run(cc)?;
    // The answers transformers + peft give to the test's question (its QUESTION).
    let demo: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("tests/fixtures/reference/demo.json")).context("demo.json")?,
    )?;
    let mut test = Command::new(&exe);
    test.arg(root.join("examples/assets/demo")).arg(&scratch);
    for adapter in ["base", "shout", "french"] {
        let answer = demo["outputs"][adapter]
            .as_array()
            .and_then(|o| o.iter().find(|a| a["question"] == "What color is the sky?"))
            .and_then(|a| a["text"].as_str())
            .with_context(|| format!("demo.json: the {adapter} answer to the C test's question"))?;
        test.arg(answer);
    }
    if let Some(backend) = test_backend() {
        test.env("WGPU_BACKEND", backend);
    }
    run(test)
}

/// macOS: the static library for both architectures, lipo'd, and an XCFramework with the
/// header and module map (what bindings/swift/Package.swift's binary target points at).
fn xcframework() -> Result<()> {
    if !cfg!(target_os = "macos") {
        bail!("`cargo xtask xcframework` needs macOS (rustup targets for Apple, lipo, xcodebuild)");
    }
    let root = root();
    let targets = ["aarch64-apple-darwin", "x86_64-apple-darwin"];
    for t in targets {
        let mut cmd = cargo();
        cmd.args(["build", "--release", "-p", "qwen35-wgpu-c", "--target", t]);
        run(cmd)?;
    }
    let out = root.join("target/xcframework");
    let headers = out.join("include");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&headers).context("creating target/xcframework")?;
    for f in ["qwen35_wgpu.h", "module.modulemap"] {
        std::fs::copy(root.join("bindings/c/include").join(f), headers.join(f))
            .with_context(|| format!("copying {f}"))?;
    }
    let fat = out.join("libqwen35_wgpu_c.a");
    let mut lipo = Command::new("lipo");
    lipo.arg("-create").arg("-output").arg(&fat);
    for t in targets {
        lipo.arg(root.join("target").join(t).join("release/libqwen35_wgpu_c.a"));
    }
    run(lipo)?;
    let framework = root.join("bindings/swift/Qwen35Wgpu.xcframework");
    let _ = std::fs::remove_dir_all(&framework);
    let mut xc = Command::new("xcodebuild");
    xc.arg("-create-xcframework")
        .arg("-library")
        .arg(&fat)
        .arg("-headers")
        .arg(&headers)
        .arg("-output")
        .arg(&framework);
    run(xc)
}

/// The parity tests once more on wgpu's GL backend (GLSL instead of SPIR-V; llvmpipe on a
/// machine without a GPU), one test at a time: wgpu-hal's GLES device panics when several
/// threads create contexts at once (`gles/device.rs:649`, wgpu 30.0.2).
fn parity_on_gl() -> Result<()> {
    let gl = || adapter_on(Some("gl".into())).filter(|(name, _)| name.contains("[Gl]"));
    let found = match gl() {
        Some(found) => found,
        None => {
            lavapipe::install_gl()?;
            gl().context("Mesa's GL driver was installed but wgpu still finds no GL adapter")?
        }
    };
    eprintln!("GL adapter: {}", found.0);
    let mut cmd = cargo_test(&["--test", "parity", "--", "--test-threads=1"]);
    cmd.env("WGPU_BACKEND", "gl");
    run(cmd)
}

fn test_long() -> Result<()> {
    setup_adapter()?;
    run(cargo_test(&["--test", "context_limit", "--", "--ignored"]))
}

/// What `test` ends with: the fuzzer's check of its own fault detection, then the short fuzz run
/// (in a child, so that it runs on the test backend).
fn fuzz_short() -> Result<()> {
    if !cfg!(unix) {
        eprintln!("skipping `cargo xtask fuzz --short`: the fuzzer needs a Unix host");
        return Ok(());
    }
    let exe = std::env::current_exe().context("xtask's own path")?;
    fuzz::harness_check(&root(), &exe, test_backend().as_deref())?;
    let mut cmd = Command::new(exe);
    cmd.args(["fuzz", "--short"]);
    if let Some(backend) = test_backend() {
        cmd.env("WGPU_BACKEND", backend);
    }
    run(cmd)
}

fn test_gpu(allow_cpu: bool) -> Result<()> {
    let Some((name, cpu)) = adapter() else {
        bail!("no GPU adapter found; on macOS Metal needs no setup, on Linux install a Vulkan driver");
    };
    if cpu && !allow_cpu {
        bail!("the adapter is a CPU rasteriser ({name}); pass --allow-cpu to run on it anyway");
    }
    eprintln!("GPU adapter: {name}");
    // Every test (the quantized kernels, learning, batches and the fused, run-ahead paths a CPU
    // adapter does not take among them), the long ones included, then the C API's.
    for args in [&["--release", "--workspace"][..], &["--release", "--test", "context_limit", "--", "--ignored"]] {
        let mut cmd = cargo_test(args);
        if !allow_cpu {
            cmd.env("QWEN35_REJECT_CPU_ADAPTER", "1");
        }
        run(cmd)?;
    }
    c_api_test()
}

/// The project's Python (a venv under target/ with the pinned oracle), created on first use.
fn venv() -> Result<PathBuf> {
    pinned_venv("target/fixtures-venv", PY_PINS)
}

/// The Python with mlx and mlx-lm (kept apart from torch), created on first use.
fn mlx_venv() -> Result<PathBuf> {
    pinned_venv("target/mlx-venv", MLX_PINS)
}

/// The python of the venv at `dir` (relative to the root) with `pins` installed.
fn pinned_venv(dir: &str, pins: &[&str]) -> Result<PathBuf> {
    let venv = root().join(dir);
    let python = venv.join("bin/python");
    if !python.exists() {
        let mut cmd = Command::new("python3");
        cmd.args(["-m", "venv"]).arg(&venv);
        run(cmd)?;
    }
    let mut pip = Command::new(&python);
    pip.args(["-m", "pip", "install", "-q"]).args(pins);
    run(pip)?;
    Ok(python)
}

fn python(scripts: &[&str]) -> Result<()> {
    let root = root();
    let python = venv()?;
    for script in scripts {
        let mut make = Command::new(&python);
        // peft saves target_modules from a set: a fixed hash seed keeps the files reproducible.
        make.arg(root.join("xtask/python").join(script)).arg("--root").arg(&root).env("PYTHONHASHSEED", "0");
        run(make)?;
    }
    Ok(())
}

/// The MLX fixtures: make_mlx.py's stages, each in the venv that has its library (torch builds the
/// source, the transformers references and the PEFT adapter, mlx-lm converts and runs the MLX
/// checkpoints and makes the MLX adapter; compressed-tensors, in the torch venv, writes the W4A16
/// pack-quantized checkpoint). After make_adapters.py, which empties the adapters folder.
fn mlx_fixtures() -> Result<()> {
    let root = root();
    let (torch, mlx) = (venv()?, mlx_venv()?);
    let stages = [
        (&torch, "source"),
        (&mlx, "convert"),
        (&mlx, "reference"),
        (&torch, "transformers"),
        (&torch, "compressed"),
        (&torch, "peft"),
        (&mlx, "mlx-lora"),
        (&torch, "mlx-lora-reference"),
        (&torch, "learn"),
    ];
    for (python, stage) in stages {
        let mut make = Command::new(python);
        make.arg(root.join("xtask/python/make_mlx.py")).arg("--root").arg(&root).args(["--stage", stage]);
        // peft saves target_modules from a set: a fixed hash seed keeps the files reproducible.
        make.env("PYTHONHASHSEED", "0");
        run(make)?;
    }
    Ok(())
}
