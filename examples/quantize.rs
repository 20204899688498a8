//! Quantize a Hugging Face Qwen 3.5 checkpoint and save it as an MLX directory, the one
//! `mlx_lm.convert` would write (`mlx_lm.load` reads it; so does this engine).
//!
//! `cargo run --release --example quantize -- --model DIR --out DIR [--bits 4|8] [--recipe q4-quality]`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use qwen35_wgpu::model::save_mlx;
use qwen35_wgpu::QuantizeRecipe;

#[derive(Parser)]
struct Args {
    /// The Hugging Face checkpoint directory (bf16, f16 or f32).
    #[arg(long)]
    model: PathBuf,
    /// The MLX directory to write.
    #[arg(long)]
    out: PathBuf,
    /// 4 or 8 (mlx-lm's default convert at that width, group 64).
    #[arg(long, default_value_t = 4)]
    bits: u32,
    /// A named recipe instead of `--bits`: q8, q4 or q4-quality.
    #[arg(long)]
    recipe: Option<String>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let recipe = match (&args.recipe, args.bits) {
        (Some(name), _) => QuantizeRecipe::parse(name).with_context(|| format!("unknown recipe {name:?}"))?,
        (None, 4) => QuantizeRecipe::Q4,
        (None, 8) => QuantizeRecipe::Q8,
        (None, b) => bail!("--bits {b}: expected 4 or 8"),
    };
    let t = Instant::now();
    let report = save_mlx(&args.model, &args.out, recipe)
        .with_context(|| format!("quantizing {} into {}", args.model.display(), args.out.display()))?;
    eprintln!(
        "{recipe:?}: {} tensors ({} matrices quantized), {:.1} MB, in {:.1} s -> {}",
        report.tensors,
        report.quantized,
        report.bytes as f64 / 1e6,
        t.elapsed().as_secs_f64(),
        args.out.display()
    );
    Ok(())
}
