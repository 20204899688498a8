//! The README's main command: the embedded demo model answers the same questions with no
//! adapter and with each LoRA adapter, switching adapters live between requests and once in the
//! middle of a generation, with the measured swap time and tokens/s; then conversations side by
//! side on the same loaded model, each a session with its own adapter and its own prompt cache,
//! every turn of all of them answered by one batched chat.
//!
//! `cargo run --release --example live_swap [-- --model DIR --adapter DIR --adapter DIR --prompt TEXT]`
//!
//! Text goes to stdout; progress and timings go to stderr.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use qwen35_wgpu::{AdapterWeight, ChatMessage, ChatRequest, GenerateParams, LlmBackend, SessionOptions, WgpuBackend};

#[derive(Parser)]
struct Args {
    /// Model directory (default: the embedded demo model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// PEFT adapter directories (default: the demo model's adapters).
    #[arg(long)]
    adapter: Vec<PathBuf>,
    /// Questions (default: three demo questions).
    #[arg(long)]
    prompt: Vec<String>,
    /// Most new tokens per answer.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Token after which the mid-generation switch happens.
    #[arg(long, default_value_t = 3)]
    switch_after: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let demo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/assets/demo");
    let model = args.model.clone().unwrap_or_else(|| demo.clone());
    let mut adapters = args.adapter.clone();
    if adapters.is_empty() && args.model.is_none() {
        adapters = vec![demo.join("adapters/shout"), demo.join("adapters/french")];
    }
    let prompts = if args.prompt.is_empty() {
        vec!["What color is the sky?".to_string(), "Where is the cat?".into(), "What is the apple?".into()]
    } else {
        args.prompt.clone()
    };

    let t = Instant::now();
    let mut backend = WgpuBackend::new(SessionOptions { max_context: 512, max_batch: 128 })?;
    backend.load_model(&model).with_context(|| format!("loading {}", model.display()))?;
    eprintln!("model {} loaded in {:.2} s", model.display(), t.elapsed().as_secs_f64());
    let mut ids = Vec::new();
    for path in &adapters {
        let t = Instant::now();
        let id = backend.preload_adapter(path, None).with_context(|| format!("loading adapter {}", path.display()))?;
        let info = &backend.list_adapters()?.into_iter().find(|(i, _)| *i == id).context("just loaded")?.1;
        eprintln!(
            "adapter {id}: rank {:?} on {} projections, loaded in {:.1} ms",
            info.ranks,
            info.modules.len(),
            t.elapsed().as_secs_f64() * 1e3
        );
        ids.push(id);
    }
    let params = GenerateParams { max_tokens: args.max_tokens, ..Default::default() };
    let variants: Vec<Option<String>> = std::iter::once(None).chain(ids.iter().cloned().map(Some)).collect();
    let width = variants.iter().map(|v| v.as_deref().unwrap_or("base").len()).max().unwrap_or(4);
    let mut swaps_us = Vec::new();
    let mut swap_bytes = 0;

    for question in &prompts {
        println!("{question}");
        for variant in &variants {
            let bytes = backend.context().bytes_uploaded();
            let t = Instant::now();
            match variant {
                Some(id) => backend.activate_adapter(id, 1.0)?,
                None => backend.deactivate_adapter()?,
            }
            swaps_us.push(t.elapsed().as_secs_f64() * 1e6);
            swap_bytes += backend.context().bytes_uploaded() - bytes;
            let tok = backend.tokenizer().context("the model has no tokenizer")?;
            let prompt = tok.encode(&tok.apply_chat_template(&[ChatMessage::new("user", question)])?)?;
            let t = Instant::now();
            let out = backend.generate_tokens(&prompt, &params, &mut |_| true)?;
            let secs = t.elapsed().as_secs_f64();
            let text = tok.decode(&out)?;
            let name = variant.as_deref().unwrap_or("base");
            println!("  {name:>width$} | {text}");
            eprintln!(
                "  {name:>width$}: {} prompt + {} new tokens in {:.0} ms ({:.1} tok/s)",
                prompt.len(),
                out.len(),
                secs * 1e3,
                out.len() as f64 / secs
            );
        }
    }

    if let (Some(first), Some(question)) = (ids.first(), prompts.first()) {
        let tok = backend.tokenizer().context("the model has no tokenizer")?;
        let prompt = tok.apply_chat_template(&[ChatMessage::new("user", question)])?;
        let prompt_ids = tok.encode(&prompt)?;
        backend.deactivate_adapter()?;
        let mut n = 0;
        let mut switch_us = 0.0;
        let t = Instant::now();
        let out = backend.generate_tokens_with(&prompt_ids, &params, &mut |_, switch| {
            n += 1;
            if n == args.switch_after {
                let s = Instant::now();
                switch.activate(first, 1.0);
                switch_us = s.elapsed().as_secs_f64() * 1e6;
            }
            true
        })?;
        let secs = t.elapsed().as_secs_f64();
        let before = tok.decode(&out[..args.switch_after.min(out.len())])?;
        let after = tok.decode(&out[args.switch_after.min(out.len())..])?;
        println!("{question}");
        println!("  base → {first} after {} tokens | {before}⟨switch⟩{after}", args.switch_after);
        eprintln!(
            "  (an adapter continues the language already on the page, so a switch mid-sentence keeps it; \
             tests/lora.rs checks the switched tokens one by one)"
        );
        eprintln!(
            "  mid-generation: {} tokens in {:.0} ms ({:.1} tok/s)",
            out.len(),
            secs * 1e3,
            out.len() as f64 / secs
        );
        swaps_us.push(switch_us);
    }
    conversations(&mut backend, &ids, &prompts, &params)?;
    swaps_us.sort_by(f64::total_cmp);
    if !swaps_us.is_empty() {
        eprintln!(
            "adapter switches: {} done, median {:.1} µs, max {:.1} µs, {swap_bytes} bytes uploaded by the switches",
            swaps_us.len(),
            swaps_us[swaps_us.len() / 2],
            swaps_us[swaps_us.len() - 1]
        );
    }
    Ok(())
}

/// Conversations on one model, turn by turn: one session per adapter, every turn of all of them
/// answered by one batched chat (the sessions decode together, each row with its own adapter).
/// Each chat grows by a question a turn; each session's prompt cache prefills only the new turn.
fn conversations(backend: &mut WgpuBackend, ids: &[String], prompts: &[String], params: &GenerateParams) -> Result<()> {
    if ids.is_empty() {
        return Ok(());
    }
    println!("Conversations side by side on one model (a session and an adapter each, answered together):");
    let home = backend.current_session().context("a model is loaded")?;
    let mut sessions = Vec::new();
    for id in ids {
        let session = backend.create_session()?;
        backend.select_session(session)?;
        backend.set_adapters(&[AdapterWeight::new(id.as_str(), 1.0)])?;
        sessions.push((session, id.clone(), Vec::<ChatMessage>::new()));
    }
    let width = sessions.iter().map(|(_, n, _)| n.len()).max().unwrap_or(4);
    for question in prompts {
        println!("  user: {question}");
        let requests: Vec<ChatRequest> = sessions
            .iter_mut()
            .map(|(_, _, messages)| {
                messages.push(ChatMessage::new("user", question));
                ChatRequest::new(messages.clone())
            })
            .collect();
        let asks: Vec<_> = sessions.iter().zip(&requests).map(|((session, _, _), r)| (*session, r)).collect();
        let t = Instant::now();
        let replies = backend.chat_batch(&asks, params, &mut |_, _| true)?;
        let secs = t.elapsed().as_secs_f64();
        eprintln!("  ({} answers in one batch: {:.0} ms)", replies.len(), secs * 1e3);
        for ((session, name, messages), reply) in sessions.iter_mut().zip(replies) {
            println!("  {name:>width$} | {}", reply.content.trim());
            backend.select_session(*session)?;
            let stats = backend.prompt_cache()?.stats();
            eprintln!(
                "  {name:>width$}: this conversation's prompt cache so far: {} tokens reused, {} prefilled",
                stats.reused_tokens, stats.prefilled_tokens
            );
            messages.push(ChatMessage::new("assistant", reply.content.trim()));
        }
    }
    backend.select_session(home)?;
    for (session, _, _) in sessions {
        backend.close_session(session)?;
    }
    Ok(())
}
