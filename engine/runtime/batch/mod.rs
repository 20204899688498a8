//! Batched decode: one token of each of several sessions in one step, every session with its
//! own adapter set. The projections run once for all rows (M = N: every weight is read once for
//! the N tokens); the mixers' cores (GDN conv, delta rule and gated norm; attention over the KV
//! cache) run for every row at its own position, on the states and caches a generation pools
//! (one dispatch per GDN layer, two per attention layer and 32 rows), else per session on its
//! own. Each row's LoRA comes from one stack of every adapter any row applies, with a scale
//! table of one row per session: a row's factors are 0 on the ranks of adapters its set does
//! not hold (the BGMV idea: one shrink and one fused expand for all rows, each row its own
//! adapters).
//!
//! This file holds the batch and its step; `generate.rs` the batched generation, `layers.rs` a
//! step's layers for every row, `pool.rs` the GDN states and KV caches pooled across a
//! generation's sessions.

mod generate;
mod layers;
mod pool;

use std::sync::Arc;

use crate::error::{AdapterError, RunError};
use crate::gpu::{read_f32_via, IoBindCache, Profile, Recorder, Staging};
use crate::kernels::misc::{argmax_rows, argmax_scratch_bytes, embed};
use crate::lora::{InputGroup, LoraAdapter};
use crate::model::{Mixer, Model};
use crate::runtime::adapters::{stack_tables, table_base, ActiveAdapter, BoundSet};
use crate::runtime::cache::Scratch;
use crate::runtime::forward::{
    block_input, folds_norm, head_input, lm_head, mlp_block, LayerLora, NextReads, NextWrites,
};
use crate::runtime::session::{Logits, SampleRead, Session};

use layers::{attention_rows, gdn_rows};
use pool::{GdnPool, KvPool, PoolRows, Pooled};

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
/// groups, the LoRA stack and tables of the last set of rows. The cached bind groups hold the
/// buffers of the sessions it stepped (their caches, states and RoPE tables), so a session's GPU
/// memory is freed only once the batch lets go of them too: drop the batch or call
/// [`Batch::release_pools`] after dropping sessions it stepped (the backend drops its batch when
/// a session closes).
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
    /// Their KV caches side by side, the same way, also grown for further positions (`KvPool`).
    kv_pool: Option<KvPool>,
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
        model.check().map_err(|e| RunError::ModelConfig(Box::new(e)))?;
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
            io: IoBindCache::with_arena(&ctx, "batch uniform arena", 512 * 256),
            lora: None,
            lora_t: None,
            run_ahead: !ctx.is_cpu(),
            profile: None,
            pool: None,
            kv_pool: None,
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

    /// [`Batch::step`], on the pooled states of slots `pool` where given.
    fn step_rows(
        &mut self,
        sessions: &mut [&mut Session],
        ids: &[u32],
        pool: Option<(&[usize], Pooled)>,
    ) -> Result<Logits, RunError> {
        self.submit(sessions, StepIds::Host(ids), Head::Logits, pool)?;
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
        pool: Option<(&[usize], Pooled)>,
    ) -> Result<Vec<SampleRead>, RunError> {
        let index = self.submit(sessions, StepIds::Host(ids), Head::Sample { k, hists, mass }, pool)?;
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
    /// `pool` (during `generate` with the pools: row r's slot, which pools hold the rows), the
    /// GDN layers step the pooled states and the attention layers attend the pooled caches.
    fn submit(
        &mut self,
        sessions: &mut [&mut Session],
        ids: StepIds,
        head: Head,
        pool: Option<(&[usize], Pooled)>,
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
        for s in sessions.iter_mut() {
            s.forget_fired_taps();
        }
        let pooled = pool.map(|(slots, held)| {
            let gdn = self.pool.as_ref().filter(|_| held.gdn).map(|pool| {
                let parity = match (sessions.first(), slots.first()) {
                    (Some(s), Some(&i)) => (s.pos - pool.start[i]) % 2,
                    _ => 0,
                };
                (pool, parity)
            });
            PoolRows { gdn, kv: self.kv_pool.as_ref().filter(|_| held.kv), slots }
        });
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
            let mixer_in = block_input(
                &mut rec,
                c,
                sc,
                &layer.input_norm,
                folds_norm(layer.mixer.input_weight(), n),
                lora,
                (InputGroup::MixerIn, NextReads::default()),
                n,
            )?;
            match &layer.mixer {
                Mixer::Gdn(w) => gdn_rows(&mut rec, c, sc, w, (sessions, pooled), i, mixer_in, lora)?,
                Mixer::Attention(w) => attention_rows(&mut rec, c, sc, w, (sessions, pooled), i, mixer_in, lora)?,
            }
            let mlp_in = block_input(
                &mut rec,
                c,
                sc,
                &layer.post_norm,
                folds_norm(&layer.mlp.gate_up, n),
                lora,
                (InputGroup::MlpIn, NextReads::default()),
                n,
            )?;
            mlp_block(&mut rec, c, sc, &layer.mlp, mlp_in, (lora, NextWrites::default()), n)?;
        }
        let head_src = head_input(&mut rec, &model, sc, (folds_norm(model.output(), n), None), (0, n))?;
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
