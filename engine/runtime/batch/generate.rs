//! `Batch::generate`: several sessions' generations decoded together, greedy (chosen on the GPU,
//! with run-ahead) or sampled (each row's candidates from its session's pass), or one session's
//! own generation when there is one.

use std::collections::BTreeSet;

use crate::error::{GpuError, RunError};
use crate::gpu::IoBindCache;
use crate::kernels::gdn::GDN_MAX_ROWS;
use crate::kernels::misc::topk_max;
use crate::runtime::forward::gdn_step_fits;
use crate::runtime::sampler::Sampler;
use crate::runtime::session::Session;
use crate::runtime::{CancelFlag, GenerateParams};

use super::pool::{GdnPool, KvPool, Pooled};
use super::{commit_rows, pick, Batch, Head, StepIds, StepOut};

impl Batch {
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
    /// layers together on the batch's pool of their states (`GdnPool`) and attend their KV
    /// caches together in the batch's pool of those (`KvPool`), which the first such call
    /// allocates for its sessions (rounded up to a power of two) and the positions its steps
    /// reach (also a power of two, within the sessions' context), and the batch keeps: two
    /// copies of each slot's GDN states (38 MiB a slot at the 0.8B dims) and the slots' caches
    /// (24 KiB per position and slot at the 0.8B dims); where a pool cannot be allocated, each
    /// session steps those layers on its own states.
    pub fn generate(
        &mut self,
        sessions: &mut [&mut Session],
        prompts: &[&[u32]],
        fed: &[usize],
        params: &GenerateParams,
    ) -> Result<Vec<Vec<u32>>, RunError> {
        self.generate_with(sessions, prompts, fed, params, &mut |_, _| true)
    }

    /// [`Batch::generate`], handing each session's tokens to `on_token(i, id)` (session `i`, in
    /// the order they are chosen) as they come: `false` ends session `i`'s generation at that
    /// token (it stays the last of its output, as EOS does), the other sessions go on.
    pub fn generate_with(
        &mut self,
        sessions: &mut [&mut Session],
        prompts: &[&[u32]],
        fed: &[usize],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<Vec<u32>>, RunError> {
        let cancel = params.cancel.clone();
        let on_token =
            &mut |i: usize, token: u32| on_token(i, token) && !cancel.as_ref().is_some_and(CancelFlag::is_raised);
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
            return Ok(vec![self.generate_alone(only, prompts[0], fed[0], params, on_token)?]);
        }
        let mut next: Vec<u32> = Vec::with_capacity(n);
        for (i, s) in sessions.iter_mut().enumerate() {
            let rest = &prompts[i][fed[i]..];
            let leading = &rest[..rest.len() - 1];
            // A cancel stops the prefills between chunks (each session keeps what ran).
            if !leading.is_empty() && s.prefill_until(leading, cancel.as_ref())? < leading.len() {
                return Ok(vec![Vec::new(); n]);
            }
            next.push(rest[rest.len() - 1]);
        }
        if cancel.as_ref().is_some_and(CancelFlag::is_raised) {
            return Ok(vec![Vec::new(); n]);
        }
        // The rows' GDN states and KV caches go into the pools for the steps and back after
        // them, also when a step fails (the sessions keep the tokens committed so far).
        let pooled = self.pool_in(sessions, params.max_tokens);
        // Plain greedy rows (the same params for every row) are chosen on the GPU; sampled rows
        // draw from candidates found on the GPU where the settings allow (`generate`'s rule).
        let out = if samplers.first().is_some_and(Sampler::is_plain_greedy) {
            self.generate_greedy(sessions, &next, params, pooled, on_token)
        } else {
            self.generate_sampled(sessions, prompts, (next, samplers), params, pooled, on_token)
        };
        self.pool_out(sessions, pooled);
        out
    }

    /// Copy the sessions' GDN states and KV caches into the pools (allocated or grown for them:
    /// the GDN pool where their layers' steps fit one `gdn_decode` dispatch, the KV pool for the
    /// positions `max_tokens` more steps reach), each where it fits the device; which did.
    fn pool_in(&mut self, sessions: &[&mut Session], max_tokens: usize) -> Pooled {
        let (ctx, c) = (&self.model.ctx, &self.model.config);
        let n = sessions.len();
        // Sized to a power of two, within the batch's rows, so that batches growing one session
        // at a time reallocate a pool a few times only.
        let slots = n.next_power_of_two().min(self.rows);
        let mut pooled = Pooled::default();
        if gdn_step_fits(c) && n <= GDN_MAX_ROWS {
            regrow(&mut self.io, &mut self.pool, |p| p.slots < n, || GdnPool::new(ctx, c, slots));
            if let Some(pool) = &mut self.pool {
                pool.copy(ctx, c, sessions, true);
                pooled.gdn = true;
            }
        }
        let reach = |s: &&mut Session| s.pos.saturating_add(max_tokens).min(s.opts.max_context);
        let needed = sessions.iter().map(reach).max().unwrap_or(0);
        let widest = sessions.iter().map(|s| s.opts.max_context).max().unwrap_or(0);
        let positions = needed.next_power_of_two().min(widest).max(needed);
        let short = |p: &KvPool| p.pool.slots < n || p.positions < needed;
        regrow(&mut self.io, &mut self.kv_pool, short, || KvPool::new(ctx, c, slots, positions));
        if let Some(pool) = &mut self.kv_pool {
            pool.copy(ctx, c, sessions, true);
            pooled.kv = true;
        }
        pooled
    }

    /// Drop the pools of GDN states and KV caches and every cached bind group (those hold the
    /// pools and the buffers of the sessions stepped so far): the next generation of several
    /// sessions allocates the pools again. They are kept between generations otherwise, sized for
    /// the most sessions and the furthest position seen.
    pub fn release_pools(&mut self) {
        self.io.forget_groups();
        self.pool = None;
        self.kv_pool = None;
    }

    /// Copy the pooled GDN states and the positions the steps wrote back into the sessions.
    fn pool_out(&mut self, sessions: &[&mut Session], pooled: Pooled) {
        let (ctx, c) = (&self.model.ctx, &self.model.config);
        if let Some(pool) = self.pool.as_mut().filter(|_| pooled.gdn) {
            pool.copy(ctx, c, sessions, false);
        }
        if let Some(pool) = self.kv_pool.as_mut().filter(|_| pooled.kv) {
            pool.copy(ctx, c, sessions, false);
        }
    }

    /// [`Batch::generate`]'s sampled decoding from the rows' last prompt tokens `next`.
    fn generate_sampled(
        &mut self,
        sessions: &mut [&mut Session],
        prompts: &[&[u32]],
        (mut next, mut samplers): (Vec<u32>, Vec<Sampler>),
        params: &GenerateParams,
        pooled: Pooled,
        on_token: &mut dyn FnMut(usize, u32) -> bool,
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
                let slots = pooled.rows(&live);
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
                        let row = logits.row(r).ok_or(RunError::EmptyInput)?;
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
                let done =
                    !on_token(i, id) || (params.stop_at_eos && eos.contains(&id)) || out[i].len() >= params.max_tokens;
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
        on_token: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<u32>, RunError> {
        // The prompt ends at position `end`; each token but the last one returned takes one more.
        let end = s.pos + (prompt.len() - fed);
        let room = (s.opts.max_context + 1).saturating_sub(end);
        let params = GenerateParams { max_tokens: params.max_tokens.min(room), ..params.clone() };
        let own = (s.run_ahead, s.profile.take());
        s.run_ahead = self.run_ahead;
        s.profile = self.profile.take();
        let out = s.generate_from_with(prompt, fed, &params, |id, _| Ok::<_, RunError>(on_token(0, id)));
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
        pooled: Pooled,
        on_token: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<Vec<u32>>, RunError> {
        let eos = self.model.eos_token_ids.clone();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); sessions.len()];
        // The step in flight: its submission, staging slot and rows (session indices in row
        // order, ascending), of which `live` (the rows whose token counts) are committed.
        let mut live: Vec<usize> = (0..sessions.len()).collect();
        let mut slot = 0;
        let mut staged = live.clone();
        let ids = StepIds::Host(first);
        let mut index = self.submit(&mut pick(sessions, &live), ids, Head::Choose { slot }, pooled.rows(&live))?;
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
                Some(self.submit(&mut rows, StepIds::Chosen(&from), head, pooled.rows(&ahead_rows))?)
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
                let done =
                    !on_token(i, id) || (params.stop_at_eos && eos.contains(&id)) || out[i].len() >= params.max_tokens;
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
                    index =
                        self.submit(&mut pick(sessions, &still), ids, Head::Choose { slot }, pooled.rows(&still))?;
                    staged = still.clone();
                }
            }
            commit_rows(sessions, &still);
            live = still;
        }
    }
}

/// `held`, replaced by `make`'s where it is missing or `short`: the old one goes first, with the
/// cached bind groups holding its buffers, so only the new one is held (`None` where it cannot
/// be allocated).
fn regrow<T>(
    io: &mut IoBindCache,
    held: &mut Option<T>,
    short: impl Fn(&T) -> bool,
    make: impl FnOnce() -> Result<T, GpuError>,
) {
    if held.as_ref().is_none_or(short) {
        io.forget_groups();
        *held = None;
        *held = make().ok();
    }
}
