//! The README's main command: greedy or sampled generation from token ids on the embedded
//! default model (or `--model DIR`). Tokens stream to stdout; timings go to stderr.
//!
//! `cargo run --release --example generate [-- --model DIR --ids 1,2,3 --max-tokens 32]`

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use qwen35_wgpu::{GenerateParams, GpuContext, Model, Session, SessionOptions};

#[derive(Parser)]
struct Args {
    /// Checkpoint directory (default: the embedded tiny random-weight model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4,5")]
    ids: Vec<u32>,
    /// Most new tokens.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let dir = args
        .model
        .clone()
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/assets/tiny-qwen35"));
    let t0 = Instant::now();
    let ctx = Arc::new(GpuContext::new()?);
    eprintln!("adapter: {} ({:?})", ctx.info.name, ctx.info.backend);
    let model = Arc::new(Model::load(ctx, &dir).with_context(|| format!("loading {}", dir.display()))?);
    eprintln!("loaded {} in {:.2} s ({} layers)", dir.display(), t0.elapsed().as_secs_f64(), model.config.num_layers());
    let mut session = Session::new(
        model,
        SessionOptions { max_context: args.ids.len() + args.max_tokens + 1, ..Default::default() },
    )?;
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        stop_at_eos: true,
    };
    println!("prompt: {:?}", args.ids);
    print!("tokens:");
    let t1 = Instant::now();
    let mut first = None;
    let out = session.generate(&args.ids, &params, |t| {
        first.get_or_insert_with(|| t1.elapsed());
        print!(" {t}");
        let _ = std::io::stdout().flush();
        true
    })?;
    println!();
    let total = t1.elapsed().as_secs_f64();
    let prefill = first.map(|d| d.as_secs_f64()).unwrap_or(total);
    let decode_tps = if out.len() > 1 { (out.len() - 1) as f64 / (total - prefill) } else { 0.0 };
    eprintln!(
        "{} prompt tokens in {:.1} ms, {} new tokens, decode {:.1} tok/s",
        args.ids.len(),
        prefill * 1e3,
        out.len(),
        decode_tps
    );
    Ok(())
}
