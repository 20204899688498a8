//! `cargo xtask bench`: our engine, transformers + peft and llama.cpp on the same random-weight
//! checkpoint at the real Qwen3.5-0.8B dimensions and the same rank-16 adapter on all 12
//! projections, in one run; writes the table into BENCHMARKS.md.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde_json::Value;

struct Sizes {
    prompt: usize,
    decode: usize,
    repeats: usize,
}

/// The llama-cpp-python release built from source for the llama.cpp row (it knows `qwen35`).
const LLAMA_CPP_PYTHON: &str = "0.3.36";

fn capture(mut cmd: Command) -> Result<Value> {
    eprintln!("$ {cmd:?}");
    let out = cmd.output().with_context(|| format!("starting {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.starts_with('{')).context("no JSON line in the output")?;
    Ok(serde_json::from_str(line)?)
}

/// MB of GPU buffers a bench run's model, adapters and one session hold (`gpu_bytes_resident`).
fn resident_mb(run: &Value) -> f64 {
    run["gpu_bytes_resident"].as_f64().unwrap_or(f64::NAN) / 1e6
}

fn med(v: &Value) -> f64 {
    v["median"].as_f64().unwrap_or(f64::NAN)
}

/// `median (min–max)`.
fn spread(v: &Value, digits: usize) -> String {
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    format!("{:.d$} ({:.d$}–{:.d$})", f("median"), f("min"), f("max"), d = digits)
}

/// Whether two series' min–max ranges overlap (then their ratio is within this run's noise).
fn overlap(a: &Value, b: &Value) -> bool {
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    f(a, "min") <= f(b, "max") && f(b, "min") <= f(a, "max")
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    format!("{cpu}, {cores} cores")
}

/// What `cargo xtask bench` was asked for.
pub struct Options {
    /// A smoke run: tiny sizes, one repeat.
    pub quick: bool,
    /// Also time every dispatch (GPU timestamps) and write the per-kernel table.
    pub profile: bool,
    /// An earlier build of the bench example to run on the same model in the same sitting.
    pub compare: Option<PathBuf>,
}

/// The per-kernel-family table of one phase of the engine's profile.
fn profile_table(rows: &Value) -> String {
    let mut md = String::from(
        "| kernel | dispatches/token | weight MB/token | µs/token | weight GB/s |\n|---|---|---|---|---|\n",
    );
    for r in rows.as_array().into_iter().flatten() {
        let gbs = r["weight_gb_s"].as_f64().map_or("–".to_string(), |g| format!("{g:.2}"));
        md.push_str(&format!(
            "| {} | {:.2} | {:.1} | {:.0} | {gbs} |\n",
            r["kernel"].as_str().unwrap_or("?"),
            r["dispatches_per_token"].as_f64().unwrap_or(f64::NAN),
            r["weight_bytes_per_token"].as_f64().unwrap_or(0.0) / 1e6,
            r["us_per_token"].as_f64().unwrap_or(f64::NAN),
        ));
    }
    md
}

/// The MLX conversions of the bench model (4-bit and 8-bit, group 64, made by mlx-lm) beside it,
/// made on first use.
fn mlx_checkpoints(root: &Path, mlx_python: &Path, model: &Path) -> Result<[PathBuf; 2]> {
    let name = model.file_name().and_then(|n| n.to_str()).unwrap_or("model");
    let dirs = [4, 8].map(|bits| model.with_file_name(format!("{name}-mlx-q{bits}")));
    if dirs.iter().any(|d| !d.join("config.json").is_file()) {
        let mut make = Command::new(mlx_python);
        make.arg(root.join("xtask/python/make_mlx.py")).arg("--root").arg(root).args(["--stage", "bench"]);
        crate::run(make)?;
    }
    Ok(dirs)
}

/// The engine on a quantized checkpoint (no adapter, no yardsticks): tok/s, weight bytes per
/// decode token, GPU memory.
fn quantized_run(root: &Path, model: &Path, sizes: &Sizes) -> Result<Value> {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(root).args(["run", "--release", "--example", "bench", "--"]).arg("--model").arg(model);
    cmd.args(["--prompt", &sizes.prompt.to_string(), "--decode", &sizes.decode.to_string()]);
    cmd.args(["--repeats", &sizes.repeats.to_string(), "--learn-tokens", "0", "--stream-mib", "0", "--swaps", "1"]);
    capture(cmd)
}

/// The quantized-weights section: bf16 (the main run), q8 and q4 by the engine on mlx-lm's
/// conversions of the same weights, mlx-lm itself on the q4 checkpoint, and the GPU memory of a
/// 4-bit model at the 4B dimensions.
fn quantized_section(root: &Path, mlx_python: &Path, model: &Path, engine: &Value, sizes: &Sizes) -> Result<String> {
    let [q4, q8] = mlx_checkpoints(root, mlx_python, model)?;
    let runs = [
        ("bf16 (checkpoint; GPU MB include the adapter's two resident copies)", engine.clone()),
        ("q8 (mlx-lm 8-bit g64)", quantized_run(root, &q8, sizes)?),
        ("q4 (mlx-lm 4-bit g64)", quantized_run(root, &q4, sizes)?),
    ];
    let base_bytes = engine["weight_bytes_per_decode_token"].as_f64().unwrap_or(f64::NAN);
    let mut md = String::from(
        "Quantized weights (the same random weights; q8/q4 are mlx-lm's conversions of the bf16 checkpoint, \
         which the engine loads as they are and decodes in its kernels):\n\n\
         | weights | weight MB read per decode token | vs bf16 | prefill tok/s | decode tok/s | GPU MB resident (model, adapters, a session) |\n\
         |---|---|---|---|---|---|\n",
    );
    for (name, r) in &runs {
        let bytes = r["weight_bytes_per_decode_token"].as_f64().unwrap_or(f64::NAN);
        md.push_str(&format!(
            "| this engine, {name} | {:.0} | {:.3}× | {} | {} | {:.0} |\n",
            bytes / 1e6,
            bytes / base_bytes,
            spread(&r["prefill_tok_s"], 2),
            spread(&r["decode_tok_s"], 3),
            resident_mb(r)
        ));
    }
    // mlx-lm's CPU quantized matmul runs ~5 s per token here (single-threaded, no faster for 16
    // rows than for 1), so its row uses a short prompt and few tokens: its tok/s hardly depends
    // on either.
    let peer_sizes = Sizes { prompt: 16, decode: 8, repeats: 1 };
    let mut peer = Command::new(mlx_python);
    peer.arg(root.join("xtask/python/bench_mlx.py")).arg("--model").arg(&q4);
    peer.args(["--prompt", &peer_sizes.prompt.to_string(), "--decode", &peer_sizes.decode.to_string()]);
    peer.args(["--repeats", &peer_sizes.repeats.to_string()]);
    match capture(peer) {
        Ok(m) => md.push_str(&format!(
            "| {} (CPU), q4 checkpoint, prompt {} / decode {} tokens, 1 repeat | | | {} | {} | |\n\n",
            m["engine"].as_str().unwrap_or("mlx-lm"),
            peer_sizes.prompt,
            peer_sizes.decode,
            spread(&m["prefill_tok_s"], 2),
            spread(&m["decode_tok_s"], 3)
        )),
        Err(e) => md.push_str(&format!(
            "| mlx-lm (CPU) | not measured in this run: {} | | | | |\n\n",
            format!("{e:#}").replace('\n', " ").replace('|', "/")
        )),
    }
    let q4_bytes = runs[2].1["weight_bytes_per_decode_token"].as_f64().unwrap_or(f64::NAN);
    let q4_decode = med(&runs[2].1["decode_tok_s"]);
    md.push_str(&format!(
        "Targets: q4 reads ≤ 0.32× the bf16 bytes ({:.3}×: {}), q4 decode faster than bf16 ({:.3} vs {:.3} tok/s: {}).\n\n",
        q4_bytes / base_bytes,
        verdict(q4_bytes / base_bytes <= 0.32),
        q4_decode,
        med(&engine["decode_tok_s"]),
        verdict_noisy(q4_decode > med(&engine["decode_tok_s"]), overlap(&runs[2].1["decode_tok_s"], &engine["decode_tok_s"]))
    ));
    let mut quality = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    quality.current_dir(root).args(["run", "--release", "--example", "quality"]);
    let q = capture(quality)?;
    md.push_str(
        "Quality on the trained demo model (`cargo run --release --example quality`: the bf16 model's greedy answers \
         to its 30 questions, and the recipes quantized at load along them):\n\n\
         | recipe | mean KL (nats/token) | max KL | greedy answers identical | weight bytes vs bf16 |\n|---|---|---|---|---|\n",
    );
    let base_q = q["bf16_weight_bytes_per_decode_token"].as_f64().unwrap_or(f64::NAN);
    for r in q["recipes"].as_array().into_iter().flatten() {
        md.push_str(&format!(
            "| {} | {:.2e} | {:.2e} | {} / {} | {:.3}× |\n",
            r["recipe"].as_str().unwrap_or("?"),
            r["mean_kl_nats"].as_f64().unwrap_or(f64::NAN),
            r["max_kl_nats"].as_f64().unwrap_or(f64::NAN),
            r["identical_answers"],
            r["answers"],
            r["weight_bytes_per_decode_token"].as_f64().unwrap_or(f64::NAN) / base_q
        ));
    }
    md.push('\n');
    let big = model.with_file_name("qwen35-4b-random-mlx-q4");
    if !big.join("config.json").is_file() {
        let mut make = Command::new(mlx_python);
        make.arg(root.join("xtask/python/make_mlx.py")).arg("--root").arg(root).args(["--stage", "bench-4b"]);
        crate::run(make)?;
    }
    let tiny = Sizes { prompt: 8, decode: 2, repeats: 1 };
    let b = quantized_run(root, &big, &tiny)?;
    let gpu_mb = resident_mb(&b);
    md.push_str(&format!(
        "4B dimensions at 4 bits (random weights, mlx-lm layout, `{}`): loaded in {:.1} s, {:.0} MB of GPU buffers \
         allocated by the engine (weights, a session of {} tokens, scratch; counted by the engine), {:.0} MB \
         of weights read per decode token; decode {:.3} tok/s. Target ≤ 3 GB: {}.\n\n",
        big.display(),
        b["model_load_s"].as_f64().unwrap_or(f64::NAN),
        gpu_mb,
        b["session_positions"],
        b["weight_bytes_per_decode_token"].as_f64().unwrap_or(f64::NAN) / 1e6,
        med(&b["decode_tok_s"]),
        verdict(gpu_mb <= 3000.0)
    ));
    Ok(md)
}

/// Run the benchmark.
pub fn run(root: &Path, python: &Path, mlx_python: &Path, opts: &Options) -> Result<()> {
    let quick = opts.quick;
    let sizes =
        if quick { Sizes { prompt: 16, decode: 4, repeats: 1 } } else { Sizes { prompt: 128, decode: 64, repeats: 5 } };
    let dir = root.join("target/bench");
    let model = dir.join("qwen35-0.8b-random");
    let adapter = dir.join("qwen35-0.8b-random-lora-r16");
    if !model.join("model.safetensors").is_file() || !adapter.join("adapter_model.safetensors").is_file() {
        let mut make = Command::new(python);
        make.arg(root.join("xtask/python/make_fixtures.py")).arg("--root").arg(root).arg("--bench-model").arg(&model);
        crate::run(make)?;
    }
    let mut ours = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    ours.current_dir(root).args(["run", "--release", "--example", "bench", "--"]).arg("--model").arg(&model);
    ours.arg("--adapter").arg(&adapter);
    ours.args(["--prompt", &sizes.prompt.to_string(), "--decode", &sizes.decode.to_string()]);
    ours.args(["--repeats", &sizes.repeats.to_string(), "--chat-turns", "4", "--batch-sessions", "1,2,4,8"]);
    ours.arg("--fusion-ab");
    if opts.profile {
        ours.arg("--profile");
    }
    let engine = capture(ours)?;
    let earlier = match &opts.compare {
        Some(bin) => {
            let mut cmd = Command::new(bin);
            cmd.arg("--model").arg(&model).arg("--adapter").arg(&adapter);
            cmd.args(["--prompt", &sizes.prompt.to_string(), "--decode", &sizes.decode.to_string()]);
            cmd.args(["--repeats", &sizes.repeats.to_string(), "--learn-tokens", "0"]);
            Some(capture(cmd)?)
        }
        None => None,
    };
    let mut peers = Command::new(python);
    peers.arg(root.join("xtask/python/bench_peers.py")).arg("--model").arg(&model).arg("--adapter").arg(&adapter);
    peers.args(["--prompt", &sizes.prompt.to_string(), "--decode", &sizes.decode.to_string()]);
    peers.args(["--repeats", &sizes.repeats.to_string()]);
    let torch = capture(peers)?;
    let llama = llama_cpp(root, python).and_then(|src| {
        let mut cmd = Command::new(python);
        cmd.arg(root.join("xtask/python/bench_llama.py")).arg("--model").arg(&model).arg("--adapter").arg(&adapter);
        cmd.arg("--llama-src").arg(src).arg("--tokenizer-from").arg(root.join("examples/assets/demo"));
        cmd.arg("--out").arg(dir.join("gguf"));
        cmd.args(["--prompt", &sizes.prompt.to_string(), "--decode", &sizes.decode.to_string()]);
        cmd.args(["--repeats", &sizes.repeats.to_string()]);
        capture(cmd)
    });

    let a = &engine["adapter"];
    let floor = &engine["bandwidth_floor"];
    let swap = &a["swap_us"];
    let mut command = String::from("cargo xtask bench");
    if quick {
        command.push_str(" --quick");
    }
    if opts.profile {
        command.push_str(" --profile");
    }
    if let Some(bin) = &opts.compare {
        command.push_str(&format!(" --compare {}", bin.display()));
    }
    let mut md = String::new();
    md.push_str("# Benchmarks\n\n");
    md.push_str(&format!(
        "Latest `{command}` ({}): random bf16 weights at the Qwen3.5-0.8B text dimensions (24 layers, \
         H 1024, vocab 248,320, tied) and a rank-16 PEFT adapter on all 12 projections; prompt {} tokens, \
         {} decoded tokens, median of {} repeats after a warm-up. Machine: {}; our GPU adapter: {} ({}). \
         All figures of the table come from this one run.\n\n",
        chrono_free_date(),
        sizes.prompt,
        sizes.decode,
        sizes.repeats,
        machine(),
        engine["gpu"].as_str().unwrap_or("?"),
        engine["backend"].as_str().unwrap_or("?"),
    ));
    md.push_str(
        "Tokens/s as median (min–max). This engine's base, adapter and stacked runs alternate round by round, \
         and its overheads are the median of the rounds' ratios (least…most over the rounds), marked ≈ where \
         the rounds disagree on the sign; a peer's overhead is the ratio of its medians, marked ≈ where the \
         two ranges overlap. Either way ≈ means within this run's noise.\n\n",
    );
    md.push_str("| engine | prefill tok/s | prefill with adapter | prefill overhead | decode tok/s | decode with adapter | decode overhead |\n");
    md.push_str("|---|---|---|---|---|---|---|\n");

    md.push_str(&throughput_row(
        "this engine (wgpu)",
        [&engine["prefill_tok_s"], &a["prefill_tok_s"], &engine["decode_tok_s"], &a["decode_tok_s"]],
        rounds(a),
    ));
    let peer = |v: &Value, default: &str| {
        let name = v["engine"].as_str().unwrap_or(default).to_string();
        let keys = ["prefill_tok_s", "adapter_prefill_tok_s", "decode_tok_s", "adapter_decode_tok_s"];
        throughput_row(&name, keys.map(|k| &v[k]), [&Value::Null, &Value::Null])
    };
    if let (Some(e), Some(bin)) = (&earlier, &opts.compare) {
        let ea = &e["adapter"];
        md.push_str(&throughput_row(
            &format!("this engine, earlier build (`{}`)", bin.display()),
            [&e["prefill_tok_s"], &ea["prefill_tok_s"], &e["decode_tok_s"], &ea["decode_tok_s"]],
            rounds(ea),
        ));
    }
    md.push_str(&peer(&torch, "transformers + peft"));
    match &llama {
        Ok(l) => md.push_str(&(peer(l, "llama.cpp") + "\n")),
        Err(e) => {
            let why = format!("{e:#}").replace('\n', " ").replace('|', "/");
            md.push_str(&format!("| llama.cpp | not measured in this run: {why} | | | | | |\n\n"))
        }
    }
    md.push_str("| adapter operation | this engine | transformers + peft |\n|---|---|---|\n");
    md.push_str(&format!(
        "| switch adapters | median {:.2} µs, p99 {:.2} µs over {} swaps; {} bytes uploaded | `set_adapter` median {:.1} µs |\n",
        med(swap),
        swap["p99"].as_f64().unwrap_or(f64::NAN),
        swap["n"],
        a["swap_bytes_uploaded_total"],
        med(&torch["set_adapter_us"])
    ));
    md.push_str(&format!(
        "| load adapter ({:.1} MB file, warm file cache) | {:.1} ms (reading the file alone: {:.1} ms) | merge + unmerge {:.0} ms |\n\n",
        a["file_bytes"].as_f64().unwrap_or(0.0) / 1e6,
        med(&a["load_s"]) * 1e3,
        a["file_read_s"].as_f64().unwrap_or(f64::NAN) * 1e3,
        med(&torch["merge_plus_unmerge_s"]) * 1e3
    ));
    let f = |k: &str| floor[k].as_f64().unwrap_or(f64::NAN);
    md.push_str(&format!(
        "Bandwidth floor: a decode step reads {:.0} MB of weights. The device's streaming-read kernel \
         (16-byte loads, {} MiB per repeat) reads {:.2} GB/s, a floor of {:.0} ms per token",
        f("weight_bytes_per_decode_token") / 1e6,
        floor["stream_read_mib"],
        f("stream_read_gb_s"),
        f("floor_ms_per_token"),
    ));
    if floor["host_read_gb_s"].is_number() {
        md.push_str(&format!(
            "; the host reads the same bytes at {:.2} GB/s (all cores), a floor of {:.0} ms",
            f("host_read_gb_s"),
            f("host_floor_ms_per_token")
        ));
    }
    md.push_str(&format!(
        ". Measured: {:.0} ms per token, {:.1} % of the device floor",
        f("measured_ms_per_token"),
        f("decode_efficiency_of_floor") * 100.0
    ));
    if floor["host_read_gb_s"].is_number() {
        md.push_str(&format!(" and {:.1} % of the host floor", f("decode_efficiency_of_host_floor") * 100.0));
    }
    md.push_str(&format!(
        ".\n\nGreedy decode, counted by the engine: {} dispatches per token ({} with the adapter) as measured here \
         (norms and SwiGLU folded into the projections: {}), {} submit(s) and {} bytes read back per token; with \
         the fold (the default) {} dispatches ({} with the adapter), without it {} ({}).\n\n",
        engine["dispatches_per_token"],
        a["dispatches_per_token"],
        engine["fused_decode"],
        engine["submits_per_token"],
        engine["readback_bytes_per_token"],
        engine["dispatches_per_token_fused"],
        a["dispatches_per_token_fused"],
        engine["dispatches_per_token_unfused"],
        a["dispatches_per_token_unfused"],
    ));
    if let Some(sentence) = fusion_sentence(&engine["fusion_ab"]) {
        md.push_str(&sentence);
    }
    let sampled = &engine["sampled"];
    if sampled.is_object() {
        md.push_str(&format!(
            "Sampled decode ({}; candidates found on the GPU): {:.3} tok/s, {} bytes read back per token.\n\n",
            sampled["params"].as_str().unwrap_or("?"),
            med(&sampled["decode_tok_s"]),
            sampled["readback_bytes_per_token"],
        ));
    }
    md.push_str(&format!(
        "Targets: decode overhead with adapter ≤ 3 % ({}), prefill overhead ≤ 10 % ({}), swap ≤ 50 µs \
         with 0 bytes uploaded ({}), decode ≥ 70 % of the streaming-read floor ({}).\n\n",
        overhead_verdict(&engine["decode_tok_s"], &a["decode_tok_s"], rounds(a)[1], 3.0),
        overhead_verdict(&engine["prefill_tok_s"], &a["prefill_tok_s"], rounds(a)[0], 10.0),
        verdict(med(swap) <= 50.0 && a["swap_bytes_uploaded_total"].as_u64() == Some(0)),
        verdict(floor["decode_efficiency_of_floor"].as_f64().unwrap_or(0.0) >= 0.7)
    ));
    let stacked = &a["stacked"];
    if stacked.is_object() {
        let per_round = &stacked["decode_ratio_stacked_over_one_per_round"];
        md.push_str(&format!(
            "Adapter sets: two rank-16 adapters stacked (one shrink and one fused expand per group, rank 32): \
             prefill {} tok/s, decode {} tok/s, {} dispatches per greedy token; decode overhead against one \
             adapter {}. Target ≤ 3 %: {}.\n\n",
            spread(&stacked["prefill_tok_s"], 2),
            spread(&stacked["decode_tok_s"], 3),
            stacked["dispatches_per_token"],
            overhead_cell(&a["decode_tok_s"], &stacked["decode_tok_s"], per_round),
            overhead_verdict(&a["decode_tok_s"], &stacked["decode_tok_s"], per_round, 3.0),
        ));
    }
    if let Some(rows) = a["batched"].as_array().filter(|r| !r.is_empty()) {
        md.push_str(
            "Batched decode (sessions cycling through the adapter, a second copy and none, each its own set; \
             one step decodes a token of every session; the counts run round by round, and × one session is \
             the median over repeats of each repeat's ratio):\n\n| sessions | tok/s in all | × one session |\n|---|---|---|\n",
        );
        // Each repeat's rate over the same repeat's rate of one session (the median over repeats),
        // where the bench runs the counts round by round; else the ratio of the two medians.
        let one = rows.first().map_or(f64::NAN, |r| med(&r["decode_tok_s"]));
        let times =
            |r: &Value| r["speedup_over_first_paired"]["median"].as_f64().unwrap_or(med(&r["decode_tok_s"]) / one);
        for r in rows {
            md.push_str(&format!("| {} | {} | {:.2} |\n", r["sessions"], spread(&r["decode_tok_s"], 2), times(r)));
        }
        let eight = rows.iter().find(|r| r["sessions"] == 8).map_or(f64::NAN, times);
        md.push_str(&format!("\nTarget: 8 sessions ≥ 3× one: {}.\n\n", verdict(eight >= 3.0)));
    }
    let cache = &engine["prompt_cache"];
    if cache.is_object() {
        // The ratio of each repeat's two last turns, run back to back (its median), where the
        // bench reports it; else the ratio of the two medians.
        let ratio = |paired: &str, medians: &str| cache[paired]["median"].as_f64().or(cache[medians].as_f64());
        let speedup = ratio("speedup_paired", "speedup").unwrap_or(f64::NAN);
        let first = ratio("first_token_speedup_paired", "first_token_speedup").unwrap_or(f64::NAN);
        md.push_str(&format!(
            "Prompt cache: the last turn of a {}-turn chat ({}-token prompt, {} decoded tokens) takes {} s with \
             the cache and {} s without (a full prefill): {:.2}× faster; its first token comes after {} s with \
             the cache and {} s without: {:.2}× sooner (each the median over repeats of the ratio of the two \
             last turns, run back to back). Target ≥ 3×: the whole turn {}, the first token {}.\n\n",
            cache["turns"],
            cache["last_turn_prompt_tokens"],
            cache["decode_tokens"],
            spread(&cache["last_turn_s_with_cache"], 2),
            spread(&cache["last_turn_s_without_cache"], 2),
            speedup,
            spread(&cache["last_turn_first_token_s_with_cache"], 2),
            spread(&cache["last_turn_first_token_s_without_cache"], 2),
            first,
            verdict(speedup >= 3.0),
            verdict(first >= 3.0),
        ));
    }
    let learn = &engine["learn"];
    if !learn.is_null() {
        md.push_str(&format!(
            "Learning: one step on a {}-token event ({} response tokens; frozen forward, backward through \
             lm_head, the final norm and the last layer's MLP and attention, AdamW) with a rank-{} adapter on \
             the last layer's {}: {} s (median (min–max)).\n\n",
            learn["event_tokens"],
            learn["response_tokens"],
            learn["rank"],
            learn["targets"].as_str().unwrap_or("?"),
            spread(&learn["step_s"], 3)
        ));
    }
    md.push_str(&format!(
        "Memory (the engine's own count of GPU buffers): the model, two resident copies of the adapter and \
         a session of {} positions that has run (its caches, the scratch) hold {:.0} MB; over the whole run \
         the engine created {:.0} MB (a running total: the sessions and adapter loads it dropped count \
         too). Peak process RSS {:.0} MB.\n\n",
        engine["session_positions"],
        resident_mb(&engine),
        engine["gpu_bytes_allocated"].as_f64().unwrap_or(f64::NAN) / 1e6,
        engine["peak_rss_bytes"].as_f64().unwrap_or(f64::NAN) / 1e6
    ));
    match quantized_section(root, mlx_python, &model, &engine, &sizes) {
        Ok(q) => md.push_str(&q),
        Err(e) => md.push_str(&format!("Quantized weights: not measured in this run: {e:#}\n\n")),
    }
    let prof = &engine["profile"];
    if prof["timestamps"].as_bool() == Some(true) {
        md.push_str(&format!(
            "Profile (`{command}`, GPU timestamps around every dispatch, each in a pass of its own; base model): \
             greedy decode, per token over {} tokens:\n\n{}\nPrefill of {} tokens, per prompt token:\n\n{}\n",
            prof["decode_tokens"],
            profile_table(&prof["decode"]),
            prof["prefill_tokens"],
            profile_table(&prof["prefill"])
        ));
        let ap = &a["profile"];
        if ap["timestamps"].as_bool() == Some(true) {
            md.push_str(&format!(
                "With the adapter, greedy decode, per token over {} tokens:\n\n{}\n",
                ap["decode_tokens"],
                profile_table(&ap["decode"])
            ));
        }
    } else if opts.profile {
        md.push_str("Profile: the adapter has no TIMESTAMP_QUERY, so no per-kernel times were taken.\n\n");
    }
    md.push_str("Raw results of this run:\n\n```json\n");
    let llama = llama.as_ref().map(Value::clone).unwrap_or_else(|e| Value::String(format!("{e:#}")));
    md.push_str(&serde_json::to_string_pretty(
        &serde_json::json!({"engine": engine, "engine_earlier_build": earlier, "transformers_peft": torch, "llama_cpp": llama}),
    )?);
    md.push_str("\n```\n");
    let history = root.join("BENCHMARKS.md");
    let old = std::fs::read_to_string(&history).unwrap_or_default();
    // The hand-written sections after this run's: the GPU device checks, then the history.
    let kept = ["\n## On a GPU", "\n## History"].iter().filter_map(|h| old.find(h)).min().map_or("", |i| &old[i..]);
    std::fs::write(&history, md + kept)?;
    eprintln!("wrote {}", history.display());
    Ok(())
}

/// llama.cpp for the peer row: llama-cpp-python built from its source distribution into the
/// bench venv (the sdist also carries llama.cpp's GGUF converters); returns that source tree.
fn llama_cpp(root: &Path, python: &Path) -> Result<PathBuf> {
    let dir = root.join("target/bench/llama-cpp-python");
    let sdist = dir.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"));
    if !sdist.is_file() {
        let mut get = Command::new(python);
        get.args(["-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python"]);
        get.arg(format!("llama-cpp-python=={LLAMA_CPP_PYTHON}")).arg("-d").arg(&dir);
        crate::run(get).context("downloading the llama-cpp-python source distribution")?;
    }
    let src = dir.join(format!("llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp"));
    if !src.join("convert_lora_to_gguf.py").is_file() {
        let mut untar = Command::new("tar");
        untar.arg("xzf").arg(&sdist).arg("-C").arg(&dir);
        crate::run(untar).context("unpacking the llama-cpp-python source distribution")?;
    }
    let mut check = Command::new(python);
    check.args(["-c", &format!("import llama_cpp; assert llama_cpp.__version__ == '{LLAMA_CPP_PYTHON}'")]);
    if !check.output().map(|o| o.status.success()).unwrap_or(false) {
        let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        eprintln!("building llama-cpp-python {LLAMA_CPP_PYTHON} from source (about 200 compile steps)");
        let mut build = Command::new(python);
        build.args(["-m", "pip", "install", "-q"]).arg(&sdist).env("CMAKE_BUILD_PARALLEL_LEVEL", cores.to_string());
        crate::run(build).context("building llama-cpp-python from source")?;
    }
    Ok(src)
}

/// An overhead in % (median, least, most) from per-round ratios `with / without` (the bench
/// example's `*_per_round`: runs of the same round, interleaved), or None where the run has none
/// (an earlier build, a peer).
fn paired_overhead(ratios: &Value) -> Option<[f64; 3]> {
    let f = |k: &str| ratios[k].as_f64();
    Some([(1.0 - f("median")?) * 100.0, (1.0 - f("max")?) * 100.0, (1.0 - f("min")?) * 100.0])
}

/// An overhead cell: from per-round ratios where there are any (`median % (least…most per
/// round)`, marked ≈ when the rounds disagree on its sign), else from the two series' medians,
/// marked ≈ when their ranges overlap.
fn overhead_cell(without: &Value, with: &Value, ratios: &Value) -> String {
    match paired_overhead(ratios) {
        Some([m, lo, hi]) => {
            let mark = if lo <= 0.0 && hi >= 0.0 { "≈ " } else { "" };
            format!("{mark}{m:.1} % ({lo:.1}…{hi:.1} per round)")
        }
        None => {
            let mark = if overlap(without, with) { "≈ " } else { "" };
            format!("{mark}{:.1} %", (1.0 - med(with) / med(without)) * 100.0)
        }
    }
}

/// Whether an overhead meets `target` %, and whether that is within the run's noise: the
/// per-round overheads fall on both sides of the target (or, without rounds, the ranges overlap).
fn overhead_verdict(without: &Value, with: &Value, ratios: &Value, target: f64) -> &'static str {
    match paired_overhead(ratios) {
        Some([m, lo, hi]) => verdict_noisy(m <= target, lo <= target && hi > target),
        None => verdict_noisy((1.0 - med(with) / med(without)) * 100.0 <= target, overlap(without, with)),
    }
}

/// The per-round prefill and decode ratios of an adapter run over the base (Null in an earlier
/// build's JSON).
fn rounds(a: &Value) -> [&Value; 2] {
    [&a["prefill_ratio_adapter_over_base_per_round"], &a["decode_ratio_adapter_over_base_per_round"]]
}

/// One table row: prefill and decode tok/s without and with the adapter (median (min–max)) and
/// the adapter's overhead (see [`overhead_cell`]; `ratios`: the per-round prefill and decode
/// ratios, Null where there are none).
fn throughput_row(name: &str, [prefill, prefill_a, decode, decode_a]: [&Value; 4], ratios: [&Value; 2]) -> String {
    format!(
        "| {name} | {} | {} | {} | {} | {} | {} |\n",
        spread(prefill, 2),
        spread(prefill_a, 2),
        overhead_cell(prefill, prefill_a, ratios[0]),
        spread(decode, 3),
        spread(decode_a, 3),
        overhead_cell(decode, decode_a, ratios[1])
    )
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "met"
    } else {
        "not met"
    }
}

fn verdict_noisy(ok: bool, noisy: bool) -> &'static str {
    match (ok, noisy) {
        (true, false) => "met",
        (true, true) => "met by the medians, within this run's noise",
        (false, true) => "not met by the medians, within this run's noise",
        (false, false) => "not met",
    }
}

fn chrono_free_date() -> String {
    Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The report's sentence on the bench's `fusion_ab` object (fused against unfused greedy decode,
/// per-round ratios), if the run has one.
fn fusion_sentence(fusion: &Value) -> Option<String> {
    let ratio = |set: &str| {
        let r = &fusion[set]["ratio_fused_over_unfused"];
        let bound = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
        r.is_object().then(|| format!("{:.3} ({:.3}–{:.3})", med(r), bound("min"), bound("max")))
    };
    let base = ratio("base")?;
    let adapter = ratio("adapter").map(|r| format!(", with the adapter {r}")).unwrap_or_default();
    Some(format!(
        "Fused against unfused greedy decode on this adapter ({} rounds of {}-token blocks alternating in one \
         generation; tok/s ratio per round, median (min–max)): base {base}{adapter}.\n\n",
        fusion["rounds"], fusion["block_tokens"],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(median: f64, min: f64, max: f64) -> Value {
        serde_json::json!({"median": median, "min": min, "max": max})
    }

    #[test]
    fn overheads_come_from_the_rounds_where_there_are_any() {
        let (without, with) = (series(10.0, 9.0, 11.0), series(9.0, 8.5, 9.5));
        // Per round, the adapter ran at 0.98 (0.975–0.99) of the base: 2 %, all rounds under 3 %.
        let rounds = series(0.98, 0.975, 0.99);
        assert_eq!(overhead_cell(&without, &with, &rounds), "2.0 % (1.0…2.5 per round)");
        assert_eq!(overhead_verdict(&without, &with, &rounds, 3.0), "met");
        // Rounds on both sides of the target and of zero.
        let rounds = series(0.98, 0.95, 1.01);
        assert_eq!(overhead_cell(&without, &with, &rounds), "≈ 2.0 % (-1.0…5.0 per round)");
        assert_eq!(overhead_verdict(&without, &with, &rounds, 3.0), "met by the medians, within this run's noise");
        let rounds = series(0.95, 0.94, 0.96);
        assert_eq!(overhead_verdict(&without, &with, &rounds, 3.0), "not met");
        // No rounds (a peer, an earlier build): the ratio of the medians, ranges compared.
        assert_eq!(overhead_cell(&without, &with, &Value::Null), "≈ 10.0 %");
        assert_eq!(
            overhead_verdict(&without, &with, &Value::Null, 3.0),
            "not met by the medians, within this run's noise"
        );
        let apart = series(8.0, 7.9, 8.1);
        assert_eq!(overhead_cell(&without, &apart, &Value::Null), "20.0 %");
        assert_eq!(overhead_verdict(&without, &apart, &Value::Null, 10.0), "not met");
    }

    #[test]
    fn the_fusion_sentence_gives_each_set_its_per_round_ratios() {
        assert_eq!(fusion_sentence(&Value::Null), None);
        let fusion = serde_json::json!({
            "rounds": 6,
            "block_tokens": 8,
            "base": {"ratio_fused_over_unfused": series(0.8, 0.6, 1.0)},
            "adapter": {"ratio_fused_over_unfused": series(0.9125, 0.85, 1.2)},
        });
        let sentence = fusion_sentence(&fusion).expect("a fusion object");
        assert!(sentence.contains("(6 rounds of 8-token blocks"), "{sentence}");
        assert!(sentence.contains("base 0.800 (0.600–1.000), with the adapter 0.912 (0.850–1.200)."), "{sentence}");
        let base_only = serde_json::json!({"rounds": 2, "block_tokens": 8, "base": fusion["base"].clone()});
        assert!(fusion_sentence(&base_only).expect("a base ratio").contains("base 0.800 (0.600–1.000).\n"));
    }
}
