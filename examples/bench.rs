//! Engine throughput on one checkpoint: model load, batched prefill and cached decode, median of
//! repeats after a warm-up. (`cargo xtask bench` will drive this together with its peers.)
//!
//! `cargo run --release --example bench -- --model DIR [--prompt 128] [--decode 64] [--repeats 5]`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use qwen35_wgpu::{GpuContext, Model, Session, SessionOptions};

#[derive(Parser)]
struct Args {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Tokens decoded after the prompt.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Timed repeats (after one warm-up).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args = Args::parse();
    let ctx = Arc::new(GpuContext::new()?);
    let t = Instant::now();
    let model = Arc::new(Model::load(ctx.clone(), &args.model)?);
    let load_s = t.elapsed().as_secs_f64();
    let vocab = model.config.vocab_size as u32;
    let ids: Vec<u32> = (0..args.prompt as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let opts = SessionOptions { max_context: args.prompt + args.decode + 1, max_batch: args.prompt.max(1) };
    let mut session = Session::new(model, opts)?;
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for rep in 0..=args.repeats {
        session.reset();
        let t = Instant::now();
        let mut logits = session.feed(&ids)?;
        let p = t.elapsed().as_secs_f64();
        let t = Instant::now();
        for _ in 0..args.decode {
            let next = qwen35_wgpu::runtime::argmax(logits.last());
            logits = session.feed(&[next])?;
        }
        let d = t.elapsed().as_secs_f64();
        eprintln!("rep {rep}: prefill {:.1} tok/s, decode {:.2} tok/s", args.prompt as f64 / p, args.decode as f64 / d);
        if rep > 0 {
            prefill.push(args.prompt as f64 / p);
            decode.push(args.decode as f64 / d);
        }
    }
    let summary = serde_json::json!({
        "gpu": ctx.info.name,
        "backend": format!("{:?}", ctx.info.backend),
        "model": args.model,
        "load_s": load_s,
        "prompt": args.prompt,
        "prefill_tok_s_median": median(prefill.clone()),
        "prefill_tok_s_min_max": [prefill.iter().cloned().fold(f64::MAX, f64::min), prefill.iter().cloned().fold(0.0, f64::max)],
        "decode_tokens": args.decode,
        "decode_tok_s_median": median(decode.clone()),
        "decode_tok_s_min_max": [decode.iter().cloned().fold(f64::MAX, f64::min), decode.iter().cloned().fold(0.0, f64::max)],
        "repeats": args.repeats,
    });
    println!("{summary}");
    Ok(())
}
