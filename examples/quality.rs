//! What quantization costs on the embedded demo model: per-token KL divergence of the q8, q4 and
//! q4-quality recipes (load-time quantization) from the bf16 model over its greedy
//! answers to 30 demo questions, and how many of the 30 greedy answers stay identical.
//!
//! `cargo run --release --example quality [-- --model DIR --max-tokens 32]`
//!
//! A table goes to stderr, one JSON line to stdout (read by `cargo xtask bench`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use qwen35_wgpu::{
    ChatMessage, GenerateParams, GpuContext, LoadOptions, Model, QuantizeRecipe, Session, SessionOptions, TextTokenizer,
};

/// The things of the demo corpus (`xtask/python/train_demo.py`), one question each.
const THINGS: [&str; 30] = [
    "sky", "sea", "grass", "leaf", "cat", "dog", "horse", "cow", "bird", "fish", "apple", "banana", "lemon", "cherry",
    "car", "bus", "train", "bike", "door", "table", "chair", "bed", "book", "pen", "snow", "cloud", "rose", "tulip",
    "moon", "sun",
];

#[derive(Parser)]
struct Args {
    /// Model directory (default: the embedded demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
}

/// log-softmax of one logits row, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln() + max;
    row.iter().map(|&v| v as f64 - lse).collect()
}

/// KL(p ‖ q) of two logits rows, in nats.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum()
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dir =
        args.model.clone().unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/assets/demo"));
    let ctx = Arc::new(GpuContext::new()?);
    let tokenizer = TextTokenizer::from_dir(&dir)?;
    let load = |quantize| -> Result<Arc<Model>> {
        let opts = LoadOptions { quantize, ..Default::default() };
        Ok(Arc::new(Model::load_with(ctx.clone(), &dir, &opts).with_context(|| format!("loading {}", dir.display()))?))
    };
    let base = load(None)?;
    let opts = SessionOptions { max_context: 256, max_batch: 128 };
    let params = GenerateParams { max_tokens: args.max_tokens, ..Default::default() };
    // The bf16 model's answers and the logits along them.
    let mut cases = Vec::new();
    for thing in THINGS {
        let prompt =
            tokenizer.apply_chat_template(&[ChatMessage::new("user", &format!("What color is the {thing}?"))])?;
        let ids = tokenizer.encode(&prompt)?;
        let answer = Session::new(base.clone(), opts.clone())?.generate(&ids, &params, |_| true)?;
        let all: Vec<u32> = ids.iter().chain(&answer).copied().collect();
        let logits = Session::new(base.clone(), opts.clone())?.feed_all(&all[..all.len() - 1])?;
        cases.push((ids, answer, logits));
    }
    let mut rows = Vec::new();
    for (name, recipe) in
        [("q8", QuantizeRecipe::Q8), ("q4", QuantizeRecipe::Q4), ("q4-quality", QuantizeRecipe::Q4Quality)]
    {
        let q = load(Some(recipe))?;
        let (mut sum, mut max, mut tokens, mut same) = (0.0f64, 0.0f64, 0usize, 0usize);
        for (ids, answer, want) in &cases {
            let all: Vec<u32> = ids.iter().chain(answer).copied().collect();
            let got = Session::new(q.clone(), opts.clone())?.feed_all(&all[..all.len() - 1])?;
            for pos in ids.len() - 1..all.len() - 1 {
                let d = kl(want.row(pos).context("a reference row")?, got.row(pos).context("a row")?);
                sum += d;
                max = max.max(d);
                tokens += 1;
            }
            let q_answer = Session::new(q.clone(), opts.clone())?.generate(ids, &params, |_| true)?;
            same += usize::from(&q_answer == answer);
        }
        eprintln!(
            "{name}: mean KL {:.2e} nats/token, max {:.2e}, over {tokens} answer tokens; {same}/{} greedy answers identical; {:.1} MB of weights per decode token (bf16 {:.1})",
            sum / tokens as f64,
            max,
            cases.len(),
            q.decode_weight_bytes() as f64 / 1e6,
            base.decode_weight_bytes() as f64 / 1e6
        );
        rows.push(serde_json::json!({
            "recipe": name,
            "mean_kl_nats": sum / tokens as f64,
            "max_kl_nats": max,
            "answer_tokens": tokens,
            "identical_answers": same,
            "answers": cases.len(),
            "weight_bytes_per_decode_token": q.decode_weight_bytes(),
        }));
    }
    println!(
        "{}",
        serde_json::json!({"model": dir, "bf16_weight_bytes_per_decode_token": base.decode_weight_bytes(), "recipes": rows})
    );
    Ok(())
}
