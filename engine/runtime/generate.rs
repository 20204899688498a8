//! Token-id generation on a session: prefill the prompt as a batch, then decode one token per
//! step against the caches, streaming each token to a callback.
//!
//! Greedy decoding without a repetition penalty chooses on the GPU: each step ends with an argmax
//! that writes the id into the next step's input buffer, one submit per token, and only that id
//! (4 bytes, and 4 more for the non-finite flag) comes back. On GPUs step t+1 is submitted before
//! token t is read, so the device never waits for the host ([`Session::set_run_ahead`]); a
//! run-ahead step that turns out not to be needed (EOS, the callback stopping, the last token) is
//! never committed: its GDN states went to the other buffer of each pair and the position did not
//! advance, so the session holds exactly the tokens returned. When the callback changes the
//! session (an adapter switch), the run-ahead step is discarded and recomputed.
//! Sampling (top-k, top-p, the temperature alone, with or without the repetition penalty) finds
//! its candidates on the GPU: the step ends with a top-k pass over the logits (the history's
//! logits copied out and masked first) and only the candidates come back, k + 8 (id, logit) pairs
//! with top-k (64 without, plus the row's softmax mass as one (max, sum) pair per 4,096 logits)
//! and one logit per distinct history id; the host draws from them exactly as it would from the
//! whole row, and reads the row only when the candidates cannot decide
//! (`Sampler::sample_candidates`: a nucleus or a draw past the candidates, or too close to a
//! boundary for the mass's f32 rounding).
//!
//! Every path refuses a row of logits with a NaN or an infinity ([`RunError::NonFiniteLogits`]):
//! the CPU paths look at the row, the GPU paths read back a flag that the argmax pass computes
//! over the whole row (4 bytes more a token). Checkpoint weights are bounded at load; products
//! that still overflow (an adapter and scale at their bounds, say) are caught this way.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::RunError;
use crate::kernels::misc::topk_max;
use crate::runtime::sampler::Sampler;
use crate::runtime::session::Input;
use crate::runtime::session::Session;

/// Generation settings.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// Most new tokens.
    pub max_tokens: usize,
    /// 0 = greedy; so is anything below [`crate::runtime::MIN_TEMPERATURE`] (1e-5), where the
    /// division by the temperature overflows.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// Sampling seed.
    pub seed: u64,
    /// transformers' repetition penalty over prompt and generated tokens (1 = off).
    pub repetition_penalty: f32,
    /// Stop when the generated text contains one of these (text entry points only; the
    /// returned text ends before it).
    pub stop: Vec<String>,
    /// Stop at the model's EOS ids (the EOS token is returned, as transformers does).
    pub stop_at_eos: bool,
    /// Stop once this flag is raised (from any thread): checked at every generated token, which
    /// is handed to the callback and is the last, as when the callback returns false, and
    /// between the prefill's chunks (raised before the first choice, no token is chosen; the
    /// session holds the chunks that ran).
    pub cancel: Option<CancelFlag>,
}

/// Stops generations from another thread ([`GenerateParams::cancel`]). Clones share the flag;
/// each counts the raises since it was made or [`CancelFlag::armed`].
#[derive(Clone, Debug, Default)]
pub struct CancelFlag {
    raises: Arc<AtomicU64>,
    at: u64,
}

impl CancelFlag {
    /// A flag not raised.
    pub fn new() -> Self {
        Self::default()
    }

    /// Stop every generation holding a clone of this flag.
    pub fn raise(&self) {
        self.raises.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether the flag was raised since this clone was made or armed.
    pub fn is_raised(&self) -> bool {
        self.raises.load(Ordering::SeqCst) != self.at
    }

    /// A clone that counts only the raises from now on (a flag reused for the next request).
    pub fn armed(&self) -> Self {
        Self { raises: self.raises.clone(), at: self.raises.load(Ordering::SeqCst) }
    }
}

impl Default for GenerateParams {
    fn default() -> Self {
        Self {
            max_tokens: 64,
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
            repetition_penalty: 1.0,
            stop: Vec::new(),
            stop_at_eos: true,
            cancel: None,
        }
    }
}

impl Session {
    /// Continue the session with `prompt` and generate up to `max_tokens` tokens. `on_token`
    /// receives each token as it is chosen and returns `false` to stop early.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Vec<u32>, RunError> {
        self.generate_with(prompt, params, |token, _| Ok::<_, RunError>(on_token(token)))
    }

    /// Like [`Session::generate`], but the callback also gets the session, so it can change
    /// what the next token is computed with (e.g. [`Session::set_adapter`] between tokens).
    pub fn generate_with<E: From<RunError>>(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: impl FnMut(u32, &mut Session) -> Result<bool, E>,
    ) -> Result<Vec<u32>, E> {
        self.generate_from_with(prompt, 0, params, on_token)
    }

    /// Like [`Session::generate_with`] for a `prompt` whose first `fed` tokens the session
    /// already holds (its last `fed` positions, e.g. restored from a snapshot): only the rest is
    /// prefilled, while the whole prompt is the history a repetition penalty sees.
    pub fn generate_from_with<E: From<RunError>>(
        &mut self,
        prompt: &[u32],
        fed: usize,
        params: &GenerateParams,
        mut on_token: impl FnMut(u32, &mut Session) -> Result<bool, E>,
    ) -> Result<Vec<u32>, E> {
        let cancel = params.cancel.clone();
        let mut on_token = move |token: u32, s: &mut Session| -> Result<bool, E> {
            Ok(on_token(token, s)? && !cancel.as_ref().is_some_and(CancelFlag::is_raised))
        };
        if fed >= prompt.len().max(1) || fed > self.pos {
            return Err(RunError::BadParam {
                name: "fed",
                value: format!("{fed} of a {}-token prompt at position {}", prompt.len(), self.pos),
                expected: "fewer tokens than the prompt has, all of them in the session",
            }
            .into());
        }
        // Every id of the prompt, the held ones too: all of them are the sampler's history.
        self.check_at(prompt, self.pos - fed)?;
        let (history_prompt, prompt) = (prompt, &prompt[fed..]);
        let mut sampler = Sampler::from_params(params)?;
        let eos = self.model.eos_token_ids.clone();
        let mut out = Vec::new();
        if params.max_tokens == 0 {
            return Ok(out);
        }
        if sampler.is_plain_greedy() {
            return self.generate_greedy(prompt, params, on_token);
        }
        let vocab = self.model.config.vocab_size;
        if let Some(k) = sampler.gpu_candidates(vocab, topk_max(vocab)) {
            return self.generate_sampled(history_prompt, fed, params, sampler, k, on_token);
        }
        let mut history = history_prompt.to_vec();
        let mut logits = self.feed(prompt)?;
        loop {
            let row = logits.last().ok_or(RunError::EmptyInput)?;
            if !row.iter().all(|l| l.is_finite()) {
                return Err(RunError::NonFiniteLogits { position: self.pos - 1 }.into());
            }
            let next = sampler.sample_after(row, &history)?;
            history.push(next);
            out.push(next);
            let stop = (params.stop_at_eos && eos.contains(&next)) || out.len() >= params.max_tokens;
            if !on_token(next, self)? || stop {
                return Ok(out);
            }
            logits = self.feed(&[next])?;
        }
    }

    /// Sampling from `k` candidates found on the GPU (and without top-k, the row's softmax mass).
    fn generate_sampled<E: From<RunError>>(
        &mut self,
        prompt: &[u32],
        fed: usize,
        params: &GenerateParams,
        mut sampler: Sampler,
        k: usize,
        mut on_token: impl FnMut(u32, &mut Session) -> Result<bool, E>,
    ) -> Result<Vec<u32>, E> {
        let Some(last) = self.prefill_leading(&prompt[fed..], params.cancel.as_ref())? else {
            return Ok(Vec::new());
        };
        let eos = self.model.eos_token_ids.clone();
        let vocab = self.model.config.vocab_size;
        let mut history: Vec<u32> = prompt.to_vec();
        let mut distinct: BTreeSet<u32> =
            if sampler.penalizes() { prompt.iter().copied().collect() } else { BTreeSet::new() };
        let mut input = last.to_vec();
        let mut out = Vec::new();
        let mass = sampler.needs_mass();
        loop {
            let hist: Vec<u32> = distinct.iter().copied().collect();
            let index = self.submit_sample(Input::Ids(&input), k, &hist, mass)?;
            self.commit(input.len());
            let read = self.read_sample(index, (k, hist.len(), mass.is_some()), self.pos - 1)?;
            let hist_logits: Vec<(u32, f32)> = hist.iter().copied().zip(read.hist).collect();
            let next = match sampler.sample_candidates(&read.cands, &hist_logits, vocab, &read.masses) {
                Some(id) => id,
                None => {
                    // The mask overwrote the history's logits: put them back, then use the row.
                    let mut row = self.read_logits(1)?;
                    for &(id, v) in &hist_logits {
                        if let Some(l) = row.get_mut(id as usize) {
                            *l = v;
                        }
                    }
                    sampler.sample_after(&row, &history)?
                }
            };
            history.push(next);
            if sampler.penalizes() {
                distinct.insert(next);
            }
            out.push(next);
            let stop = (params.stop_at_eos && eos.contains(&next)) || out.len() >= params.max_tokens;
            if !on_token(next, self)? || stop {
                return Ok(out);
            }
            self.check(&[next])?;
            input = vec![next];
        }
    }

    /// Greedy generation with the choice made on the GPU and one step running ahead.
    fn generate_greedy<E: From<RunError>>(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        mut on_token: impl FnMut(u32, &mut Session) -> Result<bool, E>,
    ) -> Result<Vec<u32>, E> {
        let Some(last) = self.prefill_leading(prompt, params.cancel.as_ref())? else {
            return Ok(Vec::new());
        };
        let eos = self.model.eos_token_ids.clone();
        let mut slot = 0;
        let mut pending = self.submit_choice(Input::Ids(last), slot)?;
        self.commit(last.len());
        let mut out = Vec::new();
        loop {
            // `pending` (committed) chooses the next token; the step after it runs ahead unless
            // that token is the last one wanted or the context is full.
            let ahead = if self.run_ahead && out.len() + 1 < params.max_tokens && self.pos < self.opts.max_context {
                Some(self.submit_choice(Input::Chosen, 1 - slot)?)
            } else {
                None
            };
            // `pending` is committed and the run-ahead step is not: it chose from position pos − 1.
            let next = self.read_choice(pending, slot, self.pos - 1)?;
            out.push(next);
            let stop = (params.stop_at_eos && eos.contains(&next)) || out.len() >= params.max_tokens;
            let epoch = self.epoch;
            if !on_token(next, self)? || stop {
                return Ok(out);
            }
            slot = 1 - slot;
            pending = match ahead {
                Some(index) if self.epoch == epoch => index,
                _ => {
                    self.check(&[next])?;
                    self.submit_choice(Input::Ids(&[next]), slot)?
                }
            };
            self.commit(1);
        }
    }
}
