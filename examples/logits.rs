//! Parity debugging: run a prompt and write its logits (and optionally a greedy continuation)
//! to a safetensors file.
//!
//! `cargo run --release --example logits -- --model DIR --ids 1,2,3 [--generate N] --out FILE.safetensors`
//!
//! Writes `logits` (`[T, vocab]`, f32) and, with `--generate N`, `generated` (`[N]`, i64,
//! computed with the KV/recurrent cache). Stdout gets one line of JSON; errors go to stderr.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use qwen35_wgpu::{GenerateParams, GpuContext, Model, Session, SessionOptions};
use safetensors::tensor::TensorView;

#[derive(Parser)]
struct Args {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    ids: Vec<u32>,
    /// Greedy tokens to generate after the prompt.
    #[arg(long, default_value_t = 0)]
    generate: usize,
    /// Output safetensors file.
    #[arg(long)]
    out: PathBuf,
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let ctx = Arc::new(GpuContext::new()?);
    let model =
        Arc::new(Model::load(ctx.clone(), &args.model).with_context(|| format!("loading {}", args.model.display()))?);
    let opts = SessionOptions {
        max_context: args.ids.len() + args.generate + 1,
        ..Default::default()
    };
    let logits = Session::new(model.clone(), opts.clone())?.feed_all(&args.ids)?;
    let generated: Vec<i64> = if args.generate > 0 {
        let params = GenerateParams {
            max_tokens: args.generate,
            stop_at_eos: false,
            ..Default::default()
        };
        Session::new(model.clone(), opts)?
            .generate(&args.ids, &params, |_| true)?
            .into_iter()
            .map(i64::from)
            .collect()
    } else {
        Vec::new()
    };
    let logit_bytes: Vec<u8> = logits.data.iter().flat_map(|v| v.to_le_bytes()).collect();
    let gen_bytes: Vec<u8> = generated.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut tensors = HashMap::new();
    tensors.insert(
        "logits".to_string(),
        TensorView::new(safetensors::Dtype::F32, vec![logits.rows, logits.vocab], &logit_bytes)?,
    );
    if args.generate > 0 {
        tensors.insert(
            "generated".to_string(),
            TensorView::new(safetensors::Dtype::I64, vec![generated.len()], &gen_bytes)?,
        );
    }
    safetensors::serialize_to_file(tensors, None, &args.out)?;
    let summary = serde_json::json!({
        "model": args.model,
        "gpu": ctx.info.name,
        "prompt_tokens": logits.rows,
        "vocab": logits.vocab,
        "generated": generated,
        "out": args.out,
    });
    println!("{summary}");
    Ok(())
}
