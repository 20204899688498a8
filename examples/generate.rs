//! Chat with a model: render the question with the model's chat template, stream the answer.
//!
//! `cargo run --release --example generate -- [--model DIR] [--adapter DIR[:SCALE]] [--prompt TEXT]
//!  [--quantize q8|q4|q4-quality] [--max-tokens N] [--temperature T --top-k K --top-p P --seed S] [--repetition-penalty R] [--stop S]`
//!
//! Defaults to the embedded demo model. The answer streams to stdout; timings go to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use qwen35_wgpu::{ChatMessage, GenerateParams, LlmBackend, LoadOptions, QuantizeRecipe, SessionOptions, WgpuBackend};

#[derive(Parser)]
struct Args {
    /// Model directory (default: the embedded demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// PEFT adapter, `PATH[:SCALE]`.
    #[arg(long)]
    adapter: Option<String>,
    /// Quantize the checkpoint's 16/32-bit matrices at load: `q8` or `q4` (MLX's affine layout,
    /// group 64, as `mlx_lm.convert` makes it) or `q4-quality` (sensitive tensors at 8 bits or
    /// kept in 16-bit).
    #[arg(long, value_parser = parse_quantize)]
    quantize: Option<QuantizeRecipe>,
    /// The user's message.
    #[arg(long, default_value = "What color is the sky?")]
    prompt: String,
    /// Most new tokens.
    #[arg(long, default_value_t = 64)]
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
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Stop strings.
    #[arg(long)]
    stop: Vec<String>,
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let dir =
        args.model.clone().unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/assets/demo"));
    let mut backend = WgpuBackend::new(SessionOptions { max_context: 1024, max_batch: 128 })?;
    eprintln!("adapter: {} ({:?})", backend.context().info.name, backend.context().info.backend);
    let t = Instant::now();
    let load = LoadOptions { quantize: args.quantize, ..Default::default() };
    backend.load_model_with(&dir, &load).with_context(|| format!("loading {}", dir.display()))?;
    eprintln!("loaded {} in {:.2} s", dir.display(), t.elapsed().as_secs_f64());
    if let Some(spec) = &args.adapter {
        let (path, scale) = match spec.rsplit_once(':').and_then(|(p, s)| Some((p, s.parse::<f32>().ok()?))) {
            Some((p, s)) => (PathBuf::from(p), s),
            None => (PathBuf::from(spec), 1.0),
        };
        backend.load_adapter(&path, scale).with_context(|| format!("loading adapter {}", path.display()))?;
    }
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        seed: args.seed,
        repetition_penalty: args.repetition_penalty,
        stop: args.stop.clone(),
        stop_at_eos: true,
    };
    let t = Instant::now();
    let mut deltas = 0;
    backend.chat(&[ChatMessage::new("user", &args.prompt)], &params, &mut |d| {
        deltas += 1;
        print!("{d}");
        let _ = std::io::stdout().flush();
        true
    })?;
    println!();
    eprintln!("{deltas} text deltas in {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    Ok(())
}

fn parse_quantize(s: &str) -> Result<QuantizeRecipe, String> {
    QuantizeRecipe::parse(s).ok_or_else(|| format!("expected q8, q4 or q4-quality, found {s:?}"))
}
