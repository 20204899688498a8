//! Engine throughput on one checkpoint: model load, batched prefill and cached decode (median of
//! repeats after a warm-up), and with `--adapter`: the same with a LoRA adapter applied and with
//! it stacked on a second copy (the three runs alternate round by round, and their prefill
//! ratios are taken per round; their decode ratios come from blocks of a few tokens alternating
//! within one generation, so that the machine's drift does not enter them), the
//! adapter's load time against reading its file, and adapter swaps between tokens (latency and
//! bytes uploaded); then one learning step (forward of an event, backward, AdamW) on a rank-16
//! trainable adapter. With `--fusion-ab`, greedy decode with the norms folded into the
//! projections against without, in blocks alternating within one generation (what decides the
//! session's default per adapter). Prints one JSON line on stdout; `cargo xtask bench` drives it
//! together with its peers.
//!
//! `cargo run --release --example bench -- --model DIR [--adapter DIR] [--quantize q8|q4|q4-quality] [--prompt 128] [--decode 64] [--repeats 5] [--subgroups auto|off|always] [--fusion-ab]`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use clap::Parser;
use qwen35_wgpu::gpu::{Counters, Dtype, IoBindCache, Recorder, Timed};
use qwen35_wgpu::kernels::misc::{stream_read, STREAM_GROUPS};
use qwen35_wgpu::model::Mixer;
use qwen35_wgpu::runtime::argmax;
use qwen35_wgpu::runtime::PromptCache;
use qwen35_wgpu::{
    ActiveAdapter, Batch, GenerateParams, GpuContext, GpuOptions, LearnOptions, LlmBackend, LoadOptions, LoraAdapter,
    Model, QuantizeRecipe, Session, SessionOptions, Signal, Subgroups, TokenEvent, TrainSpec, WgpuBackend,
};

#[derive(Parser)]
struct Args {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// A PEFT adapter directory to measure as well.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// Prompt tokens for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    prompt: usize,
    /// Tokens decoded after the prompt.
    #[arg(long, default_value_t = 64)]
    decode: usize,
    /// Timed repeats (after one warm-up).
    #[arg(long, default_value_t = 5)]
    repeats: usize,
    /// Adapter swaps timed.
    #[arg(long, default_value_t = 1000)]
    swaps: usize,
    /// MiB read per repeat by the streaming-read yardstick (0 = skip).
    #[arg(long, default_value_t = 1024, alias = "copy-mib")]
    stream_mib: u64,
    /// Also time every dispatch with GPU timestamps and report per kernel family.
    #[arg(long)]
    profile: bool,
    /// Tokens of the learning step's event (half prompt, half response; 0 = skip).
    #[arg(long, default_value_t = 64)]
    learn_tokens: usize,
    /// Quantize the checkpoint's 16/32-bit matrices at load: `q8` or `q4` (MLX's affine layout,
    /// group 64, as `mlx_lm.convert` makes it) or `q4-quality` (sensitive tensors at 8 bits or
    /// kept in 16-bit).
    #[arg(long, value_parser = parse_quantize)]
    quantize: Option<QuantizeRecipe>,
    /// Turns of a chat whose last turn is timed with and without the prompt cache (0 = skip):
    /// each turn adds `--prompt` / 4 user tokens to the conversation and decodes `--decode`.
    #[arg(long, default_value_t = 0)]
    chat_turns: usize,
    /// Session counts for batched decode (e.g. `1,2,4,8`; needs `--adapter`): that many
    /// sessions, cycling through the adapter, a second copy of it and none, decode together.
    #[arg(long, value_delimiter = ',')]
    batch_sessions: Vec<usize>,
    /// Subgroup kernels: `auto` (where the adapter has subgroups and a row group fits in one),
    /// `off` (the portable kernels only) or `always`.
    #[arg(long, default_value = "auto", value_parser = parse_subgroups)]
    subgroups: Subgroups,
    /// Greedy run-ahead (step t + 1 submitted before token t is read): `auto` (the session's
    /// default: on for GPUs, off for CPU adapters), `on` or `off`.
    #[arg(long, default_value = "auto", value_parser = parse_run_ahead)]
    run_ahead: RunAhead,
    /// Also decode with the norms folded into the projections and without, alternating in blocks
    /// within one generation (base model, and with `--adapter` the adapter too): `fusion_ab`.
    #[arg(long)]
    fusion_ab: bool,
}

/// `--run-ahead`: the session's default, or on or off.
#[derive(Clone, Copy, Debug)]
struct RunAhead(Option<bool>);

fn parse_run_ahead(s: &str) -> Result<RunAhead, String> {
    match s {
        "auto" => Ok(RunAhead(None)),
        "on" => Ok(RunAhead(Some(true))),
        "off" => Ok(RunAhead(Some(false))),
        _ => Err(format!("expected auto, on or off, found {s:?}")),
    }
}

fn parse_subgroups(s: &str) -> Result<Subgroups, String> {
    match s {
        "auto" => Ok(Subgroups::Auto),
        "off" => Ok(Subgroups::Off),
        "always" => Ok(Subgroups::Always),
        _ => Err(format!("expected auto, off or always, found {s:?}")),
    }
}

fn parse_quantize(s: &str) -> Result<QuantizeRecipe, String> {
    QuantizeRecipe::parse(s).ok_or_else(|| format!("expected q8, q4 or q4-quality, found {s:?}"))
}

/// The device's read bandwidth (bytes per second): the streaming-read kernel over `mib` MiB spread
/// across buffers of at most one binding, all in one submit; median of 5 after a warm-up.
fn device_read_bandwidth(ctx: &GpuContext, mib: u64) -> Result<f64> {
    let per = ctx.max_binding().min(256 << 20) / 16 * 16;
    let total = (mib << 20).max(per);
    let srcs: Vec<wgpu::Buffer> = (0..total.div_ceil(per))
        .map(|i| ctx.storage_buffer(&format!("stream src {i}"), per, true))
        .collect::<Result<_, _>>()?;
    let dst = ctx.storage_buffer("stream dst", u64::from(STREAM_GROUPS) * 256 * 16, true)?;
    let mut cache = IoBindCache::with_arena(ctx, "stream arena", 256 * srcs.len() as u64);
    let mut times = Vec::new();
    for rep in 0..6 {
        let t = Instant::now();
        let mut rec = Recorder::new(ctx, &mut cache);
        for src in &srcs {
            stream_read(&mut rec, src, &dst, per)?;
        }
        rec.submit()?;
        ctx.device.poll(wgpu::PollType::wait_indefinitely())?;
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    Ok((per * srcs.len() as u64) as f64 / times[times.len() / 2])
}

/// The host's read bandwidth over `bytes` (summed by every core), median of 5 after a warm-up:
/// where the GPU adapter is the CPU, this is the limit the device's memory sets.
fn host_read_bandwidth(bytes: u64) -> f64 {
    let words = vec![1u64; (bytes / 8) as usize];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut times = Vec::new();
    for rep in 0..6 {
        let t = Instant::now();
        let sum: u64 = std::thread::scope(|s| {
            let parts: Vec<_> = words
                .chunks(words.len().div_ceil(threads))
                .map(|c| {
                    s.spawn(move || {
                        c.chunks_exact(8).fold([0u64; 8], |mut a, w| {
                            for i in 0..8 {
                                a[i] = a[i].wrapping_add(w[i]);
                            }
                            a
                        })
                    })
                })
                .collect();
            parts.into_iter().map(|h| h.join().map_or(0, |a| a.iter().sum::<u64>())).sum()
        });
        std::hint::black_box(sum);
        if rep > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    bytes as f64 / times[times.len() / 2]
}

#[derive(Clone, Default)]
struct Series(Vec<f64>);

impl Series {
    /// The value at quantile `q` of the sorted series (NaN when empty).
    fn quantile(&self, q: f64) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return f64::NAN;
        }
        v[((v.len() - 1) as f64 * q).round() as usize]
    }

    fn median(&self) -> f64 {
        self.quantile(0.5)
    }

    fn json(&self) -> serde_json::Value {
        if self.0.is_empty() {
            return serde_json::Value::Null;
        }
        let q = |x| self.quantile(x);
        serde_json::json!({"median": q(0.5), "min": q(0.0), "max": q(1.0), "p99": q(0.99), "n": self.0.len()})
    }
}

/// Greedy generation as a user runs it: the prompt, then `decode` more tokens.
fn greedy(decode: usize) -> GenerateParams {
    GenerateParams { max_tokens: decode + 1, stop_at_eos: false, ..Default::default() }
}

/// Qwen 3.5's recommended non-thinking sampling: temperature 0.7, top-k 20, top-p 0.8.
fn sampled(decode: usize) -> GenerateParams {
    GenerateParams { temperature: 0.7, top_k: 20, top_p: 0.8, seed: 7, ..greedy(decode) }
}

/// Prefill `ids` then decode `decode` greedy tokens; returns (prefill tok/s, decode tok/s): the
/// prefill time is the time to the first token, decode the tokens after it.
fn run(session: &mut Session, ids: &[u32], decode: usize) -> Result<(f64, f64)> {
    run_with(session, ids, &greedy(decode))
}

/// [`run`] with other generation settings (`params.max_tokens` = decode + 1).
fn run_with(session: &mut Session, ids: &[u32], params: &GenerateParams) -> Result<(f64, f64)> {
    let decode = params.max_tokens - 1;
    session.reset();
    let t = Instant::now();
    let mut first = None;
    session.generate(ids, params, |_| {
        first.get_or_insert_with(|| t.elapsed().as_secs_f64());
        true
    })?;
    let total = t.elapsed().as_secs_f64();
    let p = first.unwrap_or(total);
    Ok((ids.len() as f64 / p, decode as f64 / (total - p)))
}

/// Per kernel family (the entry point, or the job a shared one runs: `lora_shrink`) over `submits`, per token: dispatches, weight bytes, µs and
/// the weight bytes per second; the slowest family first, then a total.
fn family_table(submits: &[Vec<Timed>], tokens: f64) -> Vec<serde_json::Value> {
    let mut families: Vec<(&'static str, f64, u64, f64)> = Vec::new();
    for t in submits.iter().flatten() {
        let name = t.family;
        let i = families.iter().position(|f| f.0 == name).unwrap_or_else(|| {
            families.push((name, 0.0, 0, 0.0));
            families.len() - 1
        });
        families[i].1 += 1.0;
        families[i].2 += t.weight_bytes;
        families[i].3 += t.ns;
    }
    families.sort_by(|a, b| b.3.total_cmp(&a.3));
    let total = families.iter().fold(("total", 0.0, 0, 0.0), |acc, f| (acc.0, acc.1 + f.1, acc.2 + f.2, acc.3 + f.3));
    families
        .iter()
        .chain(std::iter::once(&total))
        .map(|&(name, n, bytes, ns)| {
            serde_json::json!({
                "kernel": name,
                "dispatches_per_token": n / tokens,
                "weight_bytes_per_token": bytes as f64 / tokens,
                "us_per_token": ns / 1e3 / tokens,
                "weight_gb_s": if bytes > 0 { serde_json::json!(bytes as f64 / ns) } else { serde_json::Value::Null },
            })
        })
        .collect()
}

/// A profiled greedy generation with `adapter` (GPU timestamps on every dispatch): the prompt's
/// step and `decode` decode steps, per kernel family.
fn profile(
    session: &mut Session,
    ids: &[u32],
    decode: usize,
    adapter: Option<(Arc<LoraAdapter>, f32)>,
) -> Result<serde_json::Value> {
    session.set_adapter(adapter)?;
    session.reset();
    if !session.start_profile() {
        return Ok(serde_json::json!({"timestamps": false}));
    }
    session.generate(ids, &greedy(decode), |_| true)?;
    let p = session.take_profile().unwrap_or_default();
    let prefill_submits = ids.len().div_ceil(session.options().max_batch).min(p.submits.len());
    let (prefill, steps) = p.submits.split_at(prefill_submits);
    Ok(serde_json::json!({
        "timestamps": true,
        "prefill_tokens": ids.len(),
        "decode_tokens": steps.len(),
        "prefill": family_table(prefill, ids.len() as f64),
        "decode": family_table(steps, steps.len().max(1) as f64),
    }))
}

/// What one greedy decode token costs the engine, counted by the engine itself: dispatches,
/// submits and bytes read back per token (a generation of `decode + 1` tokens minus one of 1),
/// with the session's default fusion, and the dispatches with the norms and SwiGLU folded into
/// the projections (the default) and without.
fn per_token_counts(ctx: &GpuContext, session: &mut Session, ids: &[u32], decode: usize) -> Result<serde_json::Value> {
    let counted = |session: &mut Session, tokens: usize| counted(ctx, session, ids, &greedy(tokens));
    let d = decode.max(1) as f64;
    let (one, all) = (counted(session, 0)?, counted(session, decode)?);
    let default = session.fused_decode();
    let mut dispatches = |fused: bool| -> Result<f64> {
        session.set_fused_decode(fused);
        let (one, all) = (counted(session, 0)?, counted(session, decode)?);
        Ok((all.dispatches - one.dispatches) as f64 / d)
    };
    let (fused, unfused) = (dispatches(true)?, dispatches(false)?);
    session.set_fused_decode(default);
    Ok(serde_json::json!({
        "dispatches_per_token": (all.dispatches - one.dispatches) as f64 / d,
        "dispatches_per_token_fused": fused,
        "dispatches_per_token_unfused": unfused,
        "fused_decode": default,
        "submits_per_token": (all.submits - one.submits) as f64 / d,
        "readback_bytes_per_token": (all.read_back - one.read_back) as f64 / d,
    }))
}

/// What a generation of `ids` with `params` costs the engine, from a reset session.
fn counted(ctx: &GpuContext, session: &mut Session, ids: &[u32], params: &GenerateParams) -> Result<Counters> {
    session.reset();
    let before = ctx.counters();
    session.generate(ids, params, |_| true)?;
    Ok(ctx.counters() - before)
}

/// Decode with [`sampled`] settings: tok/s over the repeats, and the bytes read back per token
/// (the GPU's top-k candidates), counted by the engine.
fn sampled_decode(ctx: &GpuContext, session: &mut Session, ids: &[u32], args: &Args) -> Result<serde_json::Value> {
    let mut decode = Series::default();
    for rep in 0..=args.repeats {
        let (_, d) = run_with(session, ids, &sampled(args.decode))?;
        eprintln!("sampled rep {rep}: decode {d:.2} tok/s");
        if rep > 0 {
            decode.0.push(d);
        }
    }
    let short = &ids[..ids.len().min(8)];
    let tokens = args.decode.clamp(1, 8);
    let (one, all) = (counted(ctx, session, short, &sampled(0))?, counted(ctx, session, short, &sampled(tokens))?);
    Ok(serde_json::json!({
        "params": "temperature 0.7, top_k 20, top_p 0.8",
        "decode_tok_s": decode.json(),
        "readback_bytes_per_token": (all.read_back - one.read_back) as f64 / tokens as f64,
    }))
}

/// Greedy runs of every adapter set in `sets` (label, set), interleaved: each round runs every
/// set once, in reverse order on odd rounds (so a drift of the machine over a round costs every
/// set alike); round 0 is the warm-up. Returns each set's (prefill, decode) tok/s, in round order,
/// so that entry i of two sets' series comes from the same round.
fn interleaved(
    session: &mut Session,
    ids: &[u32],
    args: &Args,
    sets: &[(&str, Vec<ActiveAdapter>)],
) -> Result<Vec<(Series, Series)>> {
    let mut out: Vec<(Series, Series)> = sets.iter().map(|_| Default::default()).collect();
    for round in 0..=args.repeats {
        let order: Vec<usize> =
            if round % 2 == 0 { (0..sets.len()).collect() } else { (0..sets.len()).rev().collect() };
        for i in order {
            let (label, set) = &sets[i];
            session.set_adapters(set.clone())?;
            let (p, d) = run(session, ids, args.decode)?;
            eprintln!("{label} round {round}: prefill {p:.2} tok/s, decode {d:.2} tok/s");
            if round > 0 {
                out[i].0 .0.push(p);
                out[i].1 .0.push(d);
            }
        }
    }
    session.set_adapters(Vec::new())?;
    Ok(out)
}

/// Greedy decode of `variants` configurations of one session (adapter sets, fused or unfused
/// steps), alternating within one generation: each round gives every variant a block of
/// [`AB_BLOCK`] tokens (in reverse order on odd rounds), `apply(session, i)` switching to variant
/// i between tokens, so that variants compared within a round are a few seconds apart however
/// the machine drifts. A block's first token is not timed (it holds the switch and, with
/// run-ahead, a discarded step); a block's rate is one over its median token time (on a shared
/// machine a few tokens of a block take half again as long as the others: another tenant, not
/// the variant). Returns each variant's tok/s per round.
fn decode_ab(
    model: &Arc<Model>,
    args: &Args,
    ids: &[u32],
    variants: usize,
    mut apply: impl FnMut(&mut Session, usize) -> Result<()>,
) -> Result<Vec<Series>> {
    let rounds = 2 * args.repeats.max(1);
    let schedule: Vec<usize> = (0..rounds)
        .flat_map(|r| if r % 2 == 0 { (0..variants).collect::<Vec<_>>() } else { (0..variants).rev().collect() })
        .collect();
    let prompt = &ids[..ids.len().min(8)];
    let tokens = schedule.len() * AB_BLOCK;
    let opts = SessionOptions { max_context: prompt.len() + tokens + 1, max_batch: prompt.len() };
    let mut session = Session::new(model.clone(), opts)?;
    if let RunAhead(Some(on)) = args.run_ahead {
        session.set_run_ahead(on);
    }
    apply(&mut session, schedule[0])?;
    // Token k's time: since the previous token (the first: since the prompt's token).
    let mut times = Vec::with_capacity(tokens);
    let mut last = Instant::now();
    session.generate_with(prompt, &GenerateParams { stop_at_eos: false, ..greedy(tokens - 1) }, |_, s| {
        let now = Instant::now();
        times.push(now.duration_since(last).as_secs_f64());
        last = now;
        if times.len() % AB_BLOCK == 0 && times.len() < tokens {
            apply(s, schedule[times.len() / AB_BLOCK])?;
        }
        Ok::<_, anyhow::Error>(true)
    })?;
    let mut out: Vec<Series> = (0..variants).map(|_| Series::default()).collect();
    for (b, &variant) in schedule.iter().enumerate() {
        let block = Series(times[b * AB_BLOCK + 1..(b + 1) * AB_BLOCK].to_vec());
        out[variant].0.push(1.0 / block.median());
    }
    Ok(out)
}

/// Greedy decode fused (norms and SwiGLU folded into the projections) against unfused, for the
/// base model and the first adapter set of `sets` after it, as [`decode_ab`] blocks.
fn fusion_ab(
    model: &Arc<Model>,
    args: &Args,
    ids: &[u32],
    sets: &[(&str, Vec<ActiveAdapter>)],
) -> Result<serde_json::Value> {
    let variants: Vec<(&str, bool, &Vec<ActiveAdapter>)> =
        sets.iter().take(2).flat_map(|(name, set)| [(*name, true, set), (*name, false, set)]).collect();
    let runs = decode_ab(model, args, ids, variants.len(), |s, i| {
        s.set_fused_decode(variants[i].1);
        Ok(s.set_adapters(variants[i].2.clone())?)
    })?;
    let mut out = serde_json::json!({ "block_tokens": AB_BLOCK, "rounds": runs[0].0.len() });
    for (pair, (name, _, _)) in runs.chunks(2).zip(variants.iter().step_by(2)) {
        out[*name] = serde_json::json!({
            "fused_tok_s": pair[0].json(),
            "unfused_tok_s": pair[1].json(),
            "ratio_fused_over_unfused": paired(&pair[0], &pair[1]),
        });
    }
    Ok(out)
}

/// Tokens per set and round in [`decode_ab`].
const AB_BLOCK: usize = 8;

/// `a / b` per round of two [`interleaved`] series: median, min, max over the rounds.
fn paired(a: &Series, b: &Series) -> serde_json::Value {
    Series(a.0.iter().zip(&b.0).map(|(x, y)| x / y).collect()).json()
}

fn main() -> Result<()> {
    let args = Args::parse();
    let ctx = Arc::new(GpuContext::with_options(GpuOptions { subgroups: args.subgroups })?);
    let t = Instant::now();
    let load = LoadOptions { quantize: args.quantize, ..Default::default() };
    let model = Arc::new(Model::load_with(ctx.clone(), &args.model, &load)?);
    let load_s = t.elapsed().as_secs_f64();
    let vocab = model.config.vocab_size as u32;
    let ids: Vec<u32> = (0..args.prompt as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let opts = SessionOptions { max_context: args.prompt + 3 * args.decode + 16, max_batch: args.prompt.max(1) };
    let session_positions = opts.max_context;
    let mut session = Session::new(model.clone(), opts)?;
    if let RunAhead(Some(on)) = args.run_ahead {
        session.set_run_ahead(on);
    }
    // The adapter (loaded three times: its load time) and a second copy of it, loaded first so
    // that the base model, the adapter and the two stacked run interleaved. Each load creates the
    // same buffers, so the bytes of a load that replaces the one before stand for the dropped
    // load's, which the resident count below leaves out.
    let mut dropped_bytes = 0;
    let loaded = match &args.adapter {
        Some(path) => {
            let mut loads = Series::default();
            let mut adapter = None;
            for _ in 0..3 {
                let t = Instant::now();
                let before = ctx.bytes_allocated();
                let a = LoraAdapter::load(&model, path)?;
                ctx.device.poll(wgpu::PollType::wait_indefinitely())?;
                loads.0.push(t.elapsed().as_secs_f64());
                if adapter.replace(Arc::new(a)).is_some() {
                    dropped_bytes += ctx.bytes_allocated() - before;
                }
            }
            let adapter = adapter.expect("loaded three times");
            let second = Arc::new(LoraAdapter::load(&model, path)?);
            Some((path, adapter, second, loads))
        }
        None => None,
    };
    let mut sets = vec![("base", Vec::new())];
    if let Some((_, adapter, second, _)) = &loaded {
        sets.push(("adapter", vec![ActiveAdapter::new(adapter.clone(), 1.0)]));
        // Two adapters stacked (the adapter and its second copy at half scale each: the same
        // delta as the adapter at scale 1, twice the rank): one shrink and one fused expand per
        // group, like one adapter of rank 32.
        sets.push(("stacked", vec![ActiveAdapter::new(adapter.clone(), 0.5), ActiveAdapter::new(second.clone(), 0.5)]));
    }
    let mut runs = interleaved(&mut session, &ids, &args, &sets)?.into_iter();
    // What serving holds: the model, its resident adapters, one session that has run (its caches,
    // the scratch), before the runs below create sessions of their own.
    let resident_bytes = ctx.bytes_allocated() - dropped_bytes;
    let ab = if sets.len() > 1 {
        decode_ab(&model, &args, &ids, sets.len(), |s, i| Ok(s.set_adapters(sets[i].1.clone())?))?
    } else {
        Vec::new()
    };
    let fusion = if args.fusion_ab { fusion_ab(&model, &args, &ids, &sets)? } else { serde_json::Value::Null };
    let (prefill, decode) = runs.next().expect("the base set");
    let counts = per_token_counts(&ctx, &mut session, &ids[..ids.len().min(8)], args.decode.min(8))?;
    let sampled_json = sampled_decode(&ctx, &mut session, &ids, &args)?;
    let mut summary = serde_json::json!({
        "gpu": ctx.info.name,
        "backend": format!("{:?}", ctx.info.backend),
        "subgroup_size": ctx.subgroup_size(),
        "run_ahead": session.run_ahead(),
        "model": args.model,
        "model_load_s": load_s,
        "weights": weight_dtypes(&model),
        "weight_bytes_per_decode_token": model.decode_weight_bytes(),
        "prompt_tokens": args.prompt,
        "decode_tokens": args.decode,
        "repeats": args.repeats,
        "prefill_tok_s": prefill.json(),
        "decode_tok_s": decode.json(),
        "dispatches_per_token": counts["dispatches_per_token"],
        "dispatches_per_token_fused": counts["dispatches_per_token_fused"],
        "dispatches_per_token_unfused": counts["dispatches_per_token_unfused"],
        "fused_decode": counts["fused_decode"],
        "submits_per_token": counts["submits_per_token"],
        "readback_bytes_per_token": counts["readback_bytes_per_token"],
        "sampled": sampled_json,
        "fusion_ab": fusion,
    });
    if let Some((path, adapter, second, loads)) = loaded {
        let file = path.join("adapter_model.safetensors");
        let bytes = std::fs::read(&file)?.len();
        let t = Instant::now();
        std::fs::read(&file)?;
        let read_s = t.elapsed().as_secs_f64();
        let (lp, ld) = runs.next().expect("the adapter's set");
        let (sp, sd) = runs.next().expect("the stacked set");
        session.set_adapter(Some((adapter.clone(), 1.0)))?;
        let adapter_counts = per_token_counts(&ctx, &mut session, &ids[..ids.len().min(8)], args.decode.min(8))?;
        let before = ctx.bytes_uploaded();
        let mut swaps = Series::default();
        for i in 0..args.swaps {
            let next = if i % 2 == 0 { second.clone() } else { adapter.clone() };
            let t = Instant::now();
            session.set_adapter(Some((next, 1.0)))?;
            swaps.0.push(t.elapsed().as_secs_f64() * 1e6);
        }
        let swap_bytes = ctx.bytes_uploaded() - before;
        // Decode while switching adapters before every token, against a fixed adapter.
        session.reset();
        let mut logits = session.feed(&ids[..8.min(ids.len())])?;
        let steps = args.decode.min(32);
        let count = |s: &mut Session, swap: bool, logits: &mut qwen35_wgpu::Logits| -> Result<(f64, u64)> {
            let b0 = ctx.bytes_uploaded();
            let t = Instant::now();
            for i in 0..steps {
                if swap {
                    s.set_adapter(Some((if i % 2 == 0 { second.clone() } else { adapter.clone() }, 1.0)))?;
                }
                *logits = s.feed(&[argmax(logits.last().ok_or(qwen35_wgpu::RunError::EmptyInput)?)])?;
            }
            Ok((steps as f64 / t.elapsed().as_secs_f64(), (ctx.bytes_uploaded() - b0) / steps as u64))
        };
        let (fixed_tps, fixed_bytes) = count(&mut session, false, &mut logits)?;
        let (swap_tps, swap_step_bytes) = count(&mut session, true, &mut logits)?;
        session
            .set_adapters(vec![ActiveAdapter::new(adapter.clone(), 0.5), ActiveAdapter::new(second.clone(), 0.5)])?;
        let stacked_counts = per_token_counts(&ctx, &mut session, &ids[..ids.len().min(8)], args.decode.min(8))?;
        session.set_adapter(Some((adapter.clone(), 1.0)))?;
        let batched_json = batched(&model, [&adapter, &second], &ids, &args)?;
        let adapter_profile = if args.profile {
            profile(&mut session, &ids, args.decode.min(16), Some((adapter.clone(), 1.0)))?
        } else {
            serde_json::Value::Null
        };
        // Ratios of runs of the same round (see [`interleaved`]), median over the rounds.
        let ratio = |a: &Series, b: &Series| paired(a, b)["median"].clone();
        summary["adapter"] = serde_json::json!({
            "path": path,
            "ranks": adapter.info.ranks,
            "modules": adapter.info.modules.len(),
            "file_bytes": bytes,
            "file_read_s": read_s,
            "load_s": loads.json(),
            "gpu_bytes": adapter.info.gpu_bytes,
            "prefill_tok_s": lp.json(),
            "decode_tok_s": ld.json(),
            "dispatches_per_token": adapter_counts["dispatches_per_token"],
            "dispatches_per_token_fused": adapter_counts["dispatches_per_token_fused"],
            "dispatches_per_token_unfused": adapter_counts["dispatches_per_token_unfused"],
            "prefill_ratio_adapter_over_base": ratio(&lp, &prefill),
            "decode_ratio_adapter_over_base": ratio(&ab[1], &ab[0]),
            "interleaved": "base, adapter and stacked runs alternate round by round (prefill ratios per round); \
                            decode ratios per round of decode_ab's blocks",
            "prefill_ratio_adapter_over_base_per_round": paired(&lp, &prefill),
            "decode_ratio_adapter_over_base_per_round": paired(&ab[1], &ab[0]),
            "decode_ab": {
                "block_tokens": AB_BLOCK,
                "timed_tokens_per_block": AB_BLOCK - 1,
                "rounds": ab[0].0.len(),
                "base_tok_s": ab[0].json(),
                "adapter_tok_s": ab[1].json(),
                "stacked_tok_s": ab[2].json(),
            },
            "swap_us": swaps.json(),
            "swap_bytes_uploaded_total": swap_bytes,
            "decode_fixed_adapter_tok_s": fixed_tps,
            "decode_swapping_every_token_tok_s": swap_tps,
            "bytes_uploaded_per_decode_step_fixed": fixed_bytes,
            "bytes_uploaded_per_decode_step_swapping": swap_step_bytes,
            "profile": adapter_profile,
            "batched": batched_json,
            "stacked": {
                "adapters": 2,
                "prefill_tok_s": sp.json(),
                "decode_tok_s": sd.json(),
                "dispatches_per_token": stacked_counts["dispatches_per_token"],
                "decode_ratio_stacked_over_one": ratio(&ab[2], &ab[1]),
                "prefill_ratio_stacked_over_one": ratio(&sp, &lp),
                "decode_ratio_stacked_over_one_per_round": paired(&ab[2], &ab[1]),
                "prefill_ratio_stacked_over_one_per_round": paired(&sp, &lp),
            },
        });
    }
    if args.profile {
        summary["profile"] = profile(&mut session, &ids, args.decode.min(16), None)?;
    }
    summary["gpu_bytes_resident"] = resident_bytes.into();
    summary["session_positions"] = session_positions.into();
    summary["gpu_bytes_allocated"] = ctx.bytes_allocated().into();
    summary["peak_rss_bytes"] = peak_rss().into();
    // After the memory figures: the yardsticks allocate their own buffers.
    let weight_bytes = model.decode_weight_bytes();
    let floor = (args.stream_mib > 0).then(|| -> Result<serde_json::Value> {
        let device = device_read_bandwidth(&ctx, args.stream_mib)?;
        let host = ctx.is_cpu().then(|| host_read_bandwidth(weight_bytes));
        let per_token = 1.0 / decode.median();
        let floor = |bw: f64| weight_bytes as f64 / bw;
        Ok(serde_json::json!({
            "stream_read_gb_s": device / 1e9,
            "stream_read_mib": args.stream_mib,
            "host_read_gb_s": host.map(|bw| bw / 1e9),
            "weight_bytes_per_decode_token": weight_bytes,
            "floor_ms_per_token": floor(device) * 1e3,
            "host_floor_ms_per_token": host.map(|bw| floor(bw) * 1e3),
            "measured_ms_per_token": per_token * 1e3,
            "decode_efficiency_of_floor": floor(device) / per_token,
            "decode_efficiency_of_host_floor": host.map(|bw| floor(bw) / per_token),
        }))
    });
    let floor = floor.transpose()?;
    summary["bandwidth_floor"] = floor.into();
    if args.chat_turns > 0 {
        drop(session);
        summary["prompt_cache"] = prompt_cache(&model, &args)?;
    } else {
        drop(session);
    }
    drop(model);
    if args.learn_tokens >= 2 {
        summary["learn"] = learn_step(&ctx, &args, &ids)?;
    }
    println!("{summary}");
    Ok(())
}

/// Decode throughput of `args.batch_sessions` sessions stepped together (an 8-token prompt each,
/// prefilled untimed but its last token, then `args.decode` batched greedy steps, at most 16,
/// through `Batch::generate`: choices on the GPU, `--run-ahead` as for one session; at most 3
/// timed repeats), every session with its own set: session k applies `adapters[0]`,
/// `adapters[1]` or none, by k mod 3; the last repeat's dispatches and submits per step as the
/// engine counted them (its pool copies included). The session counts run round by round (each
/// repeat runs every count once, the order turning each repeat), and each repeat's rate over the
/// same repeat's rate of the first count is reported (`speedup_over_first_paired`), so that the
/// machine's drift between the counts does not enter the ratio. With `--profile`, one more
/// generation per session count timed per kernel family (per step: a step is one token of every
/// session).
fn batched(
    model: &Arc<Model>,
    adapters: [&Arc<LoraAdapter>; 2],
    ids: &[u32],
    args: &Args,
) -> Result<serde_json::Value> {
    let prompt = &ids[..ids.len().min(8)];
    let steps = args.decode.min(16);
    let opts = SessionOptions { max_context: prompt.len() + steps + 1, max_batch: prompt.len() };
    let counts = &args.batch_sessions;
    // The largest count's sessions; a count of n steps the first n.
    let mut sessions = Vec::new();
    for k in 0..counts.iter().copied().max().unwrap_or(0) {
        let mut s = Session::new(model.clone(), opts.clone())?;
        s.set_adapter(adapters.get(k % 3).map(|a| ((*a).clone(), 1.0)))?;
        sessions.push(s);
    }
    let mut batches = Vec::with_capacity(counts.len());
    for &n in counts {
        let mut batch = Batch::new(model.clone(), n)?;
        if let RunAhead(Some(on)) = args.run_ahead {
            batch.set_run_ahead(on);
        }
        batches.push(batch);
    }
    let params = GenerateParams { max_tokens: steps, ..greedy(steps) };
    // One batched generation from the sessions freshly prefilled (untimed): its tokens, and the
    // seconds and work of the generation alone.
    let run = |batch: &mut Batch, sessions: &mut [Session]| -> Result<(Vec<Vec<u32>>, f64, Counters)> {
        let n = sessions.len();
        let mut refs = restart(sessions, prompt)?;
        let (prompts, fed) = (vec![prompt; n], vec![prompt.len() - 1; n]);
        let (t, before) = (Instant::now(), model.ctx.counters());
        let out = batch.generate(&mut refs, &prompts, &fed, &params)?;
        Ok((out, t.elapsed().as_secs_f64(), model.ctx.counters() - before))
    };
    let mut tps = vec![Series::default(); counts.len()];
    let mut paired = vec![Series::default(); counts.len()];
    let mut work = vec![Default::default(); counts.len()];
    for rep in 0..=args.repeats.min(3) {
        let mut rates = vec![f64::NAN; counts.len()];
        for turn in 0..counts.len() {
            let i = (turn + rep) % counts.len();
            let n = counts[i];
            let (out, secs, spent) = run(&mut batches[i], &mut sessions[..n])?;
            rates[i] = out.iter().map(Vec::len).sum::<usize>() as f64 / secs;
            work[i] = spent;
            eprintln!("batched {n} rep {rep}: {:.2} tok/s in all", rates[i]);
        }
        if rep > 0 {
            for (i, &rate) in rates.iter().enumerate() {
                tps[i].0.push(rate);
                paired[i].0.push(rate / rates[0]);
            }
        }
    }
    let mut rows = Vec::with_capacity(counts.len());
    for (i, &n) in counts.iter().enumerate() {
        // Counted by the engine over the count's last generation (its pool copies included).
        let per_step = |count: u64| count as f64 / steps.max(1) as f64;
        let mut row = serde_json::json!({
            "sessions": n,
            "steps": steps,
            "run_ahead": batches[i].run_ahead(),
            "decode_tok_s": tps[i].json(),
            "speedup_over_first_paired": paired[i].json(),
            "dispatches_per_step": per_step(work[i].dispatches),
            "submits_per_step": per_step(work[i].submits),
        });
        if args.profile && batches[i].start_profile() {
            run(&mut batches[i], &mut sessions[..n])?;
            let p = batches[i].take_profile().unwrap_or_default();
            row["profile_per_step"] = serde_json::json!(family_table(&p.submits, p.submits.len().max(1) as f64));
        }
        rows.push(row);
    }
    Ok(serde_json::Value::Array(rows))
}

/// Every session reset and prefilled with `prompt` but its last token (the batch decodes from it).
fn restart<'a>(sessions: &'a mut [Session], prompt: &[u32]) -> Result<Vec<&'a mut Session>> {
    for s in sessions.iter_mut() {
        s.reset();
        if prompt.len() > 1 {
            s.prefill(&prompt[..prompt.len() - 1])?;
        }
    }
    Ok(sessions.iter_mut().collect())
}

/// The last turn of an `args.chat_turns`-turn chat (token ids; the conversation so far, plus
/// the reply, plus the new user tokens), timed with the prompt cache (turns 1..N−1 run first, so
/// the session holds the conversation up to the last reply) and without (a full prefill): two
/// chats in lockstep, so each repeat's two last turns run back to back and their ratio
/// (`speedup_paired`) does not see the machine's drift between them.
fn prompt_cache(model: &Arc<Model>, args: &Args) -> Result<serde_json::Value> {
    let vocab = model.config.vocab_size as u32;
    let user = (args.prompt / 4).max(1);
    let turns = args.chat_turns;
    // Replies of at most 8 tokens, at most 2 timed repeats: the turn's prefill is what differs.
    let decode = args.decode.min(8);
    let opts = SessionOptions { max_context: turns * (user + decode) + 16, max_batch: args.prompt.max(1) };
    let params = GenerateParams { stop_at_eos: false, ..greedy(decode) };
    // (reply, seconds to the first reply token, seconds for the whole turn)
    let turn = |session: &mut Session, cache: &mut PromptCache, prompt: &[u32]| -> Result<(Vec<u32>, f64, f64)> {
        let t = Instant::now();
        let mut first = None;
        let fed = cache.prepare(session, prompt, None)?;
        let out = session.generate_from_with(prompt, fed, &params, |_, _| {
            first.get_or_insert_with(|| t.elapsed().as_secs_f64());
            Ok::<_, qwen35_wgpu::RunError>(true)
        })?;
        let s = t.elapsed().as_secs_f64();
        cache.finish(session, prompt, &out);
        Ok((out, first.unwrap_or(s), s))
    };
    let (mut with, mut without) = (Series::default(), Series::default());
    let (mut first_with, mut first_without) = (Series::default(), Series::default());
    // Per repeat, the two last turns' ratio (without / with), whole and to the first token.
    let (mut paired, mut first_paired) = (Series::default(), Series::default());
    let mut last_prompt = 0;
    // The last turn's submits and dispatches, without and with the cache (the same every repeat).
    let mut work = [None, None];
    for repeat in 0..=args.repeats.min(2) {
        // Two chats in lockstep, without the cache (0) and with it (1), each turn of one right
        // after the same turn of the other (in turns, which goes first), so both last turns
        // run within seconds of each other on a machine whose speed drifts.
        let mut chats = Vec::new();
        for cached in [false, true] {
            let mut cache = PromptCache::default();
            cache.set_enabled(cached);
            chats.push((Session::new(model.clone(), opts.clone())?, cache, Vec::new(), (0.0, 0.0)));
        }
        for k in 0..turns {
            let order = if (repeat + k) % 2 == 0 { [1, 0] } else { [0, 1] };
            for i in order {
                let (session, cache, conversation, last) = &mut chats[i];
                conversation.extend((0..user as u32).map(|j| (j * 7919 + 13 + k as u32 * 104_729) % vocab));
                let before = model.ctx.counters();
                let (out, first, s) = turn(session, cache, conversation)?;
                work[i] = Some(model.ctx.counters() - before);
                last_prompt = conversation.len();
                conversation.extend(out);
                *last = (first, s);
            }
        }
        if repeat > 0 {
            let (fresh, cached) = (chats[0].3, chats[1].3);
            first_without.0.push(fresh.0);
            without.0.push(fresh.1);
            first_with.0.push(cached.0);
            with.0.push(cached.1);
            first_paired.0.push(fresh.0 / cached.0);
            paired.0.push(fresh.1 / cached.1);
        }
    }
    Ok(serde_json::json!({
        "turns": turns,
        "last_turn_prompt_tokens": last_prompt,
        "decode_tokens": decode,
        "last_turn_s_with_cache": with.json(),
        "last_turn_s_without_cache": without.json(),
        "speedup": without.median() / with.median(),
        "last_turn_first_token_s_with_cache": first_with.json(),
        "last_turn_first_token_s_without_cache": first_without.json(),
        "first_token_speedup": first_without.median() / first_with.median(),
        "speedup_paired": paired.json(),
        "first_token_speedup_paired": first_paired.json(),
        "last_turn_submits_with_cache": work[1].map(|w| w.submits),
        "last_turn_submits_without_cache": work[0].map(|w| w.submits),
        "last_turn_dispatches_with_cache": work[1].map(|w| w.dispatches),
        "last_turn_dispatches_without_cache": work[0].map(|w| w.dispatches),
    }))
}

/// The distinct dtypes of the model's matrices, e.g. `["BF16"]` or `["affine 4-bit g64 BF16"]`.
fn weight_dtypes(model: &Model) -> Vec<String> {
    let mut all = vec![model.embed.dtype];
    for l in &model.layers {
        all.extend([l.mlp.gate_up.dtype, l.mlp.down_proj.dtype]);
        match &l.mixer {
            Mixer::Attention(a) => all.extend([a.qkv.dtype, a.o_proj.dtype]),
            Mixer::Gdn(g) => all.extend([g.in_proj.dtype, g.out_proj.dtype]),
        }
    }
    let mut names: Vec<String> = all
        .into_iter()
        .map(|d| match d {
            Dtype::Affine(a) => format!("affine {}-bit g{} {:?}", a.bits, a.group, a.scales),
            other => format!("{other:?}"),
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Time learning steps of one supervised event of `--learn-tokens` tokens on a rank-16 adapter
/// over the seven projections of the last layer (median after a warm-up step).
fn learn_step(ctx: &Arc<GpuContext>, args: &Args, ids: &[u32]) -> Result<serde_json::Value> {
    let n = args.learn_tokens;
    let opts = SessionOptions { max_context: n, max_batch: n };
    let mut backend = WgpuBackend::with_context(ctx.clone(), opts);
    backend.load_model(&args.model)?;
    backend.create_trainable_adapter(&TrainSpec { rank: 16, alpha: 32.0, ..Default::default() })?;
    let all: Vec<u32> = ids.iter().cycle().take(n).copied().collect();
    let event =
        TokenEvent { prompt: all[..n / 2].to_vec(), response: all[n / 2..].to_vec(), signal: Signal::Preferred };
    let mut steps = Series::default();
    for rep in 0..=args.repeats {
        let t = Instant::now();
        let report = backend.learn_tokens(std::slice::from_ref(&event), &LearnOptions::default())?;
        let s = t.elapsed().as_secs_f64();
        eprintln!("learn rep {rep}: {s:.3} s, mean CE {:.3}", report.event_ce[0]);
        if rep > 0 {
            steps.0.push(s);
        }
    }
    Ok(serde_json::json!({
        "event_tokens": n,
        "response_tokens": n - n / 2,
        "rank": 16,
        "targets": "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj",
        "step_s": steps.json(),
    }))
}

/// The process's peak resident set (VmHWM), 0 where /proc is absent.
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1024)
}
