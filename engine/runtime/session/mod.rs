//! A session: one sequence's caches on one model. Prompts longer than the session's batch are
//! processed in chunks; each chunk is one command buffer.

use std::sync::Arc;

use crate::error::{AdapterError, GpuError, RunError};
use crate::gpu::{read_f32, read_f32_via, GpuContext, IoBindCache, Profile, Recorder, Staging};
use crate::kernels::misc::{
    argmax_scratch_bytes, topk, topk_blocks, topk_mass_offset, topk_max, topk_scratch_bytes, topk_value, TopkIo,
};
use crate::lora::LoraAdapter;
use crate::model::Model;
use crate::runtime::adapters::{ActiveAdapter, LoraState};
use crate::runtime::cache::{layer_states, rope_table, rope_table_bytes, LayerState, Scratch};
use crate::runtime::sampler::{Candidates, Sampler};
use crate::runtime::{CancelFlag, GenerateParams};

mod snapshot;
mod step;

pub use snapshot::StateSnapshot;
pub(crate) use step::{Capture, Input, LearnTaps, Rows};

/// Largest context a session holds, in tokens (2^20: four times Qwen 3.5's 262,144 positions).
/// Checked before anything is allocated, so every cache size below is computed without overflow.
pub const MAX_CONTEXT: usize = 1 << 20;

/// Largest prefill chunk, in tokens per command buffer: 2^16 − 1, the most workgroups WebGPU's
/// default limits give a grid dimension (the embedding's grid has a row of workgroups per token).
pub const MAX_BATCH: usize = (1 << 16) - 1;

/// Session sizes.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Context capacity in tokens (KV cache and RoPE table size).
    pub max_context: usize,
    /// Tokens processed per command buffer during prefill.
    pub max_batch: usize,
}

impl Default for SessionOptions {
    fn default() -> Self {
        Self { max_context: 2048, max_batch: 128 }
    }
}

/// Logits read back from a step.
#[derive(Clone, Debug)]
pub struct Logits {
    /// Rows (positions) held.
    pub rows: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// `[rows, vocab]` row-major.
    pub data: Vec<f32>,
}

impl Logits {
    /// The logits of row `i`; `None` when `i >= rows` or `data` is shorter than `rows · vocab`
    /// (every field is public).
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        if i >= self.rows {
            return None;
        }
        let start = i.checked_mul(self.vocab)?;
        self.data.get(start..start.checked_add(self.vocab)?)
    }

    /// The last row; `None` when there are no rows (a step returns at least one).
    pub fn last(&self) -> Option<&[f32]> {
        self.row(self.rows.checked_sub(1)?)
    }
}

/// What a sampled step's candidate pass hands the host ([`Session::read_sample`]).
pub(crate) struct SampleRead {
    /// The best (id, logit) pairs outside the history, best first.
    pub(crate) cands: Candidates,
    /// The distinct history ids' logits, in the order they were uploaded.
    pub(crate) hist: Vec<f32>,
    /// Per block of logits `(m, s)`: its largest logit outside the history and
    /// `Σ exp((l − m) · inv_t)` over them (sampling without top-k; else empty).
    pub(crate) masses: Vec<(f32, f32)>,
}

/// The buffers of a sampled step's candidate pass (`topk.wgsl`), reused for every token.
pub(crate) struct SampleBuffers {
    /// The blocks' pairs.
    pub(crate) parts: wgpu::Buffer,
    /// The best pairs (key, id).
    pub(crate) out: wgpu::Buffer,
    /// The distinct history ids (repetition penalty).
    pub(crate) hist_ids: wgpu::Buffer,
    /// Their logits.
    pub(crate) hist_out: wgpu::Buffer,
    /// The argmax pass's output: word 1 is the row's non-finite flag.
    pub(crate) flag: wgpu::Buffer,
    /// The pairs, then the history logits, then the non-finite flag, then (sampling without
    /// top-k) the blocks' softmax masses, as read back.
    pub(crate) staging: Staging,
}

impl SampleBuffers {
    fn new(ctx: &GpuContext, vocab: usize, max_context: usize) -> Result<Self, GpuError> {
        let hist = (max_context.min(vocab) * 4) as u64;
        let pairs = (topk_max(vocab) * 8) as u64;
        Ok(Self {
            parts: ctx.storage_buffer("top-k pairs", topk_scratch_bytes(vocab), true)?,
            out: ctx.storage_buffer("top-k candidates", pairs, true)?,
            hist_ids: ctx.storage_buffer("history ids", hist, true)?,
            hist_out: ctx.storage_buffer("history logits", hist, true)?,
            flag: ctx.storage_buffer("non-finite flag", 8, true)?,
            staging: Staging::new(ctx, "candidates readback", pairs + hist + 4 + (topk_blocks(vocab) * 8) as u64),
        })
    }

    /// Upload the distinct history ids a sample step masks (nothing for none).
    pub(crate) fn write_history(&self, ctx: &GpuContext, history: &[u32]) {
        if !history.is_empty() {
            ctx.write(&self.hist_ids, 0, bytemuck::cast_slice(history));
        }
    }

    /// Record the candidate pass over the row of logits at the start of `logits` (its history
    /// entries are overwritten by the mask) with `(k, hist, mass)` as in [`Session::submit_sample`],
    /// and the copies into the staging [`Session::read_sample`] reads: the pairs, the history's
    /// logits, the row's non-finite flag (the word at `flag`, which an argmax pass computed
    /// before the mask), then with `mass` the blocks' softmax masses.
    pub(crate) fn record(
        &self,
        rec: &mut Recorder,
        logits: &wgpu::Buffer,
        flag: (&wgpu::Buffer, u64),
        vocab: usize,
        (k, hist, mass): (usize, usize, Option<f32>),
    ) -> Result<(), GpuError> {
        let flag_at = (k * 8 + hist * 4) as u64;
        rec.copy(flag.0, flag.1, self.staging.buffer(), flag_at, 4);
        let io =
            TopkIo { logits, parts: &self.parts, out: &self.out, hist_ids: &self.hist_ids, hist_out: &self.hist_out };
        topk(rec, &io, vocab, k, hist, mass.unwrap_or(0.0))?;
        let pairs = (k * 8) as u64;
        rec.copy(&self.out, 0, self.staging.buffer(), 0, pairs);
        if hist > 0 {
            rec.copy(&self.hist_out, 0, self.staging.buffer(), pairs, (hist * 4) as u64);
        }
        if mass.is_some() {
            let bytes = (topk_blocks(vocab) * 8) as u64;
            rec.copy(&self.parts, topk_mass_offset(vocab, k), self.staging.buffer(), flag_at + 4, bytes);
        }
        Ok(())
    }
}

/// Numbers of sessions, for their snapshots.
static NEXT_SESSION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One sequence's state on a model.
pub struct Session {
    pub(crate) model: Arc<Model>,
    pub(crate) opts: SessionOptions,
    pub(crate) pos: usize,
    pub(crate) scratch: Scratch,
    pub(crate) states: Vec<LayerState>,
    pub(crate) ids: wgpu::Buffer,
    pub(crate) rope: wgpu::Buffer,
    pub(crate) logits: wgpu::Buffer,
    pub(crate) logits_rows: usize,
    pub(crate) io: IoBindCache,
    pub(crate) lora: LoraState,
    /// Which buffer of each GDN state pair holds the committed state.
    pub(crate) parity: usize,
    /// Bumped by every change of what the next step computes (a committed step, a reset, an
    /// adapter change), so a run-ahead step can tell whether it is still the right one.
    pub(crate) epoch: u64,
    /// This session among all (snapshots name the session they were taken from).
    uid: u64,
    /// Moves back (resets, restores) so far, and the lowest position reached since each: the
    /// KV cache below a snapshot's position holds its tokens as long as no later move back went
    /// below it. Kept as a stack of (count, position) with positions rising, so it never holds
    /// more entries than positions.
    rewinds: u64,
    lows: Vec<(u64, usize)>,
    /// Bumped by every adapter change (a new set, a stack forgotten after a learning step):
    /// states computed before it are not those of the adapters now.
    adapters_version: u64,
    /// Candidates of the greedy choice's first pass.
    pub(crate) parts: wgpu::Buffer,
    /// Where greedy steps copy their chosen id (two slots: the step being read and the one
    /// running ahead).
    pub(crate) chosen: [Staging; 2],
    /// Reused for one row of logits.
    pub(crate) logits_staging: Staging,
    /// What sampled steps choose from (the GPU's top-k candidates).
    pub(crate) sample: SampleBuffers,
    /// GPU timings of every dispatch while profiling.
    pub(crate) profile: Option<Profile>,
    /// Whether single-token steps fold the block norms and SwiGLU into the projections.
    pub(crate) fused: bool,
    /// Whether greedy generation submits step t + 1 before it reads token t.
    pub(crate) run_ahead: bool,
    /// Snapshots asked for at positions ahead ([`Session::snapshot_at`]).
    taps: snapshot::Taps,
}

impl Session {
    /// Allocate a session's caches and scratch on `model`.
    pub fn new(model: Arc<Model>, opts: SessionOptions) -> Result<Self, RunError> {
        if opts.max_batch == 0 || opts.max_context == 0 {
            return Err(RunError::BadParam {
                name: "max_batch/max_context",
                value: format!("{}/{}", opts.max_batch, opts.max_context),
                expected: "both > 0",
            });
        }
        if opts.max_context > MAX_CONTEXT {
            return Err(RunError::BadParam {
                name: "max_context",
                value: opts.max_context.to_string(),
                expected: "at most 2^20 tokens (MAX_CONTEXT)",
            });
        }
        if opts.max_batch > MAX_BATCH {
            return Err(RunError::BadParam {
                name: "max_batch",
                value: opts.max_batch.to_string(),
                expected: "at most 65,535 tokens (MAX_BATCH)",
            });
        }
        model.check().map_err(|e| RunError::ModelConfig(Box::new(e)))?;
        let ctx = model.ctx.clone();
        let c = &model.config;
        // The RoPE table is computed on the host before its upload: check its size first.
        let rope_bytes = rope_table_bytes(c, opts.max_context);
        if rope_bytes > ctx.max_binding() {
            return Err(
                GpuError::BufferTooLarge { name: "rope".into(), needed: rope_bytes, limit: ctx.max_binding() }.into()
            );
        }
        let scratch = Scratch::new(&ctx, c, opts.max_batch, 1)?;
        let states = layer_states(&ctx, c, opts.max_context)?;
        let ids = ctx.storage_buffer("ids", (opts.max_batch * 4) as u64, true)?;
        let mut table = rope_table(c, opts.max_context)?;
        table.resize(table.len().max(2), 0.0); // one vec2 even without rotary dims
        let rope = ctx.upload("rope", bytemuck::cast_slice(&table))?;
        let row_bytes = (c.vocab_size * 4) as u64;
        let logits_rows = ((ctx.max_binding() / row_bytes) as usize).clamp(1, opts.max_batch);
        let logits = ctx.storage_buffer("logits", row_bytes * logits_rows as u64, true)?;
        let parts = ctx.storage_buffer("argmax candidates", argmax_scratch_bytes(c.vocab_size), true)?;
        // The chosen id and the row's non-finite flag.
        let chosen = [Staging::new(&ctx, "chosen id 0", 8), Staging::new(&ctx, "chosen id 1", 8)];
        let logits_staging = Staging::new(&ctx, "logits readback", row_bytes);
        let sample = SampleBuffers::new(&ctx, c.vocab_size, opts.max_context)?;
        let mut s = Self {
            model,
            opts,
            pos: 0,
            scratch,
            states,
            ids,
            rope,
            logits,
            logits_rows,
            // The recorder grows the arena to what a step needs; this holds a decode step.
            io: IoBindCache::with_arena(&ctx, "uniform arena", 512 * 256),
            lora: LoraState::default(),
            parity: 0,
            epoch: 0,
            uid: NEXT_SESSION.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            rewinds: 0,
            lows: Vec::new(),
            adapters_version: 0,
            parts,
            chosen,
            logits_staging,
            sample,
            profile: None,
            fused: true,
            run_ahead: !ctx.is_cpu(),
            taps: snapshot::Taps::default(),
        };
        s.reset();
        Ok(s)
    }

    /// The sizes the session was made with.
    pub fn options(&self) -> &SessionOptions {
        &self.opts
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens in the cache.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The adapter the next step applies, when exactly one is active.
    pub fn adapter(&self) -> Option<&ActiveAdapter> {
        match self.lora.active.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }

    /// The active adapter set, as given to [`Session::set_adapters`].
    pub fn adapters(&self) -> &[ActiveAdapter] {
        &self.lora.active
    }

    /// Apply `adapter` with `scale` from the next step on (`None`: the base model): the set of
    /// that one adapter ([`Session::set_adapters`]).
    pub fn set_adapter(&mut self, adapter: Option<(Arc<LoraAdapter>, f32)>) -> Result<(), AdapterError> {
        self.set_adapters(adapter.into_iter().map(|(a, s)| ActiveAdapter::new(a, s)).collect())
    }

    /// Apply the adapter set `set` from the next step on: every adapter with its scale and
    /// per-layer factors, their deltas summed (an empty set, or scales of 0: the base model).
    /// One adapter binds its own bind groups; several bind a stack of them, built once per
    /// combination of members (scale and factor changes only rewrite the scale table). The
    /// caches are kept: tokens already in them keep the states computed under the previous set
    /// (switching between tokens of one generation). Call [`Session::reset`] to start a
    /// request cleanly under the new set. On error nothing changes.
    pub fn set_adapters(&mut self, set: Vec<ActiveAdapter>) -> Result<(), AdapterError> {
        let before = self.lora.own_buffers();
        self.lora.bind(&self.model, self.opts.max_batch, set)?;
        self.epoch += 1;
        self.adapters_version += 1;
        self.forget_dropped(before);
        Ok(())
    }

    /// Forget the stack built for the current set, so that the next [`Session::set_adapters`]
    /// rebuilds it from its members' current weights (after a learning step).
    pub fn forget_stack(&mut self) {
        let before = self.lora.own_buffers();
        self.lora.forget_stack();
        self.adapters_version += 1;
        self.forget_dropped(before);
    }

    /// Let go of the cached bind groups that bind `adapter`'s buffers, so that its GPU memory is
    /// freed when its owner drops it (call it for an adapter this session applied that is being
    /// dropped; the backend does this when it removes a resident adapter).
    pub fn forget_adapter(&mut self, adapter: &LoraAdapter) {
        self.io.forget_buffers(&adapter.buffers());
    }

    /// Let go of the cached bind groups of the buffers of `before` (this session's own adapter
    /// buffers before a change) that it no longer holds: a replaced stack or t scratch.
    fn forget_dropped(&mut self, before: Vec<wgpu::Buffer>) {
        let now = self.lora.own_buffers();
        let gone: Vec<&wgpu::Buffer> = before.iter().filter(|b| !now.contains(b)).collect();
        if !gone.is_empty() {
            self.io.forget_buffers(&gone);
        }
    }

    /// Whether the stack this session keeps (bound or not) holds `adapter`.
    pub fn stack_holds(&self, adapter: &Arc<LoraAdapter>) -> bool {
        self.lora.stack_holds(adapter)
    }

    /// Forget the sequence: zero the GDN states and rewind the position.
    pub fn reset(&mut self) {
        let ctx = &self.model.ctx;
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("reset") });
        for st in &self.states {
            if let LayerState::Gdn { conv, state } = st {
                for b in conv.iter().chain(state) {
                    enc.clear_buffer(b, 0, None);
                }
            }
        }
        ctx.submit(enc.finish(), 0);
        self.pos = 0;
        self.epoch += 1;
        self.moved_back();
    }

    /// What identifies the session's state: the session and its step epoch (every step, reset
    /// and adapter change moves it). Equal stamps: nothing ran or changed in between.
    pub(crate) fn stamp(&self) -> (u64, u64) {
        (self.uid, self.epoch)
    }

    /// Note that the position just went back (to `self.pos`).
    fn moved_back(&mut self) {
        self.drop_pending_taps();
        self.rewinds += 1;
        while self.lows.last().is_some_and(|&(_, low)| low >= self.pos) {
            self.lows.pop();
        }
        self.lows.push((self.rewinds, self.pos));
    }

    /// Run `ids` through the model at the current position without reading anything back (a
    /// prompt's prefix whose logits nobody needs), in chunks of at most `max_batch`.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<(), RunError> {
        self.prefill_until(ids, None).map(|_| ())
    }

    /// [`Session::prefill`] that stops between chunks once `cancel` is raised and returns how
    /// many ids ran (all of them when it is not raised; the session holds those). With a flag,
    /// each chunk is submitted before the one ahead of it is waited for, so the device stays
    /// busy while a cancel waits for at most the chunk that runs and the one queued behind it,
    /// not for the whole prompt.
    pub fn prefill_until(&mut self, ids: &[u32], cancel: Option<&CancelFlag>) -> Result<usize, RunError> {
        self.check(ids)?;
        let mut ran = 0;
        let mut previous = None;
        for chunk in ids.chunks(self.opts.max_batch) {
            if cancel.is_some_and(CancelFlag::is_raised) {
                break;
            }
            let index = self.step(Input::Ids(chunk), Rows::Hidden, Capture::None)?.index;
            self.commit(chunk.len());
            ran += chunk.len();
            if let Some(ahead) = previous.replace(index).filter(|_| cancel.is_some()) {
                self.ctx().wait_for(ahead)?;
            }
        }
        Ok(ran)
    }

    /// Time every dispatch of the following steps on the GPU (one list per submit) until
    /// [`Session::take_profile`]. Needs `TIMESTAMP_QUERY`; returns whether the device has it.
    /// Profiled steps wait for their timings, so they are slower than plain ones.
    pub fn start_profile(&mut self) -> bool {
        self.profile = Profile::if_timed(self.ctx());
        self.profile.is_some()
    }

    /// How many bind groups the session keeps (built once per kernel and buffer set; a step's
    /// dispatches that write a snapshot's states drop theirs).
    pub fn cached_bind_groups(&self) -> usize {
        self.io.cached_groups()
    }

    /// Stop profiling and return what was timed.
    pub fn take_profile(&mut self) -> Option<Profile> {
        self.profile.take()
    }

    /// Whether single-token steps fold each block's RMSNorm and the MLP's SwiGLU into the
    /// projections that read them (49 fewer dispatches per greedy token at the 0.8B dimensions).
    /// On by default on every adapter: the residual projection before each block writes the
    /// block's input already through the norm weight, with its sums of squares, so the folded
    /// projections load no more than plain ones (on lavapipe, where every extra load costs
    /// instructions, `bench --fusion-ab` measures fused / unfused 1.00; ARCHITECTURE.md,
    /// "Decode"). Steps of 2 to 8 tokens (short prompts) fold the block norms too, into the
    /// batched matvec, and a step of any length whose last row alone goes to lm_head folds the
    /// final norm into it, when the rows are not read back as hidden states or for learning.
    /// Off runs the norms and SwiGLU as dispatches of their own (a [`crate::Batch`] step folds
    /// its norms either way).
    pub fn set_fused_decode(&mut self, on: bool) {
        self.fused = on;
    }

    /// See [`Session::set_fused_decode`].
    pub fn fused_decode(&self) -> bool {
        self.fused
    }

    /// Whether greedy generation submits step t + 1 (its input: the id step t's argmax leaves
    /// on the GPU) before it reads token t, so the device never waits for the host. The default
    /// is on for GPUs and off for CPU adapters (lavapipe), where the device is the host's own
    /// cores: recording the next step while the current one runs takes a core from it, and
    /// greedy decode measured 10-15 % slower with it (BENCHMARKS.md, "History").
    pub fn set_run_ahead(&mut self, on: bool) {
        self.run_ahead = on;
    }

    /// See [`Session::set_run_ahead`].
    pub fn run_ahead(&self) -> bool {
        self.run_ahead
    }

    /// Make a submitted step of `tokens` tokens part of the sequence: its GDN states become the
    /// committed ones and the position advances.
    pub(crate) fn commit(&mut self, tokens: usize) {
        self.commit_taps();
        self.pos += tokens;
        self.parity = 1 - self.parity;
        self.epoch += 1;
    }

    /// Run `ids` through the model at the current position, extend the caches, and return the
    /// logits of the last token.
    pub fn feed(&mut self, ids: &[u32]) -> Result<Logits, RunError> {
        Ok(self.run(ids, false, false)?.0)
    }

    /// Like [`Session::feed`] but returns the logits of every position of `ids`.
    pub fn feed_all(&mut self, ids: &[u32]) -> Result<Logits, RunError> {
        Ok(self.run(ids, true, false)?.0)
    }

    /// Logits of every position plus the residual stream `[L+1, T, H]` (embeddings, then after
    /// each layer), for locating divergences. `ids` must fit in one batch.
    pub fn feed_debug(&mut self, ids: &[u32]) -> Result<(Logits, Vec<f32>), RunError> {
        if ids.len() > self.opts.max_batch {
            return Err(RunError::BadParam {
                name: "ids",
                value: format!("{} tokens", ids.len()),
                expected: "at most max_batch tokens for a debug step",
            });
        }
        let (logits, hidden) = self.run(ids, true, true)?;
        Ok((logits, hidden.unwrap_or_default()))
    }

    /// The final-norm hidden states `[T, H]` of `ids` (the input of lm_head), extending the caches.
    pub fn final_hidden(&mut self, ids: &[u32]) -> Result<Vec<f32>, RunError> {
        self.check(ids)?;
        let h = self.model.config.hidden_size;
        let mut out = Vec::with_capacity(ids.len() * h);
        for chunk in ids.chunks(self.opts.max_batch) {
            self.step(Input::Ids(chunk), Rows::Hidden, Capture::None)?;
            out.extend(read_f32(self.ctx(), &self.scratch.xnorm, 0, chunk.len() * h)?);
            self.commit(chunk.len());
        }
        Ok(out)
    }

    /// Check `prompt`, run and commit every chunk of it but the last (rows that need no logits),
    /// and return the last chunk: the step that makes the first choice is the caller's.
    /// `None` when `cancel` was raised before the last chunk's step (the session holds the
    /// chunks that ran).
    pub(crate) fn prefill_leading<'p>(
        &mut self,
        prompt: &'p [u32],
        cancel: Option<&CancelFlag>,
    ) -> Result<Option<&'p [u32]>, RunError> {
        self.check(prompt)?;
        let batch = self.opts.max_batch;
        let head = (prompt.len() - 1) / batch * batch;
        if head > 0 && self.prefill_until(&prompt[..head], cancel)? < head {
            return Ok(None);
        }
        Ok((!cancel.is_some_and(CancelFlag::is_raised)).then_some(&prompt[head..]))
    }

    /// What generating from `prompt` (a whole conversation, from position 0) with `params`
    /// would refuse, checked before anything runs or is reused: an empty prompt, a token
    /// outside the vocabulary, a prompt the context cannot hold, bad sampling parameters.
    pub(crate) fn check_request(&self, prompt: &[u32], params: &GenerateParams) -> Result<(), RunError> {
        self.check_at(prompt, 0)?;
        Sampler::from_params(params).map(|_| ())
    }

    /// What running `ids` from the current position would refuse.
    pub(crate) fn check(&self, ids: &[u32]) -> Result<(), RunError> {
        self.check_at(ids, self.pos)
    }

    /// `ids` are not empty, all in the vocabulary, and fit the context from position `at`.
    pub(crate) fn check_at(&self, ids: &[u32], at: usize) -> Result<(), RunError> {
        if ids.is_empty() {
            return Err(RunError::EmptyInput);
        }
        let vocab = self.model.config.vocab_size;
        if let Some((index, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(RunError::TokenOutOfRange { id, index, vocab });
        }
        if at + ids.len() > self.opts.max_context {
            return Err(RunError::ContextFull { needed: at + ids.len(), capacity: self.opts.max_context });
        }
        Ok(())
    }

    fn run(&mut self, ids: &[u32], all: bool, capture: bool) -> Result<(Logits, Option<Vec<f32>>), RunError> {
        self.check(ids)?;
        let vocab = self.model.config.vocab_size;
        let mut logits = Logits { rows: 0, vocab, data: Vec::new() };
        let mut hidden = None;
        let chunks = ids.len().div_ceil(self.opts.max_batch);
        for (i, chunk) in ids.chunks(self.opts.max_batch).enumerate() {
            let tap = if capture { Capture::Layers } else { Capture::None };
            // Only the last chunk's last row matters to `feed`: earlier chunks skip lm_head.
            let rows = match (all, i + 1 == chunks) {
                (true, _) => Rows::All,
                (false, true) => Rows::Last,
                (false, false) => Rows::Hidden,
            };
            let out = self.step(Input::Ids(chunk), rows, tap)?;
            self.commit(chunk.len());
            if all {
                logits.rows += out.logits.rows;
                logits.data.extend(out.logits.data);
            } else {
                logits = out.logits;
            }
            hidden = out.hidden;
        }
        Ok((logits, hidden))
    }

    pub(crate) fn ctx(&self) -> &GpuContext {
        &self.model.ctx
    }

    pub(crate) fn read_logits(&self, rows: usize) -> Result<Vec<f32>, RunError> {
        let n = rows * self.model.config.vocab_size;
        if rows == 1 {
            return Ok(read_f32_via(self.ctx(), &self.logits, 0, n, &self.logits_staging)?);
        }
        Ok(read_f32(self.ctx(), &self.logits, 0, n)?)
    }

    /// Submit a step of `input` whose last position's greedy choice is made on the GPU and
    /// copied into staging slot `slot`; the step is not committed and nothing is waited for.
    pub(crate) fn submit_choice(&mut self, input: Input, slot: usize) -> Result<wgpu::SubmissionIndex, RunError> {
        Ok(self.step(input, Rows::Choose { slot }, Capture::None)?.index)
    }

    /// Submit a step of `input` whose last position's logits go through the top-`k` candidate
    /// pass, with the logits of the distinct `history` ids copied out and masked, and with
    /// `mass` (an inverse temperature) the blocks' softmax masses; not committed.
    pub(crate) fn submit_sample(
        &mut self,
        input: Input,
        k: usize,
        history: &[u32],
        mass: Option<f32>,
    ) -> Result<wgpu::SubmissionIndex, RunError> {
        self.sample.write_history(self.ctx(), history);
        Ok(self.step(input, Rows::Sample { k, hist: history.len(), mass }, Capture::None)?.index)
    }

    /// The most distinct history ids a sample step takes (its history buffer's words).
    pub(crate) fn sample_history_capacity(&self) -> usize {
        (self.sample.hist_ids.size() / 4) as usize
    }

    /// What a sample step left, once submission `index` has completed: the candidates (id,
    /// logit), best first, the history's logits, and with `mass` the blocks' softmax masses
    /// (`topk.wgsl`; empty without); a [`RunError::NonFiniteLogits`] when the row held a NaN or
    /// an infinity. `position` is the sequence position of the step's last token.
    pub(crate) fn read_sample(
        &self,
        index: wgpu::SubmissionIndex,
        (k, hist, mass): (usize, usize, bool),
        position: usize,
    ) -> Result<SampleRead, RunError> {
        let blocks = if mass { topk_blocks(self.model.config.vocab_size) } else { 0 };
        let words = self.sample.staging.read_words(self.ctx(), index, 2 * k + hist + 1 + 2 * blocks)?;
        if words[2 * k + hist] != 0 {
            return Err(RunError::NonFiniteLogits { position });
        }
        let cands = words[..2 * k].chunks_exact(2).map(|p| (p[1], topk_value(p[0]))).collect();
        let logits = words[2 * k..2 * k + hist].iter().map(|&w| f32::from_bits(w)).collect();
        let masses =
            words[2 * k + hist + 1..].chunks_exact(2).map(|p| (f32::from_bits(p[0]), f32::from_bits(p[1]))).collect();
        Ok(SampleRead { cands, hist: logits, masses })
    }

    /// The id a choice step copied into `slot`, once submission `index` has completed; a
    /// [`RunError::NonFiniteLogits`] when the row held a NaN or an infinity. `position` is the
    /// sequence position of the step's token.
    pub(crate) fn read_choice(
        &self,
        index: wgpu::SubmissionIndex,
        slot: usize,
        position: usize,
    ) -> Result<u32, RunError> {
        let words = self.chosen[slot].read_words(self.ctx(), index, 2)?;
        if words[1] != 0 {
            return Err(RunError::NonFiniteLogits { position });
        }
        Ok(words[0])
    }
}

#[cfg(test)]
mod tests {
    use super::Logits;

    #[test]
    fn rows_outside_the_data_are_none_not_a_panic() {
        let l = Logits { rows: 2, vocab: 3, data: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0] };
        assert_eq!(l.row(0), Some(&[1.0, 2.0, 3.0][..]));
        assert_eq!(l.last(), Some(&[4.0, 5.0, 6.0][..]));
        assert_eq!(l.row(2), None);
        // Fields edited by hand: fewer values than rows · vocab, no rows, an overflowing width.
        let short = Logits { rows: 2, vocab: 3, data: vec![0.0; 4] };
        assert_eq!((short.row(0).map(<[f32]>::len), short.row(1), short.last()), (Some(3), None, None));
        assert_eq!(Logits { rows: 0, vocab: 3, data: vec![] }.last(), None);
        assert_eq!(Logits { rows: 3, vocab: usize::MAX, data: vec![0.0; 4] }.row(2), None);
    }
}
