//! Chat with a model: render the conversation with the model's chat template, stream the answer.
//!
//! `cargo run --release --example generate -- [--model DIR] [--adapter DIR[:SCALE]]
//!  [--prompt TEXT | --messages FILE.json] [--tools FILE.json] [--template-var K=JSON]…
//!  [--print-prompt] [--quantize q8|q4|q4-quality] [--max-tokens N]
//!  [--temperature T --top-k K --top-p P --seed S] [--repetition-penalty R] [--stop S]`
//!
//! Defaults to the embedded demo model. `--messages` is a JSON list of messages as transformers
//! takes them (`role`, `content` as text or typed parts, `reasoning_content`, `tool_calls`,
//! `tool_call_id`, `name`); `--tools` a JSON list of tool definitions; `--template-var
//! enable_thinking=false` turns Qwen 3.5's thinking off. The answer streams to stdout (reasoning
//! in brackets, then the content, then each tool call as JSON); timings go to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Parser;
use qwen35_wgpu::{
    ChatDelta, ChatMessage, ChatRequest, GenerateParams, LlmBackend, LoadOptions, QuantizeRecipe, SessionOptions,
    TextTokenizer, WgpuBackend,
};

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
    /// The conversation, a JSON file holding a list of messages (instead of --prompt).
    #[arg(long)]
    messages: Option<PathBuf>,
    /// Tool definitions, a JSON file holding a list of JSON schemas.
    #[arg(long)]
    tools: Option<PathBuf>,
    /// A template variable, `NAME=JSON` (e.g. `enable_thinking=false`); repeatable.
    #[arg(long = "template-var", value_parser = parse_var)]
    template_vars: Vec<(String, serde_json::Value)>,
    /// Encode control tokens written in the messages (`<|im_end|>`, `<think>`, …) as plain text,
    /// as transformers' `sanitize_control_tokens=True`.
    #[arg(long)]
    sanitize_control_tokens: bool,
    /// Print the rendered prompt and exit.
    #[arg(long)]
    print_prompt: bool,
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
    let request = request(&args)?;
    if args.print_prompt {
        let tok = TextTokenizer::from_dir(&dir)?;
        print!("{}", tok.encode_chat(&request)?.text);
        return Ok(());
    }
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
        cancel: None,
    };
    let t = Instant::now();
    let mut deltas = 0;
    let mut last = None;
    let reply = backend.chat(&request, &params, &mut |d| {
        deltas += 1;
        let kind = match d {
            ChatDelta::Reasoning(_) => 0,
            ChatDelta::Content(_) => 1,
            ChatDelta::ToolCall(_) => 2,
        };
        if last != Some(kind) && last.is_some() {
            println!();
        }
        last = Some(kind);
        match d {
            ChatDelta::Reasoning(r) => print!("[{r}]"),
            ChatDelta::Content(c) => print!("{c}"),
            ChatDelta::ToolCall(call) => print!("{}", serde_json::to_string(call).unwrap_or_default()),
        }
        let _ = std::io::stdout().flush();
        true
    })?;
    println!();
    eprintln!("{} tool calls, {} bytes generated", reply.tool_calls.len(), reply.text.len());
    eprintln!("{deltas} text deltas in {:.0} ms", t.elapsed().as_secs_f64() * 1e3);
    Ok(())
}

fn request(args: &Args) -> Result<ChatRequest> {
    let read = |path: &PathBuf| -> Result<serde_json::Value> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    };
    let messages: Vec<ChatMessage> = match &args.messages {
        Some(path) => serde_json::from_value(read(path)?).with_context(|| format!("messages in {}", path.display()))?,
        None => vec![ChatMessage::new("user", &args.prompt)],
    };
    // OpenAI-shaped files carry tool-call arguments as JSON strings; Qwen's templates want objects.
    let mut request = ChatRequest::new(messages).parse_tool_arguments().sanitized(args.sanitize_control_tokens);
    if let Some(path) = &args.tools {
        let tools: Vec<serde_json::Value> =
            serde_json::from_value(read(path)?).with_context(|| format!("tools in {}", path.display()))?;
        request = request.with_tools(tools);
    }
    for (name, value) in &args.template_vars {
        request = request.var(name, value.clone());
    }
    Ok(request)
}

fn parse_var(s: &str) -> Result<(String, serde_json::Value), String> {
    let (name, value) = s.split_once('=').ok_or_else(|| format!("expected NAME=JSON, found {s:?}"))?;
    let value = serde_json::from_str(value).map_err(|e| format!("{name}: {value:?} is not JSON ({e})"))?;
    Ok((name.to_string(), value))
}

fn parse_quantize(s: &str) -> Result<QuantizeRecipe, String> {
    QuantizeRecipe::parse(s).ok_or_else(|| format!("expected q8, q4 or q4-quality, found {s:?}"))
}
