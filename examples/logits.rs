//! Parity debugging: run a prompt and write its logits (and optionally a greedy continuation)
//! to a safetensors file.
//!
//! `cargo run --release --example logits -- --model DIR --ids 1,2,3 [--generate N] [--adapter PATH[:SCALE]] [--quantize q8|q4|q4-quality] --out FILE.safetensors`
//!
//! `--adapter` applies a PEFT adapter (directory or `.safetensors` file); SCALE after the last
//! colon may be negative and defaults to 1. One adapter at a time (no stacking); a failed load
//! exits non-zero with the error on stderr.
//!
//! Writes `logits` (`[T, vocab]`, f32) and, with `--generate N`, `generated` (`[N]`, i64,
//! computed with the KV/recurrent cache). Stdout gets one line of JSON; errors go to stderr.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Parser;
use qwen35_wgpu::{
    GenerateParams, GpuContext, LoadOptions, LoraAdapter, Model, QuantizeRecipe, Session, SessionOptions,
};
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
    /// PEFT adapter, `PATH[:SCALE]`.
    #[arg(long)]
    adapter: Option<String>,
    /// Output safetensors file.
    #[arg(long)]
    out: PathBuf,
    /// Quantize the checkpoint's 16/32-bit matrices at load: `q8` or `q4` (MLX's affine layout,
    /// group 64, as `mlx_lm.convert` makes it) or `q4-quality` (sensitive tensors at 8 bits or
    /// kept in 16-bit).
    #[arg(long, value_parser = parse_quantize)]
    quantize: Option<QuantizeRecipe>,
}

fn parse_quantize(s: &str) -> Result<QuantizeRecipe, String> {
    QuantizeRecipe::parse(s).ok_or_else(|| format!("expected q8, q4 or q4-quality, found {s:?}"))
}

/// `PATH[:SCALE]`: the scale is whatever follows the last colon, if it parses as a number.
fn parse_adapter(spec: &str) -> (PathBuf, f32) {
    if let Some((path, scale)) = spec.rsplit_once(':') {
        if let Ok(s) = scale.parse::<f32>() {
            return (PathBuf::from(path), s);
        }
    }
    (PathBuf::from(spec), 1.0)
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let ctx = Arc::new(GpuContext::new()?);
    let model = Arc::new(
        Model::load_with(ctx.clone(), &args.model, &LoadOptions { quantize: args.quantize, ..Default::default() })
            .with_context(|| format!("loading {}", args.model.display()))?,
    );
    let opts = SessionOptions { max_context: args.ids.len() + args.generate + 1, ..Default::default() };
    let adapter = match &args.adapter {
        Some(spec) => {
            let (path, scale) = parse_adapter(spec);
            let a = LoraAdapter::load(&model, &path).with_context(|| format!("loading adapter {}", path.display()))?;
            Some((Arc::new(a), scale))
        }
        None => None,
    };
    let session = |model: &Arc<Model>| -> Result<Session> {
        let mut s = Session::new(model.clone(), opts.clone())?;
        s.set_adapter(adapter.clone())?;
        Ok(s)
    };
    let logits = session(&model)?.feed_all(&args.ids)?;
    let generated: Vec<i64> = if args.generate > 0 {
        let params = GenerateParams { max_tokens: args.generate, stop_at_eos: false, ..Default::default() };
        session(&model)?.generate(&args.ids, &params, |_| true)?.into_iter().map(i64::from).collect()
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
        "adapter": adapter.as_ref().map(|(a, s)| serde_json::json!({"name": a.info.name, "scale": s, "ranks": a.info.ranks})),
        "prompt_tokens": logits.rows,
        "vocab": logits.vocab,
        "generated": generated,
        "out": args.out,
    });
    println!("{summary}");
    Ok(())
}
