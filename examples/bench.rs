//! Engine throughput on one checkpoint: model load, batched prefill and cached decode (median of
//! repeats after a warm-up), and with `--adapter`: the same with a LoRA adapter applied, the
//! adapter's load time against reading its file, and adapter swaps between tokens (latency and
//! bytes uploaded); then one learning step (forward of an event, backward, AdamW) on a rank-16
//! trainable adapter. Prints one JSON line on stdout; `cargo xtask bench` drives it together with
//! its peers.
//!
//! `cargo run --release --example bench -- --model DIR [--adapter DIR] [--prompt 128] [--decode 64] [--repeats 5]`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use qwen35_wgpu::gpu::{IoBindCache, Recorder};
use qwen35_wgpu::runtime::argmax;
use qwen35_wgpu::{
    GpuContext, LearnOptions, LlmBackend, LoraAdapter, Model, Session, SessionOptions, Signal, TokenEvent, TrainSpec,
    WgpuBackend,
};

#[derive(Parser)]
struct Args {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// A PEFT adapter directory to measure as well.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Tokens decoded after the prompt.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Timed repeats (after one warm-up).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Adapter swaps timed.
    #[arg(long, default_value_t = 1000)]
    swaps: usize,
    /// MiB copied per repeat by the bandwidth yardstick (0 = skip).
    #[arg(long, default_value_t = 128)]
    copy_mib: u64,
    /// Tokens of the learning step's event (half prompt, half response; 0 = skip).
    #[arg(long, default_value_t = 64)]
    learn_tokens: usize,
}

/// The device's copy bandwidth (bytes read + written per second), median of 5 after a warm-up.
fn copy_bandwidth(ctx: &GpuContext, mib: u64) -> Result<f64> {
    let bytes = (mib << 20).min(ctx.max_binding()) / 16 * 16;
    let src = ctx.storage_buffer("copy src", bytes, true)?;
    let dst = ctx.storage_buffer("copy dst", bytes, true)?;
    let arena = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("copy arena"),
        size: 256,
        usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut cache = IoBindCache::new(arena);
    let mut times = Vec::new();
    for rep in 0..6 {
        let t = Instant::now();
        let mut rec = Recorder::new(ctx, &mut cache);
        qwen35_wgpu::kernels::misc::copy(&mut rec, &src, &dst, bytes)?;
        rec.submit()?;
        ctx.device.poll(wgpu::PollType::wait_indefinitely())?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok(2.0 * bytes as f64 / times[times.len() / 2])
}

#[derive(Default)]
struct Series(Vec<f64>);

impl Series {
    /// The value at quantile `q` of the sorted series (NaN when empty).
    fn quantile(&self, q: f64) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return f64::NAN;
        }
        v[((v.len() - 1) as f64 * q).round() as usize]
    }

    fn median(&self) -> f64 {
        self.quantile(0.5)
    }

    fn json(&self) -> serde_json::Value {
        if self.0.is_empty() {
            return serde_json::Value::Null;
        }
        let q = |x| self.quantile(x);
        serde_json::json!({"median": q(0.5), "min": q(0.0), "max": q(1.0), "p99": q(0.99), "n": self.0.len()})
    }
}

/// Prefill `ids` then decode `decode` greedy tokens; returns (prefill tok/s, decode tok/s).
fn run(session: &mut Session, ids: &[u32], decode: usize) -> Result<(f64, f64)> {
    session.reset();
    let t = Instant::now();
    let mut logits = session.feed(ids)?;
    let p = t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..decode {
        logits = session.feed(&[argmax(logits.last())])?;
    }
    Ok((ids.len() as f64 / p, decode as f64 / t.elapsed().as_secs_f64()))
}

fn measure(session: &mut Session, ids: &[u32], args: &Args, label: &str) -> Result<(Series, Series)> {
    let (mut prefill, mut decode) = (Series::default(), Series::default());
    for rep in 0..=args.repeats {
        let (p, d) = run(session, ids, args.decode)?;
        eprintln!("{label} rep {rep}: prefill {p:.2} tok/s, decode {d:.2} tok/s");
        if rep > 0 {
            prefill.0.push(p);
            decode.0.push(d);
        }
    }
    Ok((prefill, decode))
}

fn main() -> Result<()> {
    let args = Args::parse();
    let ctx = Arc::new(GpuContext::new()?);
    let t = Instant::now();
    let model = Arc::new(Model::load(ctx.clone(), &args.model)?);
    let load_s = t.elapsed().as_secs_f64();
    let vocab = model.config.vocab_size as u32;
    let ids: Vec<u32> = (0..args.prompt as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let opts = SessionOptions { max_context: args.prompt + 3 * args.decode + 16, max_batch: args.prompt.max(1) };
    let mut session = Session::new(model.clone(), opts)?;
    let (prefill, decode) = measure(&mut session, &ids, &args, "base")?;
    let weight_bytes = model.decode_weight_bytes();
    let bandwidth = if args.copy_mib > 0 { Some(copy_bandwidth(&ctx, args.copy_mib)?) } else { None };
    let floor = bandwidth.map(|bw| {
        let per_token = 1.0 / decode.median();
        let floor_s = weight_bytes as f64 / bw;
        serde_json::json!({
            "copy_bandwidth_gb_s": bw / 1e9,
            "weight_bytes_per_decode_token": weight_bytes,
            "floor_ms_per_token": floor_s * 1e3,
            "measured_ms_per_token": per_token * 1e3,
            "decode_efficiency_of_floor": floor_s / per_token,
        })
    });
    let mut summary = serde_json::json!({
        "gpu": ctx.info.name,
        "backend": format!("{:?}", ctx.info.backend),
        "model": args.model,
        "model_load_s": load_s,
        "prompt_tokens": args.prompt,
        "decode_tokens": args.decode,
        "repeats": args.repeats,
        "prefill_tok_s": prefill.json(),
        "decode_tok_s": decode.json(),
        "bandwidth_floor": floor,
    });
    if let Some(path) = &args.adapter {
        let file = path.join("adapter_model.safetensors");
        let bytes = std::fs::read(&file)?.len();
        let t = Instant::now();
        std::fs::read(&file)?;
        let read_s = t.elapsed().as_secs_f64();
        let mut loads = Series::default();
        let mut adapter = None;
        for _ in 0..3 {
            let t = Instant::now();
            let a = LoraAdapter::load(&model, path)?;
            ctx.device.poll(wgpu::PollType::wait_indefinitely())?;
            loads.0.push(t.elapsed().as_secs_f64());
            adapter = Some(Arc::new(a));
        }
        let adapter = adapter.expect("loaded three times");
        session.set_adapter(Some((adapter.clone(), 1.0)))?;
        let (lp, ld) = measure(&mut session, &ids, &args, "adapter")?;
        let second = Arc::new(LoraAdapter::load(&model, path)?);
        let before = ctx.bytes_uploaded();
        let mut swaps = Series::default();
        for i in 0..args.swaps {
            let next = if i % 2 == 0 { second.clone() } else { adapter.clone() };
            let t = Instant::now();
            session.set_adapter(Some((next, 1.0)))?;
            swaps.0.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let swap_bytes = ctx.bytes_uploaded() - before;
        // Decode while switching adapters before every token, against a fixed adapter.
        session.reset();
        let mut logits = session.feed(&ids[..8.min(ids.len())])?;
        let steps = args.decode.min(32);
        let count = |s: &mut Session, swap: bool, logits: &mut qwen35_wgpu::Logits| -> Result<(f64, u64)> {
            let b0 = ctx.bytes_uploaded();
            let t = Instant::now();
            for i in 0..steps {
                if swap {
                    s.set_adapter(Some((if i % 2 == 0 { second.clone() } else { adapter.clone() }, 1.0)))?;
                }
                *logits = s.feed(&[argmax(logits.last())])?;
            }
            Ok((steps as f64 / t.elapsed().as_secs_f64(), (ctx.bytes_uploaded() - b0) / steps as u64))
        };
        let (fixed_tps, fixed_bytes) = count(&mut session, false, &mut logits)?;
        let (swap_tps, swap_step_bytes) = count(&mut session, true, &mut logits)?;
        let ratio = |a: &Series, b: &Series| a.median() / b.median();
        summary["adapter"] = serde_json::json!({
            "path": path,
            "ranks": adapter.info.ranks,
            "modules": adapter.info.modules.len(),
            "file_bytes": bytes,
            "file_read_s": read_s,
            "load_s": loads.json(),
            "gpu_bytes": adapter.info.gpu_bytes,
            "prefill_tok_s": lp.json(),
            "decode_tok_s": ld.json(),
            "prefill_ratio_adapter_over_base": ratio(&lp, &prefill),
            "decode_ratio_adapter_over_base": ratio(&ld, &decode),
            "swap_us": swaps.json(),
            "swap_bytes_uploaded_total": swap_bytes,
            "decode_fixed_adapter_tok_s": fixed_tps,
            "decode_swapping_every_token_tok_s": swap_tps,
            "bytes_uploaded_per_decode_step_fixed": fixed_bytes,
            "bytes_uploaded_per_decode_step_swapping": swap_step_bytes,
        });
    }
    summary["gpu_bytes_allocated"] = ctx.bytes_allocated().into();
    summary["peak_rss_bytes"] = peak_rss().into();
    drop((session, model));
    if args.learn_tokens >= 2 {
        summary["learn"] = learn_step(&ctx, &args, &ids)?;
    }
    println!("{summary}");
    Ok(())
}

/// Time learning steps of one supervised event of `--learn-tokens` tokens on a rank-16 adapter
/// over the seven projections of the last layer (median after a warm-up step).
fn learn_step(ctx: &Arc<GpuContext>, args: &Args, ids: &[u32]) -> Result<serde_json::Value> {
    let n = args.learn_tokens;
    let opts = SessionOptions { max_context: n, max_batch: n };
    let mut backend = WgpuBackend::with_context(ctx.clone(), opts);
    backend.load_model(&args.model)?;
    backend.create_trainable_adapter(&TrainSpec { rank: 16, alpha: 32.0, ..Default::default() })?;
    let all: Vec<u32> = ids.iter().cycle().take(n).copied().collect();
    let event =
        TokenEvent { prompt: all[..n / 2].to_vec(), response: all[n / 2..].to_vec(), signal: Signal::Preferred };
    let mut steps = Series::default();
    for rep in 0..=args.repeats {
        let t = Instant::now();
        let report = backend.learn_tokens(std::slice::from_ref(&event), &LearnOptions::default())?;
        let s = t.elapsed().as_secs_f64();
        eprintln!("learn rep {rep}: {s:.3} s, mean CE {:.3}", report.event_ce[0]);
        if rep > 0 {
            steps.0.push(s);
        }
    }
    Ok(serde_json::json!({
        "event_tokens": n,
        "response_tokens": n - n / 2,
        "rank": 16,
        "targets": "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        "step_s": steps.json(),
    }))
}

/// The process's peak resident set (VmHWM), 0 where /proc is absent.
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1024)
}
