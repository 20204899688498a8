//! Feedback that reaches generation: the demo model answers a question, the user corrects the
//! answer, a few learning steps train a live LoRA adapter on the GPU, and the next answer follows
//! the correction; a low score on a bad answer pushes it down. The adapter is then exported as a
//! PEFT directory (loadable by peft, vLLM, LoRAX and this engine's `load_adapter`).
//!
//! `cargo run --release --example learn_from_feedback -- [--model DIR] [--prompt TEXT]
//!  [--correction TEXT] [--steps N] [--lr LR] [--export DIR]`

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use qwen35_wgpu::{
    ChatMessage, ChatRequest, FeedbackEvent, GenerateParams, LearnOptions, LlmBackend, SessionOptions, Signal,
    TrainSpec, WgpuBackend,
};

#[derive(Parser)]
struct Args {
    /// Model directory (default: the embedded demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The user's question.
    #[arg(long, default_value = "What color is the sky?")]
    prompt: String,
    /// The answer the user prefers.
    #[arg(long, default_value = "The sky is green.")]
    correction: String,
    /// Most supervised steps.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f32,
    /// Where to export the trained adapter.
    #[arg(long, default_value = "target/feedback-adapter")]
    export: PathBuf,
}

fn answer(b: &mut WgpuBackend, q: &str) -> Result<String> {
    let params = GenerateParams { max_tokens: 32, ..Default::default() };
    Ok(b.chat(&ChatRequest::new(vec![ChatMessage::new("user", q)]), &params, &mut |_| true)?.text)
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let args = Args::parse();
    let model = args.model.unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/assets/demo"));
    let mut b = WgpuBackend::new(SessionOptions { max_context: 256, max_batch: 128 })?;
    b.load_model(&model)?;
    println!("model {} on {}", model.display(), b.context().info.name);
    println!("before feedback: {:?}", answer(&mut b, &args.prompt)?);

    let id = b.create_trainable_adapter(&TrainSpec::default())?;
    println!("trainable adapter {id:?}: rank 8 on the last layer's q/k/v/o and gate/up/down projections");
    let opts = LearnOptions { lr: args.lr, ..Default::default() };
    let corrected =
        FeedbackEvent { prompt: args.prompt.clone(), response: args.correction.clone(), signal: Signal::Preferred };
    for step in 1..=args.steps {
        let t = Instant::now();
        let report = b.learn(std::slice::from_ref(&corrected), &opts)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let now = answer(&mut b, &args.prompt)?;
        println!(
            "step {step}: {ms:.1} ms, response CE {:.3} → answer {now:?} (grad norm {:.3})",
            report.event_ce[0], report.grad_norm
        );
        if now == args.correction {
            break;
        }
    }

    let other = "Where is the cat?";
    let bad =
        FeedbackEvent { prompt: other.into(), response: "The cat is in the sky.".into(), signal: Signal::Score(0.0) };
    let before = b.learn(std::slice::from_ref(&bad), &opts)?;
    let after = b.learn(std::slice::from_ref(&bad), &opts)?;
    println!(
        "score 0 on {:?} for {other:?}: its CE {:.3} → {:.3} nats/token; the answer now: {:?}",
        bad.response,
        before.event_ce[0],
        after.event_ce[0],
        answer(&mut b, other)?
    );

    b.export_trainable_adapter(&args.export)?;
    let mut fresh = WgpuBackend::with_context(b.context().clone(), SessionOptions { max_context: 256, max_batch: 128 });
    fresh.load_model(&model)?;
    fresh.load_adapter(&args.export, 1.0)?;
    println!("exported to {}; loaded back: {:?}", args.export.display(), answer(&mut fresh, &args.prompt)?);
    Ok(())
}
