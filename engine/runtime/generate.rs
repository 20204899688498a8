//! Token-id generation on a session: prefill the prompt as a batch, then decode one token per
//! step against the caches, streaming each token to a callback.

use crate::error::RunError;
use crate::runtime::sampler::Sampler;
use crate::runtime::session::Session;

/// Generation settings.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// Most new tokens.
    pub max_tokens: usize,
    /// 0 = greedy.
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
        mut on_token: impl FnMut(u32, &mut Session) -> Result<bool, E>,
    ) -> Result<Vec<u32>, E> {
        let mut sampler = Sampler::from_params(params)?;
        let eos = self.model.eos_token_ids.clone();
        let mut out = Vec::new();
        if params.max_tokens == 0 {
            return Ok(out);
        }
        let mut history = prompt.to_vec();
        let mut logits = self.feed(prompt)?;
        loop {
            let next = sampler.sample_after(logits.last(), &history);
            history.push(next);
            out.push(next);
            let stop = (params.stop_at_eos && eos.contains(&next)) || out.len() >= params.max_tokens;
            if !on_token(next, self)? || stop {
                return Ok(out);
            }
            logits = self.feed(&[next])?;
        }
    }
}
