//! Batched decode: one token of each of several sessions in one step, every session with its
//! own adapter set. The projections run once for all rows (M = N: every weight is read once for
//! the N tokens); the mixers' cores (GDN conv, delta rule and gated norm; attention over the KV
//! cache) run per session on its own states, at its own position. Each row's LoRA comes from one
//! stack of every adapter any row applies, with a scale table of one row per session: a row's
//! factors are 0 on the ranks of adapters its set does not hold (the BGMV idea: one shrink and
//! one fused expand for all rows, each row its own adapters).

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::error::{AdapterError, GpuError, RunError};
use crate::gpu::{read_f32_via, GpuContext, GpuWeight, IoBindCache, Profile, Recorder, Staging};
use crate::kernels::attention::{attention_one, AttnOneIo, AttnParams};
use crate::kernels::gdn::{gated_delta, gdn_step, gdn_step_rows, GdnIo, GdnParams, GdnStepIo, GDN_MAX_ROWS};
use crate::kernels::matmul::{batched_matvec_takes, LinearIo, WeightRows};
use crate::kernels::misc::{argmax_rows, argmax_scratch_bytes, embed, topk_max};
use crate::kernels::norm::{rms_norm, rms_norm_gated, NormIo};
use crate::lora::{InputGroup, LoraAdapter, Proj};
use crate::model::{AttnWeights, GdnWeights, LayerType, Mixer, Model, TextConfig};
use crate::runtime::adapters::{stack_tables, table_base, ActiveAdapter, BoundSet};
use crate::runtime::cache::{gdn_state_bytes, LayerState, Scratch};
use crate::runtime::forward::{
    attn_params, block_input, gdn_params, gdn_step_fits, lm_head, mixer_out, mlp_block, norm_rows, project, LayerLora,
    NextReads, NextWrites, Parts, Shrunk, Src, ATTN_IN, GDN_IN,
};
use crate::runtime::sampler::Sampler;
use crate::runtime::session::{Logits, SampleRead, Session};
use crate::runtime::GenerateParams;

/// Most sessions one batched step takes.
pub const MAX_BATCH_SESSIONS: usize = 64;

/// One row's adapters as the scale table sees them: (adapter address, scale bits, factors).
type RowKey = Vec<(usize, u32, crate::lora::LayerScales)>;

/// The LoRA of a batch: the stack of every adapter the rows apply and the rows' scale tables.
struct BatchLora {
    key: Vec<RowKey>,
    sources: Vec<Arc<LoraAdapter>>,
    bound: BoundSet,
}

/// What batched steps reuse: scratch for `rows` tokens, the ids and logits buffers, the bind
/// groups, the LoRA stack and tables of the last set of rows.
pub struct Batch {
    model: Arc<Model>,
    rows: usize,
    scratch: Scratch,
    ids: wgpu::Buffer,
    logits: wgpu::Buffer,
    staging: Staging,
    /// Greedy steps: the rows' block candidates, their (id, non-finite flag) pairs and the two
    /// stagings those come back through (8 bytes a row; one per step in flight).
    argmax_parts: wgpu::Buffer,
    chosen: wgpu::Buffer,
    chosen_staging: [Staging; 2],
    io: IoBindCache,
    lora: Option<BatchLora>,
    /// The LoRA t buffer (shrinks and scale tables), kept across stacks and steps without
    /// adapters, grown when a stack's tables need more (the cached bind groups are then dropped).
    lora_t: Option<wgpu::Buffer>,
    /// Greedy steps submit the next step before reading the current one's ids.
    run_ahead: bool,
    /// Timestamps of every dispatch while profiling (`Batch::start_profile`).
    profile: Option<Profile>,
    /// The GDN states of `generate`'s sessions side by side, allocated by the first generation
    /// of several sessions and grown for more (`GdnPool`, `Batch::pool_in`).
    pool: Option<GdnPool>,
}

/// The GDN states of a batched generation's sessions side by side (slot = the session's index
/// in the call), so one `gdn_decode` dispatch steps a layer of every row (a workgroup per value
/// head and row) instead of one dispatch per session: a batched step's per-session mixer
/// dispatches are the part that does not shrink with batching (on a GPU each is Hv workgroups,
/// 16 at the 0.8B dims, far too few to fill the device). `Batch::generate` copies each session's
/// conv and recurrent states into its slot before the first step and back after the last; the
/// steps ping-pong between the two parities, a row's state after j committed steps in parity
/// j % 2 (the rows of a step all committed as many: a row leaves the batch for good). A step
/// that is not committed (run-ahead past a row's end) wrote the other parity, as a session's own
/// step does. Holds 2 · slots states: 38 MiB per slot at the 0.8B dims.
struct GdnPool {
    slots: usize,
    /// Each slot's session position when its states were copied in.
    start: Vec<usize>,
    /// Per layer: conv histories and recurrent states, two parities each; `None` for attention.
    layers: Vec<Option<GdnPair>>,
}

/// (conv histories, recurrent states) of a pooled GDN layer, two parities each.
type GdnPair = ([wgpu::Buffer; 2], [wgpu::Buffer; 2]);

/// A step's rows in the pool: row r is slot `slots[r]`, at parity `parity`.
#[derive(Clone, Copy)]
struct PoolRows<'a> {
    pool: &'a GdnPool,
    slots: &'a [usize],
    parity: usize,
}

impl GdnPool {
    fn new(ctx: &GpuContext, c: &TextConfig, slots: usize) -> Result<Self, GpuError> {
        let (conv, state) = gdn_state_bytes(c);
        let layers = c
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, ty)| {
                if !matches!(ty, LayerType::Linear) {
                    return Ok(None);
                }
                let buf = |what: &str, p: usize, bytes: u64| {
                    ctx.storage_buffer(&format!("batch pool layers.{i}.{what}[{p}]"), bytes * slots as u64, true)
                };
                let convs = [buf("conv_state", 0, conv)?, buf("conv_state", 1, conv)?];
                let states = [buf("recurrent_state", 0, state)?, buf("recurrent_state", 1, state)?];
                Ok(Some((convs, states)))
            })
            .collect::<Result<_, GpuError>>()?;
        Ok(Self { slots, start: Vec::new(), layers })
    }

    /// Copy session `i`'s states into slot `i` of parity 0 (`into`, noting its position) or
    /// slot `i`'s states at the parity of its committed steps since then back into the session.
    fn copy(&mut self, ctx: &GpuContext, c: &TextConfig, sessions: &[&mut Session], into: bool) {
        if into {
            self.start = sessions.iter().map(|s| s.pos).collect();
        }
        let start = &self.start;
        let (conv_bytes, state_bytes) = gdn_state_bytes(c);
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("batch pool") });
        for (layer, pooled) in self.layers.iter().enumerate() {
            let Some((pc, ps)) = pooled else { continue };
            for (i, s) in sessions.iter().enumerate() {
                let LayerState::Gdn { conv, state } = &s.states[layer] else { continue };
                let at = (s.pos - start[i]) % 2;
                for (own, pool, bytes) in [(&conv[s.parity], pc, conv_bytes), (&state[s.parity], ps, state_bytes)] {
                    let slot = i as u64 * bytes;
                    if into {
                        enc.copy_buffer_to_buffer(own, 0, &pool[0], slot, bytes);
                    } else {
                        enc.copy_buffer_to_buffer(&pool[at], slot, own, 0, bytes);
                    }
                }
            }
        }
        ctx.submit(enc.finish(), 0);
    }
}

/// Where a batched step's token ids come from.
#[derive(Clone, Copy)]
enum StepIds<'a> {
    /// From the host, one per row.
    Host(&'a [u32]),
    /// Row `r`'s id is the one the previous greedy step chose in its row `rows[r]` (still on
    /// the GPU).
    Chosen(&'a [usize]),
}

/// What a sampled batched step gives `generate`: every row's logits, or every row's sampling
/// candidates found on the GPU.
enum StepOut {
    Logits(Logits),
    /// Per row: what its candidate pass left (a row with a NaN or an infinity is an error).
    Sampled(Vec<SampleRead>),
}

/// What a batched step ends with after the logits.
#[derive(Clone, Copy)]
enum Head<'a> {
    /// Nothing: the caller reads the logits.
    Logits,
    /// Every row's greedy choice and non-finite flag, copied into chosen staging `slot`.
    Choose { slot: usize },
    /// Every row's candidate pass (`Session::submit_sample`'s, with `k` candidates, the row's
    /// distinct history ids `hists[row]` and `mass`) into its session's sample buffers.
    Sample { k: usize, hists: &'a [Vec<u32>], mass: Option<f32> },
}

impl Batch {
    /// Buffers for steps of up to `rows` sessions of `model`.
    pub fn new(model: Arc<Model>, rows: usize) -> Result<Self, RunError> {
        if rows == 0 || rows > MAX_BATCH_SESSIONS {
            return Err(RunError::BadParam {
                name: "rows",
                value: rows.to_string(),
                expected: "1 to 64 sessions (MAX_BATCH_SESSIONS)",
            });
        }
        let ctx = model.ctx.clone();
        let c = &model.config;
        let scratch = Scratch::new(&ctx, c, rows, rows)?;
        let ids = ctx.storage_buffer("batch ids", (rows * 4) as u64, true)?;
        let logits = ctx.storage_buffer("batch logits", (rows * c.vocab_size * 4) as u64, true)?;
        let staging = Staging::new(&ctx, "batch logits readback", (rows * c.vocab_size * 4) as u64);
        let argmax_parts =
            ctx.storage_buffer("batch argmax parts", rows as u64 * argmax_scratch_bytes(c.vocab_size), true)?;
        let chosen = ctx.storage_buffer("batch chosen ids", (rows * 8) as u64, true)?;
        let chosen_staging = [0, 1].map(|_| Staging::new(&ctx, "batch chosen readback", (rows * 8) as u64));
        let params = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("batch uniform arena"),
            size: 512 * 256,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Ok(Self {
            model,
            rows,
            scratch,
            ids,
            logits,
            staging,
            argmax_parts,
            chosen,
            chosen_staging,
            io: IoBindCache::new(params),
            lora: None,
            lora_t: None,
            run_ahead: !ctx.is_cpu(),
            profile: None,
            pool: None,
        })
    }

    /// Greedy batches submit step t + 1 (its ids are step t's choices, still on the GPU) before
    /// reading step t's ids, so the device does not wait for the host; a row that turns out
    /// finished (EOS, its last token, its context full) does not commit it, so every session
    /// holds exactly the tokens returned. On by default on GPUs, off on CPU adapters (where the
    /// host and the "device" share the cores), as [`Session::set_run_ahead`].
    pub fn set_run_ahead(&mut self, on: bool) {
        self.run_ahead = on;
    }

    /// See [`Batch::set_run_ahead`].
    pub fn run_ahead(&self) -> bool {
        self.run_ahead
    }

    /// Time every dispatch of the following steps on the GPU (one list per submit) until
    /// [`Batch::take_profile`], as [`Session::start_profile`]; returns whether the device has
    /// timestamps. Profiled steps wait for their timings, so they are slower than plain ones.
    pub fn start_profile(&mut self) -> bool {
        self.profile = Profile::if_timed(&self.model.ctx);
        self.profile.is_some()
    }

    /// Stop profiling and return what was timed.
    pub fn take_profile(&mut self) -> Option<Profile> {
        self.profile.take()
    }

    /// How many bind groups the batch keeps (they are built once per kernel and buffer set).
    pub fn cached_bind_groups(&self) -> usize {
        self.io.cached_groups()
    }

    /// Forget the stack of the last rows (its adapters changed: a learning step, a removal).
    pub fn forget_stack(&mut self) {
        self.lora = None;
    }

    /// Whether the kept stack holds `adapter`.
    pub fn holds(&self, adapter: &Arc<LoraAdapter>) -> bool {
        self.lora.as_ref().is_some_and(|l| l.sources.iter().any(|s| Arc::ptr_eq(s, adapter)))
    }

    /// What a step of `sessions` needs that does not depend on their tokens: a row each, the
    /// batch's model, at most `MAX_SET` distinct adapters over all rows.
    fn check_rows(&self, sessions: &[&mut Session]) -> Result<(), RunError> {
        let n = sessions.len();
        if n == 0 || n > self.rows {
            return Err(RunError::BadParam {
                name: "sessions",
                value: format!("{n} sessions"),
                expected: "1 to the batch's rows",
            });
        }
        if sessions.iter().any(|s| !Arc::ptr_eq(&s.model, &self.model)) {
            return Err(RunError::BadParam {
                name: "sessions",
                value: "a session of another model".into(),
                expected: "sessions of the batch's model",
            });
        }
        let mut sources: Vec<&Arc<LoraAdapter>> = Vec::new();
        for a in sessions.iter().flat_map(|s| s.adapters()).filter(|a| a.scale != 0.0) {
            if !sources.iter().any(|s| Arc::ptr_eq(s, &a.adapter)) {
                sources.push(&a.adapter);
            }
        }
        if sources.len() > crate::lora::MAX_SET {
            let e = AdapterError::SetTooLarge { found: sources.len(), limit: crate::lora::MAX_SET };
            return Err(Box::new(e).into());
        }
        Ok(())
    }

    /// The most sessions one step takes.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// One token for each session (`ids[i]` for `sessions[i]`, at its position, under its own
    /// adapter set), in one step; returns every row's logits and commits the token to each
    /// session. Nothing changes on error.
    pub fn step(&mut self, sessions: &mut [&mut Session], ids: &[u32]) -> Result<Logits, RunError> {
        self.step_rows(sessions, ids, None)
    }

    /// [`Batch::step`], on the pooled states of slots `slots` where given.
    fn step_rows(
        &mut self,
        sessions: &mut [&mut Session],
        ids: &[u32],
        slots: Option<&[usize]>,
    ) -> Result<Logits, RunError> {
        self.submit(sessions, StepIds::Host(ids), Head::Logits, slots)?;
        let (ctx, n, vocab) = (&self.model.ctx, sessions.len(), self.model.config.vocab_size);
        let data = read_f32_via(ctx, &self.logits, 0, n * vocab, &self.staging)?;
        commit(sessions);
        Ok(Logits { rows: n, vocab, data })
    }

    /// What greedy step `index` chose into staging `slot` for its `rows` rows, once it has
    /// completed: per row the id and whether the row had a NaN or an infinity
    /// (`sampler::argmax`'s rule, made on the GPU: 8 bytes a row read back).
    fn read_chosen(
        &self,
        index: wgpu::SubmissionIndex,
        slot: usize,
        rows: usize,
    ) -> Result<Vec<(u32, bool)>, RunError> {
        let words = self.chosen_staging[slot].read_words(&self.model.ctx, index, 2 * rows)?;
        Ok(words.chunks_exact(2).map(|p| (p[0], p[1] != 0)).collect())
    }

    /// [`Batch::step`] returning only every row's sampling candidates (`Session::read_sample`'s,
    /// through each session's own sample buffers): the rows' logits stay in the batch's logits
    /// buffer for [`Batch::read_row`] until the next step.
    fn step_sample(
        &mut self,
        sessions: &mut [&mut Session],
        ids: &[u32],
        (k, hists, mass): (usize, &[Vec<u32>], Option<f32>),
        slots: Option<&[usize]>,
    ) -> Result<Vec<SampleRead>, RunError> {
        let index = self.submit(sessions, StepIds::Host(ids), Head::Sample { k, hists, mass }, slots)?;
        commit(sessions);
        let shape = |r: usize| (k, hists[r].len(), mass.is_some());
        sessions.iter().enumerate().map(|(r, s)| s.read_sample(index.clone(), shape(r), s.pos - 1)).collect()
    }

    /// Row `row` of the last step's logits.
    fn read_row(&self, row: usize) -> Result<Vec<f32>, RunError> {
        let vocab = self.model.config.vocab_size;
        Ok(read_f32_via(&self.model.ctx, &self.logits, row * vocab, vocab, &self.staging)?)
    }

    /// Record and submit one step of every row, ending with `head`; nothing is committed. With
    /// `slots` (during `generate` with the pool: row r's slot), the GDN layers step the pooled
    /// states.
    fn submit(
        &mut self,
        sessions: &mut [&mut Session],
        ids: StepIds,
        head: Head,
        slots: Option<&[usize]>,
    ) -> Result<wgpu::SubmissionIndex, RunError> {
        let n = sessions.len();
        let given = match ids {
            StepIds::Host(ids) => ids.len(),
            StepIds::Chosen(rows) => rows.len(),
        };
        if given != n {
            return Err(RunError::BadParam {
                name: "ids",
                value: format!("{n} sessions, {given} ids"),
                expected: "one id per session",
            });
        }
        self.check_rows(sessions)?;
        match ids {
            StepIds::Host(ids) => {
                for (s, id) in sessions.iter().zip(ids) {
                    s.check(std::slice::from_ref(id))?;
                }
            }
            // The argmax's ids are in the vocabulary; only the context is checked.
            StepIds::Chosen(rows) => {
                for s in sessions.iter() {
                    s.check(&[0])?;
                }
                if rows.iter().any(|&r| r >= self.rows) {
                    return Err(RunError::BadParam {
                        name: "ids",
                        value: format!("rows {rows:?}"),
                        expected: "rows of the previous step",
                    });
                }
            }
        }
        if let Head::Sample { hists, .. } = head {
            if hists.len() != n || sessions.iter().zip(hists).any(|(s, h)| h.len() > s.sample_history_capacity()) {
                return Err(RunError::BadParam {
                    name: "hists",
                    value: format!("{} histories for {n} sessions", hists.len()),
                    expected: "one history per session, each within its session's history buffer",
                });
            }
            for (s, h) in sessions.iter().zip(hists) {
                s.sample.write_history(s.ctx(), h);
            }
        }
        self.bind_lora(sessions)?;
        let pooled = match (slots, &self.pool) {
            (Some(slots), Some(pool)) => {
                let parity = match (sessions.first(), slots.first()) {
                    (Some(s), Some(&i)) => (s.pos - pool.start[i]) % 2,
                    _ => 0,
                };
                Some(PoolRows { pool, slots, parity })
            }
            _ => None,
        };
        let model = self.model.clone();
        let ctx = &model.ctx;
        let c = &model.config;
        let sc = &self.scratch;
        let mut rec = Recorder::new(ctx, &mut self.io).profiled(self.profile.as_mut());
        match ids {
            StepIds::Host(ids) => ctx.write(&self.ids, 0, bytemuck::cast_slice(ids)),
            StepIds::Chosen(rows) => {
                for (r, &from) in rows.iter().enumerate() {
                    rec.copy(&self.chosen, (8 * from) as u64, &self.ids, (4 * r) as u64, 4);
                }
            }
        }
        embed(&mut rec, &model.embed, &self.ids, n, &sc.hidden)?;
        for (i, layer) in model.layers.iter().enumerate() {
            let lora =
                self.lora.as_ref().zip(self.lora_t.as_ref()).map(|(l, t)| LayerLora { bound: &l.bound, t, layer: i });
            let mixer_w = match &layer.mixer {
                Mixer::Gdn(w) => &w.in_proj,
                Mixer::Attention(w) => &w.qkv,
            };
            let mixer_in = block_input(
                &mut rec,
                c,
                sc,
                &layer.input_norm,
                folds(mixer_w, n),
                lora,
                (InputGroup::MixerIn, NextReads::default()),
                n,
            )?;
            match &layer.mixer {
                Mixer::Gdn(w) => gdn_rows(&mut rec, c, sc, w, (sessions, pooled), i, mixer_in, lora)?,
                Mixer::Attention(w) => attention_rows(&mut rec, c, sc, w, sessions, i, mixer_in, lora)?,
            }
            let mlp_in = block_input(
                &mut rec,
                c,
                sc,
                &layer.post_norm,
                folds(&layer.mlp.gate_up, n),
                lora,
                (InputGroup::MlpIn, NextReads::default()),
                n,
            )?;
            mlp_block(&mut rec, c, sc, &layer.mlp, mlp_in, (lora, NextWrites::default()), n)?;
        }
        let head_src = if folds(model.output(), n) {
            Src::normed(&sc.hidden, &model.norm.buffer, c.rms_norm_eps, None)
        } else {
            rms_norm(&mut rec, &model.norm, &norm_rows(sc, c, 0, n))?;
            Src::plain(&sc.xnorm)
        };
        lm_head(&mut rec, &model, head_src, &self.logits, 0, n)?;
        match head {
            Head::Logits => {}
            Head::Choose { slot } => {
                argmax_rows(&mut rec, &self.logits, &self.argmax_parts, &self.chosen, (c.vocab_size, n))?;
                rec.copy(&self.chosen, 0, self.chosen_staging[slot].buffer(), 0, (8 * n) as u64);
            }
            Head::Sample { k, hists, mass } => {
                // The rows' non-finite flags before the masks; then each row's candidate pass on
                // a copy of its logits in its session's logits buffer (the mask overwrites it).
                argmax_rows(&mut rec, &self.logits, &self.argmax_parts, &self.chosen, (c.vocab_size, n))?;
                let row = (c.vocab_size * 4) as u64;
                for (r, s) in sessions.iter().enumerate() {
                    rec.copy(&self.logits, r as u64 * row, &s.logits, 0, row);
                    let flag = (&self.chosen, (8 * r + 4) as u64);
                    s.sample.record(&mut rec, &s.logits, flag, c.vocab_size, (k, hists[r].len(), mass))?;
                }
            }
        }
        Ok(rec.submit()?)
    }

    /// Continue every session with its prompt and generate up to `params.max_tokens` tokens for
    /// each, decoding the sessions together: each prompt is prefilled on its own session but
    /// its last token, then every step decodes one token of every session not yet finished (EOS
    /// with `stop_at_eos`, or `max_tokens`; a session whose context fills stops there too, with
    /// what it has, where [`Session::generate`] would return `ContextFull`: the other sessions
    /// go on). Plain greedy decoding chooses on the GPU with `sampler::argmax`'s rule (ties,
    /// NaN) and reads back 8 bytes a row; sampling reads back what [`Session::generate`] does
    /// alone: each row's candidates from a top-k pass on the GPU (in its session's sample
    /// buffers), and the whole row only where they cannot decide or the settings need every
    /// logit. Each session draws with its own [`Sampler`].
    /// `fed[i]` tokens of `prompts[i]` are already in session `i` (a prompt cache's reuse; 0
    /// without one). One session runs its own generation, which is faster than a batched step
    /// of one row (the same tokens; see `generate_alone`). Several sessions step their GDN
    /// layers together on the batch's pool of their states (`GdnPool`), which the first such
    /// call allocates for its sessions (rounded up to a power of two) and the batch keeps: two
    /// copies of each slot's GDN states (38 MiB a slot at the 0.8B dims); where it cannot be
    /// allocated, each session steps on its own states.
    pub fn generate(
        &mut self,
        sessions: &mut [&mut Session],
        prompts: &[&[u32]],
        fed: &[usize],
        params: &GenerateParams,
    ) -> Result<Vec<Vec<u32>>, RunError> {
        let n = sessions.len();
        self.check_rows(sessions)?;
        if prompts.len() != n || fed.len() != n {
            return Err(RunError::BadParam {
                name: "prompts",
                value: format!("{n} sessions, {} prompts, {} fed counts", prompts.len(), fed.len()),
                expected: "one prompt and one fed count per session",
            });
        }
        let mut samplers = Vec::with_capacity(n);
        for (i, s) in sessions.iter().enumerate() {
            if fed[i] >= prompts[i].len() || fed[i] > s.pos {
                return Err(RunError::BadParam {
                    name: "fed",
                    value: format!("{} of a {}-token prompt", fed[i], prompts[i].len()),
                    expected: "fewer tokens than the prompt has, all of them in the session",
                });
            }
            // The held ids too: the whole prompt is the row's sampler history.
            s.check_at(prompts[i], s.pos - fed[i])?;
            samplers.push(Sampler::from_params(params)?);
        }
        if params.max_tokens == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        if let [only] = sessions {
            return Ok(vec![self.generate_alone(only, prompts[0], fed[0], params)?]);
        }
        let mut next: Vec<u32> = Vec::with_capacity(n);
        for (i, s) in sessions.iter_mut().enumerate() {
            let rest = &prompts[i][fed[i]..];
            if rest.len() > 1 {
                s.prefill(&rest[..rest.len() - 1])?;
            }
            next.push(rest[rest.len() - 1]);
        }
        // The rows' GDN states go into the pool for the steps and back after them, also when a
        // step fails (the sessions keep the tokens committed so far).
        let pooled = self.pool_in(sessions);
        // Plain greedy rows (the same params for every row) are chosen on the GPU; sampled rows
        // draw from candidates found on the GPU where the settings allow (`generate`'s rule).
        let out = if samplers.first().is_some_and(Sampler::is_plain_greedy) {
            self.generate_greedy(sessions, &next, params, pooled)
        } else {
            self.generate_sampled(sessions, prompts, next, samplers, params, pooled)
        };
        if pooled {
            self.pool_out(sessions);
        }
        out
    }

    /// Copy the sessions' GDN states into the pool (allocated or grown for them), where their
    /// layers' steps fit one `gdn_decode` dispatch and the pool fits the device; whether it did.
    fn pool_in(&mut self, sessions: &[&mut Session]) -> bool {
        let (ctx, c) = (&self.model.ctx, &self.model.config);
        if !gdn_step_fits(c) || sessions.len() > GDN_MAX_ROWS {
            return false;
        }
        if self.pool.as_ref().is_none_or(|p| p.slots < sessions.len()) {
            // The old pool goes first (with the cached bind groups, which hold its buffers), so
            // only the larger one is held; sized to a power of two, within the batch's rows, so
            // that batches growing one session at a time reallocate it a few times only.
            self.io.forget_groups();
            self.pool = None;
            let slots = sessions.len().next_power_of_two().min(self.rows);
            self.pool = GdnPool::new(ctx, c, slots).ok();
        }
        match &mut self.pool {
            Some(pool) => {
                pool.copy(ctx, c, sessions, true);
                true
            }
            None => false,
        }
    }

    /// Copy the pooled GDN states back into the sessions.
    fn pool_out(&mut self, sessions: &[&mut Session]) {
        if let Some(pool) = &mut self.pool {
            pool.copy(&self.model.ctx, &self.model.config, sessions, false);
        }
    }

    /// [`Batch::generate`]'s sampled decoding from the rows' last prompt tokens `next`.
    fn generate_sampled(
        &mut self,
        sessions: &mut [&mut Session],
        prompts: &[&[u32]],
        mut next: Vec<u32>,
        mut samplers: Vec<Sampler>,
        params: &GenerateParams,
        pooled: bool,
    ) -> Result<Vec<Vec<u32>>, RunError> {
        let n = sessions.len();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); n];
        let mut history: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
        let eos = self.model.eos_token_ids.clone();
        let vocab = self.model.config.vocab_size;
        let candidates = samplers.first().and_then(|s| s.gpu_candidates(vocab, topk_max(vocab)));
        let mass = samplers.first().and_then(Sampler::needs_mass);
        // Per row, the distinct ids a repetition penalty sees (empty without one).
        let mut distinct: Vec<BTreeSet<u32>> = prompts
            .iter()
            .zip(&samplers)
            .map(|(p, s)| if s.penalizes() { p.iter().copied().collect() } else { BTreeSet::new() })
            .collect();
        let mut live: Vec<usize> = (0..n).collect();
        while !live.is_empty() {
            let step = {
                let slots = pooled.then_some(live.as_slice());
                let mut rows = pick(sessions, &live);
                let ids: Vec<u32> = live.iter().map(|&i| next[i]).collect();
                if let Some(k) = candidates {
                    let hists: Vec<Vec<u32>> = live.iter().map(|&i| distinct[i].iter().copied().collect()).collect();
                    StepOut::Sampled(self.step_sample(&mut rows, &ids, (k, &hists, mass), slots)?)
                } else {
                    StepOut::Logits(self.step_rows(&mut rows, &ids, slots)?)
                }
            };
            let mut still = Vec::with_capacity(live.len());
            for (r, &i) in live.iter().enumerate() {
                let (id, finite) = match &step {
                    StepOut::Logits(logits) => {
                        let row = logits.row(r);
                        let finite = row.iter().all(|l| l.is_finite());
                        (if finite { samplers[i].sample_after(row, &history[i])? } else { 0 }, finite)
                    }
                    StepOut::Sampled(reads) => {
                        let read = &reads[r];
                        let hist: Vec<(u32, f32)> =
                            distinct[i].iter().copied().zip(read.hist.iter().copied()).collect();
                        let id = match samplers[i].sample_candidates(&read.cands, &hist, vocab, &read.masses) {
                            Some(id) => id,
                            // The candidates cannot decide: the whole row (unmasked in the batch's buffer).
                            None => samplers[i].sample_after(&self.read_row(r)?, &history[i])?,
                        };
                        (id, true)
                    }
                };
                if samplers[i].penalizes() {
                    distinct[i].insert(id);
                }
                if !finite {
                    return Err(RunError::NonFiniteLogits { position: sessions[i].pos - 1 });
                }
                history[i].push(id);
                out[i].push(id);
                next[i] = id;
                let done = (params.stop_at_eos && eos.contains(&id)) || out[i].len() >= params.max_tokens;
                if !done && sessions[i].pos < sessions[i].opts.max_context {
                    still.push(i);
                }
            }
            live = still;
        }
        Ok(out)
    }

    /// [`Batch::generate`] for one session: its own generation, whose single-token steps fold
    /// the block norms into the projections (the batched step runs them as dispatches of their
    /// own), under the batch's run-ahead and profile, and stopped where the batch stops a row
    /// whose context is full (alone that is `ContextFull`). The checks are the caller's.
    fn generate_alone(
        &mut self,
        s: &mut Session,
        prompt: &[u32],
        fed: usize,
        params: &GenerateParams,
    ) -> Result<Vec<u32>, RunError> {
        // The prompt ends at position `end`; each token but the last one returned takes one more.
        let end = s.pos + (prompt.len() - fed);
        let room = (s.opts.max_context + 1).saturating_sub(end);
        let params = GenerateParams { max_tokens: params.max_tokens.min(room), ..params.clone() };
        let own = (s.run_ahead, s.profile.take());
        s.run_ahead = self.run_ahead;
        s.profile = self.profile.take();
        let out = s.generate_from_with(prompt, fed, &params, |_, _| Ok::<_, RunError>(true));
        self.profile = s.profile.take();
        (s.run_ahead, s.profile) = own;
        out
    }

    /// [`Batch::generate`]'s plain greedy decoding from the rows' last prompt tokens `first`:
    /// every step's choices made on the GPU, and with run-ahead step t + 1 (its ids taken from
    /// step t's choices on the GPU) submitted before step t's ids are read. Every step is
    /// committed to a row only once the row's previous token is known not to end it.
    fn generate_greedy(
        &mut self,
        sessions: &mut [&mut Session],
        first: &[u32],
        params: &GenerateParams,
        pooled: bool,
    ) -> Result<Vec<Vec<u32>>, RunError> {
        let eos = self.model.eos_token_ids.clone();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); sessions.len()];
        // The step in flight: its submission, staging slot and rows (session indices in row
        // order, ascending), of which `live` (the rows whose token counts) are committed.
        let mut live: Vec<usize> = (0..sessions.len()).collect();
        let mut slot = 0;
        let mut staged = live.clone();
        let ids = StepIds::Host(first);
        let mut index =
            self.submit(&mut pick(sessions, &live), ids, Head::Choose { slot }, pooled.then_some(live.as_slice()))?;
        commit_rows(sessions, &live);
        loop {
            // Rows whose token of this step is not their last run ahead on it.
            let (from, ahead_rows): (Vec<usize>, Vec<usize>) = staged
                .iter()
                .copied()
                .enumerate()
                .filter(|&(_, i)| live.contains(&i))
                .filter(|&(_, i)| {
                    out[i].len() + 1 < params.max_tokens && sessions[i].pos < sessions[i].opts.max_context
                })
                .unzip();
            let ahead = if self.run_ahead && !ahead_rows.is_empty() {
                let mut rows = pick(sessions, &ahead_rows);
                let head = Head::Choose { slot: 1 - slot };
                Some(self.submit(&mut rows, StepIds::Chosen(&from), head, pooled.then_some(ahead_rows.as_slice()))?)
            } else {
                None
            };
            let chosen = self.read_chosen(index, slot, staged.len())?;
            let mut still = Vec::with_capacity(live.len());
            let mut next = Vec::with_capacity(live.len());
            for (r, &i) in staged.iter().enumerate().filter(|(_, i)| live.contains(i)) {
                let (id, non_finite) = chosen[r];
                if non_finite {
                    return Err(RunError::NonFiniteLogits { position: sessions[i].pos - 1 });
                }
                out[i].push(id);
                let done = (params.stop_at_eos && eos.contains(&id)) || out[i].len() >= params.max_tokens;
                if !done && sessions[i].pos < sessions[i].opts.max_context {
                    still.push(i);
                    next.push(id);
                }
            }
            if still.is_empty() {
                return Ok(out);
            }
            slot = 1 - slot;
            match ahead {
                // Every row that goes on ran ahead (a row that did not had its last token).
                Some(ahead_index) if still.iter().all(|i| ahead_rows.contains(i)) => {
                    index = ahead_index;
                    staged = ahead_rows;
                }
                _ => {
                    let ids = StepIds::Host(&next);
                    index = self.submit(
                        &mut pick(sessions, &still),
                        ids,
                        Head::Choose { slot },
                        pooled.then_some(still.as_slice()),
                    )?;
                    staged = still.clone();
                }
            }
            commit_rows(sessions, &still);
            live = still;
        }
    }

    /// The stack and scale tables for the sets of `sessions` (row `r` = session `r`), reused
    /// while the rows' sets stay the same; `None` when no row applies an adapter.
    fn bind_lora(&mut self, sessions: &[&mut Session]) -> Result<(), RunError> {
        let live =
            |s: &Session| -> Vec<ActiveAdapter> { s.adapters().iter().filter(|a| a.scale != 0.0).cloned().collect() };
        let sets: Vec<Vec<ActiveAdapter>> = sessions.iter().map(|s| live(s)).collect();
        let key: Vec<RowKey> = sets
            .iter()
            .map(|set| {
                set.iter().map(|a| (Arc::as_ptr(&a.adapter) as usize, a.scale.to_bits(), a.layers.clone())).collect()
            })
            .collect();
        if self.lora.as_ref().is_some_and(|l| l.key == key) {
            return Ok(());
        }
        let mut sources: Vec<Arc<LoraAdapter>> = Vec::new();
        for a in sets.iter().flatten() {
            if !sources.iter().any(|s| Arc::ptr_eq(s, &a.adapter)) {
                sources.push(a.adapter.clone());
            }
        }
        if sources.is_empty() {
            self.lora = None;
            return Ok(());
        }
        // The kept stack serves any rows whose adapters it holds (a row that finished, or a
        // session that left, only zeroes factors): no rebuild in the middle of a generation.
        let kept = self
            .lora
            .as_ref()
            .filter(|l| sources.iter().all(|s| l.sources.iter().any(|k| Arc::ptr_eq(k, s))))
            .map(|l| (l.sources.clone(), l.bound.lora.clone()));
        let (sources, stack) = match (kept, sources.as_slice()) {
            (Some(kept), _) => kept,
            (None, [one]) => (sources.clone(), one.clone()),
            (None, _) => {
                let stack = Arc::new(LoraAdapter::stack(&self.model, &sources).map_err(Box::new)?);
                (sources, stack)
            }
        };
        let layers = self.model.config.num_layers();
        let base = table_base(self.rows, &stack);
        let rows: Vec<Vec<&ActiveAdapter>> = sets.iter().map(|s| s.iter().collect()).collect();
        let row_refs: Vec<&[&ActiveAdapter]> = rows.iter().map(|r| r.as_slice()).collect();
        let (table, tables) = stack_tables(&stack, &sources, &row_refs, base, layers);
        let ctx = &self.model.ctx;
        let bytes = ((base + table.len()) * 4) as u64;
        let t = match self.lora_t.as_ref().filter(|t| t.size() >= bytes) {
            Some(t) => t.clone(),
            None => {
                let t = ctx.storage_buffer("batch lora t", bytes, true)?;
                // The cached bind groups hold the old buffer alive: rebuild them on use.
                self.io.forget_groups();
                self.lora_t = Some(t.clone());
                t
            }
        };
        ctx.write(&t, (base * 4) as u64, bytemuck::cast_slice(&table));
        let bound = BoundSet { lora: stack, seg_scale: vec![[1.0; 12]; layers], tables };
        self.lora = Some(BatchLora { key, sources, bound });
        Ok(())
    }
}

/// A GDN layer for every row: the input projections for all rows (row k of `mixer_in` is
/// session k's qkv|z|b|a), then the fused step of every row in one dispatch on the pooled states
/// (`pooled`), else per session on its own states, reading its row and writing its output row of
/// `mid_b`, then out_proj for all rows. Where the fused step does not fit
/// (wide heads), each row is copied into the session's scratch for the unfused kernels and back.
#[allow(clippy::too_many_arguments)]
fn gdn_rows(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &GdnWeights,
    (sessions, pooled): (&[&mut Session], Option<PoolRows>),
    layer: usize,
    (src, s): (Src, Option<Shrunk>),
    lora: Option<LayerLora>,
) -> Result<(), GpuError> {
    let n = sessions.len();
    let (cd, vd, hv) = (c.conv_dim(), c.value_dim(), c.linear_value_heads);
    let width = cd + vd + 2 * hv;
    project_rows(rec, c, Parts { w: &w.in_proj, order: &GDN_IN, parts: 0..GDN_IN.len() }, &sc.mixer_in, n, (src, &s))?;
    let params = gdn_params(c, 1);
    if let Some(PoolRows { pool, slots, parity }) = pooled {
        let Some((conv, state)) = &pool.layers[layer] else {
            return Err(mismatch(layer));
        };
        let params = params.with_slots(slots).ok_or_else(|| GpuError::Validation {
            during: format!("layer {layer}"),
            message: format!("pooled slots {slots:?} (expected at most {GDN_MAX_ROWS} rows, each slot below 256)"),
        })?;
        let io = GdnStepIo {
            mixed: &sc.mixer_in,
            conv_in: &conv[parity],
            conv_out: &conv[1 - parity],
            state_in: &state[parity],
            state_out: &state[1 - parity],
            core: &sc.mid_b,
        };
        gdn_step_rows(rec, &w.step_params, &params, &io, n)?;
        return mixer_out(rec, c, sc, (&w.out_proj, Proj::OutProj), lora, n, (None, NextWrites::default()));
    }
    let f = |e: usize| (e * 4) as u64;
    for (k, sess) in sessions.iter().enumerate() {
        let LayerState::Gdn { conv, state } = &sess.states[layer] else {
            return Err(mismatch(layer));
        };
        let (from, to) = (sess.parity, 1 - sess.parity);
        let row = k * width;
        if gdn_step_fits(c) {
            let io = GdnStepIo {
                mixed: &sc.mixer_in,
                conv_in: &conv[from],
                conv_out: &conv[to],
                state_in: &state[from],
                state_out: &state[to],
                core: &sc.mid_b,
            };
            let params = GdnParams { mixed_at: row as u32, core_at: (k * vd) as u32, ..params };
            gdn_step(rec, &w.step_params, &params, &io, None)?;
        } else {
            let own = &sess.scratch;
            let m = &sc.mixer_in;
            rec.copy(m, f(row), &own.wide_a, 0, f(cd));
            rec.copy(m, f(row + cd), &own.mid_a, 0, f(vd));
            rec.copy(m, f(row + cd + vd), &own.beta, 0, f(hv));
            rec.copy(m, f(row + cd + vd + hv), &own.decay, 0, f(hv));
            let io = GdnIo {
                mixed: &own.wide_a,
                conv_y: &own.wide_b,
                conv_in: &conv[from],
                conv_out: &conv[to],
                b: &own.beta,
                a: &own.decay,
                core: &own.mid_b,
                state_in: &state[from],
                state_out: &state[to],
            };
            gated_delta(rec, &w.conv_w, &w.gate_p, &params, &io)?;
            let norm = NormIo {
                x: &own.mid_a,
                y: &own.mid_b,
                x_offset: 0,
                y_offset: 0,
                rows: hv,
                n: c.linear_value_dim,
                eps: c.rms_norm_eps,
            };
            rms_norm_gated(rec, &w.norm, &norm)?;
            rec.copy(&own.mid_b, 0, &sc.mid_b, f(k * vd), f(vd));
        }
    }
    mixer_out(rec, c, sc, (&w.out_proj, Proj::OutProj), lora, n, (None, NextWrites::default()))
}

/// An attention layer for every row: q|gate, k and v for all rows (row k of `mixer_in` is
/// session k's q|gate|k|v), then per session its row through q/k norm, RoPE at its position, its
/// KV cache and attention into its output row of `mid_b`, then o_proj for all rows.
#[allow(clippy::too_many_arguments)]
fn attention_rows(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &AttnWeights,
    sessions: &[&mut Session],
    layer: usize,
    (src, s): (Src, Option<Shrunk>),
    lora: Option<LayerLora>,
) -> Result<(), GpuError> {
    let n = sessions.len();
    let (q_out, kv, attn) = (2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_heads * c.head_dim);
    let width = q_out + 2 * kv;
    project_rows(rec, c, Parts { w: &w.qkv, order: &ATTN_IN, parts: 0..ATTN_IN.len() }, &sc.mixer_in, n, (src, &s))?;
    for (k, sess) in sessions.iter().enumerate() {
        let LayerState::Attention { k: k_cache, v: v_cache } = &sess.states[layer] else {
            return Err(mismatch(layer));
        };
        let row = k * width;
        let params = AttnParams {
            q_offset: row as u32,
            out_offset: (k * attn) as u32,
            ..attn_params(c, (1, sess.pos, sess.opts.max_context), (row + q_out, row + q_out + kv))
        };
        let io =
            AttnOneIo { qkv: &sc.mixer_in, k_cache, v_cache, rope: &sess.rope, out: &sc.mid_b, part: &sc.attn_part };
        attention_one(rec, &w.qk_norm, &params, &io, None)?;
    }
    mixer_out(rec, c, sc, (&w.o_proj, Proj::OProj), lora, n, (None, NextWrites::default()))
}

/// A batched step's input projections (`parts`, consecutive projections of one weight) for the
/// `n` rows, each row's outputs side by side in `y` (row k from element k times their total):
/// one dispatch where the kernel takes their LoRA segments together (no adapter on them, one row:
/// the single-token matvec, or the batched matvec's 2 to 8 rows), else (the tiled matmul's one
/// segment: 9 rows and more, or affine weights) one dispatch per projection into its columns.
fn project_rows(
    rec: &mut Recorder,
    c: &TextConfig,
    parts: Parts,
    y: &wgpu::Buffer,
    n: usize,
    (src, s): (Src, &Option<Shrunk>),
) -> Result<(), GpuError> {
    let dims = |i: usize| parts.order[i].dims(c).1;
    let width: usize = parts.parts.clone().map(dims).sum();
    let io = src.io(y, n, width);
    if s.is_none() || n == 1 || batched_matvec_takes(&parts.rows(c), n, src.offset) {
        return project(rec, c, parts, &io, src, s);
    }
    let mut at = 0;
    for i in parts.parts.clone() {
        let one = Parts { parts: i..i + 1, ..parts };
        project(rec, c, one, &LinearIo { y_offset: at, ..io }, src, s)?;
        at += dims(i);
    }
    Ok(())
}

/// Whether a batched step of `n` rows folds a block's RMSNorm1p into the projections over `w`
/// that read it and into their LoRA shrink (no norm dispatch): one row runs the single-token
/// matvec, 2 to 8 the batched matvec, both of which fuse it; the tiled matmul does not.
fn folds(w: &GpuWeight, n: usize) -> bool {
    n == 1 || batched_matvec_takes(&WeightRows::all(w), n, 0)
}

/// Every row's session takes the step's token.
fn commit(sessions: &mut [&mut Session]) {
    for s in sessions.iter_mut() {
        s.commit(1);
    }
}

/// Commit one token to the sessions at `rows`.
fn commit_rows(sessions: &mut [&mut Session], rows: &[usize]) {
    for &i in rows {
        sessions[i].commit(1);
    }
}

/// The sessions at `rows` (ascending), in that order.
fn pick<'s>(sessions: &'s mut [&mut Session], rows: &[usize]) -> Vec<&'s mut Session> {
    sessions.iter_mut().enumerate().filter(|(i, _)| rows.contains(i)).map(|(_, s)| &mut **s).collect()
}

fn mismatch(layer: usize) -> GpuError {
    GpuError::Validation {
        during: format!("layer {layer}"),
        message: "layer state does not match the layer type".into(),
    }
}
