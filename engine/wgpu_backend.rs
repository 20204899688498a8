//! [`WgpuBackend`]: the [`LlmBackend`] of this crate. Adapters stay resident on the GPU;
//! activating, switching or deactivating one changes which bind groups the next step binds.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::{
    ActiveAdapterInfo, AdapterId, AdapterSwitch, AdapterWeight, BackendError, LlmBackend, ModelInfo, TextOut,
};
use crate::error::{AdapterError, LearnError, RunError};
use crate::gpu::GpuContext;
use crate::learn::{
    export_peft, init_adapter, FeedbackEvent, LearnOptions, LearnReport, ModuleGrad, TokenEvent, TrainSpec, Trainer,
};
use crate::lora::{AdapterInfo, LoraAdapter, MAX_SET};
use crate::model::{LoadOptions, Model};
use crate::runtime::{ActiveAdapter, Batch, GenerateParams, PromptCache, Session, SessionOptions};
use crate::text::{ChatDelta, ChatMessage, ChatReply, ChatRequest, ReplyParser, TextTokenizer};

/// A backend session's id ([`WgpuBackend::create_session`]); never reused while the backend
/// lives.
pub type SessionId = u64;

/// Most sessions one backend keeps open.
pub const MAX_SESSIONS: usize = 64;

/// GPU bytes the prompt-cache snapshots of all sessions may hold together unless set otherwise
/// ([`WgpuBackend::set_snapshot_budget`]): 256 MiB, 13 snapshots at the 0.8B dimensions (one
/// session holds at most [`MAX_SNAPSHOTS`](crate::runtime::MAX_SNAPSHOTS)).
pub const DEFAULT_SNAPSHOT_BUDGET: u64 = 256 << 20;

/// One conversation: a session (KV cache, GDN states, sampler), what its state can be reused
/// for, and its active adapter set.
struct Conversation {
    id: SessionId,
    session: Session,
    /// What the session's state can be reused for.
    cache: PromptCache,
    /// The active set, as given.
    active: Vec<AdapterWeight>,
    /// When a request last used it (the backend's request count then).
    last_used: u64,
}

impl Conversation {
    /// Clear the prompt cache after a request that did not finish, with the snapshots its
    /// steps took.
    fn forget_cache(&mut self) {
        self.cache.clear();
        drop(self.session.take_snapshots());
    }
}

struct Loaded {
    path: PathBuf,
    model: Arc<Model>,
    tokenizer: Option<Arc<TextTokenizer>>,
    /// `<|im_start|>`, where chat turns start (a snapshot point of the prompt cache).
    turn_start: Option<u32>,
    /// The open sessions; `current` is the one the [`LlmBackend`] calls use.
    sessions: Vec<Conversation>,
    current: usize,
    /// The buffers of batched steps ([`WgpuBackend::generate_batch`]), made on first use.
    batch: Option<Batch>,
    /// Requests served (the clock of `Conversation::last_used`).
    requests: u64,
}

impl Loaded {
    fn cur(&mut self) -> &mut Conversation {
        &mut self.sessions[self.current]
    }

    fn cur_ref(&self) -> &Conversation {
        &self.sessions[self.current]
    }

    /// Open a session under the id `*next` and move `next` on (ids are the backend's, across
    /// models: an id from before a model change names no session of the new one).
    fn open(&mut self, opts: &SessionOptions, next: &mut SessionId) -> Result<SessionId, BackendError> {
        if self.sessions.len() >= MAX_SESSIONS {
            return Err(BackendError::Sessions { why: format!("at most {MAX_SESSIONS} sessions are open at once") });
        }
        let session = Session::new(self.model.clone(), opts.clone())?;
        let id = *next;
        *next += 1;
        self.sessions.push(Conversation {
            id,
            session,
            cache: PromptCache::default(),
            active: Vec::new(),
            last_used: 0,
        });
        Ok(id)
    }

    /// Mark the sessions at `using` as used by the request starting now.
    fn touch(&mut self, using: &[usize]) {
        self.requests += 1;
        for &i in using {
            self.sessions[i].last_used = self.requests;
        }
    }

    /// Free prompt-cache snapshots until all sessions' fit in `budget` bytes: the least
    /// recently used session's oldest first, the sessions at `using` (the request's) last.
    fn fit_snapshots(&mut self, budget: u64, using: &[usize]) {
        while self.sessions.iter().map(|c| c.cache.snapshot_bytes()).sum::<u64>() > budget {
            let victim = self
                .sessions
                .iter()
                .enumerate()
                .filter(|(_, c)| c.cache.snapshot_count() > 0)
                .min_by_key(|(i, c)| (using.contains(i), c.last_used))
                .map(|(i, _)| i);
            match victim {
                Some(i) => self.sessions[i].cache.drop_oldest(),
                None => return,
            };
        }
    }

    fn index(&self, id: SessionId) -> Result<usize, BackendError> {
        self.sessions
            .iter()
            .position(|c| c.id == id)
            .ok_or_else(|| BackendError::UnknownSession { id, open: self.sessions.iter().map(|c| c.id).collect() })
    }
}

/// The wgpu backend: one model (its weights on the GPU once), any number of resident adapters
/// (uploaded once, shared by every session), and sessions, each with its own caches, prompt
/// cache and active adapter set. The [`LlmBackend`] calls use the current session
/// ([`WgpuBackend::select_session`]); loading a model opens one.
pub struct WgpuBackend {
    ctx: Arc<GpuContext>,
    opts: SessionOptions,
    snapshot_budget: u64,
    loaded: Option<Loaded>,
    /// The next session's id (never reused while the backend lives, across models).
    next_session: SessionId,
    resident: Vec<(AdapterId, Arc<LoraAdapter>)>,
    trainer: Option<(AdapterId, Trainer)>,
}

impl WgpuBackend {
    /// A backend on the default GPU (see [`GpuContext::new`]).
    pub fn new(opts: SessionOptions) -> Result<Self, BackendError> {
        Ok(Self::with_context(Arc::new(GpuContext::new()?), opts))
    }

    /// A backend on an existing context.
    pub fn with_context(ctx: Arc<GpuContext>, opts: SessionOptions) -> Self {
        Self {
            ctx,
            opts,
            snapshot_budget: DEFAULT_SNAPSHOT_BUDGET,
            loaded: None,
            next_session: 1,
            resident: Vec::new(),
            trainer: None,
        }
    }

    /// The GPU context (e.g. to read [`GpuContext::bytes_uploaded`]).
    pub fn context(&self) -> &Arc<GpuContext> {
        &self.ctx
    }

    fn loaded(&mut self) -> Result<&mut Loaded, BackendError> {
        self.loaded.as_mut().ok_or(BackendError::NoModel)
    }

    fn find(&self, id: &str) -> Result<&Arc<LoraAdapter>, AdapterError> {
        find_in(&self.resident, id)
    }

    /// Bind the set `active` to the session (nothing else changes on error).
    fn bind(&mut self, active: Vec<AdapterWeight>) -> Result<(), BackendError> {
        let set = resolve(&self.resident, &active)?;
        let conv = self.loaded()?.cur();
        conv.session.set_adapters(set)?;
        // Always: `session()` may have bound something else meanwhile, so an unchanged
        // active set does not prove the cached tokens were computed with this set.
        conv.cache.clear();
        conv.active = active;
        Ok(())
    }

    /// The current session's active set (empty without a model).
    fn active(&self) -> &[AdapterWeight] {
        self.loaded.as_ref().map_or(&[], |l| l.cur_ref().active.as_slice())
    }

    /// Drop resident adapter `id` (and its trainer, if it was the trainable one). It must be in
    /// no session's active set.
    fn forget(&mut self, id: &str) {
        let gone = find_in(&self.resident, id).ok().cloned();
        self.resident.retain(|(i, _)| i != id);
        if let (Some(l), Some(gone)) = (self.loaded.as_mut(), gone) {
            // Stacks that hold it let it go; the other sessions keep theirs (and their snapshots:
            // dropping a stack counts as an adapter change for the session's snapshots). No
            // bind group a session cached keeps its buffers alive (a batch caches none of an
            // adapter's).
            for c in &mut l.sessions {
                if c.session.stack_holds(&gone) {
                    c.session.forget_stack();
                }
                c.session.forget_adapter(&gone);
            }
            if let Some(batch) = l.batch.as_mut().filter(|b| b.holds(&gone)) {
                batch.forget_stack();
            }
        }
        if self.trainer.as_ref().is_some_and(|(t, _)| t == id) {
            self.trainer = None;
        }
    }

    /// [`Self::forget`] `id` unless another session's set holds it (it stays resident for them).
    fn forget_unless_shared(&mut self, id: &str) {
        let shared = self.loaded.as_ref().is_some_and(|l| {
            let current = l.cur_ref().id;
            l.sessions.iter().any(|c| c.id != current && c.active.iter().any(|a| a.id == id))
        });
        if !shared {
            self.forget(id);
        }
    }

    fn unique_id(&self, wanted: &str) -> AdapterId {
        let taken = |id: &str| self.resident.iter().any(|(i, _)| i == id);
        if !taken(wanted) {
            return wanted.to_string();
        }
        (2..).map(|n| format!("{wanted}-{n}")).find(|id| !taken(id)).unwrap_or_default()
    }

    /// The session (for token-level control: feed, logits, switching between tokens). What is
    /// done with it is unknown to the prompt cache, which is cleared.
    pub fn session(&mut self) -> Result<&mut Session, BackendError> {
        let conv = self.loaded()?.cur();
        conv.cache.clear();
        Ok(&mut conv.session)
    }

    /// Open a new session on the loaded model (its own KV cache, GDN states, prompt cache and
    /// adapter set; no adapter active). The current session stays current. Nothing changes on
    /// error (at most [`MAX_SESSIONS`] open, or the GPU out of memory for its caches).
    pub fn create_session(&mut self) -> Result<SessionId, BackendError> {
        let (opts, mut next) = (self.opts.clone(), self.next_session);
        let id = self.loaded()?.open(&opts, &mut next)?;
        self.next_session = next;
        Ok(id)
    }

    /// Make session `id` the one the [`LlmBackend`] calls (generation, chat, adapters, learning,
    /// embeddings) use.
    pub fn select_session(&mut self, id: SessionId) -> Result<(), BackendError> {
        let loaded = self.loaded()?;
        loaded.current = loaded.index(id)?;
        Ok(())
    }

    /// Close session `id` and free its caches (not the last one: a loaded backend keeps one).
    /// Closing the current session makes the first remaining one current.
    pub fn close_session(&mut self, id: SessionId) -> Result<(), BackendError> {
        let loaded = self.loaded()?;
        let i = loaded.index(id)?;
        if loaded.sessions.len() == 1 {
            return Err(BackendError::Sessions { why: "the last open session cannot be closed".into() });
        }
        let current = loaded.sessions[loaded.current].id;
        loaded.sessions.remove(i);
        // The batch's bind groups hold the closed session's buffers.
        loaded.batch = None;
        loaded.current = loaded.sessions.iter().position(|c| c.id == current).unwrap_or(0);
        Ok(())
    }

    /// Generate for several sessions at once: request `i` continues session `requests[i].0`
    /// with the prompt `requests[i].1` (token ids) under that session's adapter set, and the
    /// sessions decode together, one batched step per token (every weight read once for all of
    /// them; see [`Batch`]). Each session's prompt cache applies as in
    /// [`LlmBackend::generate_tokens`]. Token ids only: `params.stop` must be empty (stop strings
    /// need the text, a typed error otherwise). Returns each request's new tokens, in order.
    /// Every request is checked before any runs. One step binds at most
    /// [`crate::lora::MAX_SET`] distinct adapters: sessions applying more together run as
    /// consecutive batches, each of as many requests, in order, as stay within that (this and
    /// every other batch call).
    pub fn generate_batch(
        &mut self,
        requests: &[(SessionId, &[u32])],
        params: &GenerateParams,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        self.generate_batch_with(requests, params, &mut |_, _| true)
    }

    /// [`WgpuBackend::generate_batch`], handing each request's tokens to `on_token(i, id)`
    /// (request `i`) as they come: `false` ends request `i` at that token, the others go on.
    pub fn generate_batch_with(
        &mut self,
        requests: &[(SessionId, &[u32])],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        if !params.stop.is_empty() {
            return Err(RunError::BadParam {
                name: "stop",
                value: format!("{:?}", params.stop),
                expected: "no stop strings in a batch of token ids",
            }
            .into());
        }
        self.batch_ids(requests, params, on_token)
    }

    /// Generate for several sessions at once from raw text (no chat template): request `i`
    /// continues session `requests[i].0` with the prompt text `requests[i].1`, as
    /// [`LlmBackend::generate_stream`] does for one session (the same tokens, each session under
    /// its own adapter set and prompt cache), the sessions decoding together as in
    /// [`WgpuBackend::generate_batch`]. Each request stops at EOS, `max_tokens` or the first of
    /// `params.stop` (not included) on its own, and where its session's context fills it ends
    /// with what it has (alone that is `ContextFull`); `on_text(i, delta)` gets request `i`'s
    /// text as it is generated (deltas never split a UTF-8 character) and returns `false` to
    /// stop that request (it is not called for it again). A request whose text cannot be
    /// decoded fails the call. Returns each request's text, in order.
    pub fn generate_batch_stream(
        &mut self,
        requests: &[(SessionId, &str)],
        params: &GenerateParams,
        on_text: &mut dyn FnMut(usize, &str) -> bool,
    ) -> Result<Vec<String>, BackendError> {
        let tok = self.tokenizer().ok_or_else(|| BackendError::NoTokenizer { backend: self.backend_name().into() })?;
        let ids = requests.iter().map(|(_, text)| tok.encode(text)).collect::<Result<Vec<_>, _>>()?;
        let by_ids: Vec<(SessionId, &[u32])> =
            requests.iter().zip(&ids).map(|((id, _), p)| (*id, p.as_slice())).collect();
        self.batch_text(&tok, &by_ids, params, on_text)
    }

    /// One chat turn in each of several sessions at once: request `i` is
    /// [`LlmBackend::chat`] of `requests[i].1` in session `requests[i].0` (its template, its
    /// adapter set and prompt cache, the same reply), the sessions decoding together as in
    /// [`WgpuBackend::generate_batch`]. `on_delta(i, delta)` gets request `i`'s reply as it is
    /// generated and returns `false` to stop that request (it is not called for it again); each
    /// request stops at EOS, `max_tokens`, the first of `params.stop` or its full context on its
    /// own, as in [`WgpuBackend::generate_batch_stream`]. Returns each request's reply, in order.
    pub fn chat_batch(
        &mut self,
        requests: &[(SessionId, &ChatRequest)],
        params: &GenerateParams,
        on_delta: &mut dyn FnMut(usize, ChatDelta<'_>) -> bool,
    ) -> Result<Vec<ChatReply>, BackendError> {
        let tok = self.tokenizer().ok_or_else(|| BackendError::NoTokenizer { backend: self.backend_name().into() })?;
        let prompts = requests.iter().map(|(_, r)| tok.encode_chat(r)).collect::<Result<Vec<_>, _>>()?;
        let by_ids: Vec<(SessionId, &[u32])> =
            requests.iter().zip(&prompts).map(|((id, _), p)| (*id, p.ids.as_slice())).collect();
        let mut parsers: Vec<ReplyParser> =
            prompts.iter().zip(requests).map(|(p, (_, r))| p.reply_parser(r.tools.as_deref())).collect();
        // Once `on_delta` returned false for a request it is not called for it again.
        let mut open = vec![true; requests.len()];
        let mut emit = |i: usize, d: ChatDelta<'_>, open: &mut [bool]| {
            open[i] = open[i] && on_delta(i, d);
            open[i]
        };
        self.batch_text(&tok, &by_ids, params, &mut |i, delta| parsers[i].push(delta, &mut |d| emit(i, d, &mut open)))?;
        Ok(parsers.into_iter().enumerate().map(|(i, p)| p.finish(&mut |d| emit(i, d, &mut open))).collect())
    }

    /// Several requests' token ids decoded together, each request's text as
    /// [`LlmBackend::generate_stream_ids`] makes it for one (`on_text` with the request's index).
    fn batch_text(
        &mut self,
        tok: &TextTokenizer,
        requests: &[(SessionId, &[u32])],
        params: &GenerateParams,
        on_text: &mut dyn FnMut(usize, &str) -> bool,
    ) -> Result<Vec<String>, BackendError> {
        // Generation stops a request's row as soon as its text does: at a stop string or when the
        // caller stops it; and every row once one request's decoding fails (the call fails).
        let mut texts: Vec<TextOut> = requests.iter().map(|_| TextOut::new(tok, &params.stop)).collect();
        let mut failed = false;
        self.batch_ids(requests, params, &mut |i, id| {
            let go_on = !failed && texts[i].token(id, &mut |delta| on_text(i, delta));
            failed = failed || texts[i].failed();
            go_on
        })?;
        if let Some(e) = texts.iter_mut().find_map(TextOut::take_failure) {
            return Err(e.into());
        }
        let mut out = Vec::with_capacity(texts.len());
        for (i, text) in texts.into_iter().enumerate() {
            out.push(text.finish(&mut |delta| on_text(i, delta))?);
        }
        Ok(out)
    }

    /// [`WgpuBackend::generate_batch_with`] for requests whose stop strings the caller applies.
    /// Every request is checked before any runs. Requests whose sessions apply more than
    /// [`MAX_SET`] distinct adapters together (one step binds at most that many) run as several
    /// batches one after the other, each of as many requests, in order, as stay within it.
    fn batch_ids(
        &mut self,
        requests: &[(SessionId, &[u32])],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        let loaded = self.loaded()?;
        let mut using = Vec::with_capacity(requests.len());
        for (i, (id, _)) in requests.iter().enumerate() {
            using.push(loaded.index(*id)?);
            if requests[..i].iter().any(|(other, _)| other == id) {
                return Err(BackendError::Sessions { why: format!("session {id} is asked for twice in one batch") });
            }
        }
        for (&s, (_, prompt)) in using.iter().zip(requests) {
            loaded.sessions[s].session.check_request(prompt, params)?;
        }
        if requests.is_empty() || params.max_tokens == 0 {
            // Nothing runs: the prompt caches keep what they hold.
            return Ok(vec![Vec::new(); requests.len()]);
        }
        let mut out = vec![Vec::new(); requests.len()];
        for group in adapter_groups(using.iter().map(|&s| loaded.sessions[s].session.adapters())) {
            let part: Vec<(SessionId, &[u32])> = group.iter().map(|&i| requests[i]).collect();
            let got = self.batch_group(&part, params, &mut |k, token| on_token(group[k], token))?;
            for (&i, tokens) in group.iter().zip(got) {
                out[i] = tokens;
            }
        }
        Ok(out)
    }

    /// One batch of [`WgpuBackend::batch_ids`]: checked requests of distinct sessions whose
    /// adapters fit one step.
    fn batch_group(
        &mut self,
        requests: &[(SessionId, &[u32])],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(usize, u32) -> bool,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        let budget = self.snapshot_budget;
        let loaded = self.loaded()?;
        let n = requests.len();
        if loaded.batch.as_ref().is_none_or(|b| b.rows() < n) {
            loaded.batch = Some(Batch::new(loaded.model.clone(), n)?);
        }
        let turn_start = loaded.turn_start;
        let using = requests.iter().map(|(id, _)| loaded.index(*id)).collect::<Result<Vec<_>, _>>()?;
        loaded.touch(&using);
        let mut fed = Vec::with_capacity(n);
        for (&s, (_, prompt)) in using.iter().zip(requests) {
            let c = &mut loaded.sessions[s];
            match c.cache.prepare(&mut c.session, prompt, turn_start) {
                Ok(f) => fed.push(f),
                Err(e) => {
                    c.forget_cache();
                    return Err(e.into());
                }
            }
            loaded.fit_snapshots(budget, &using);
        }
        let Loaded { sessions, batch, .. } = &mut *loaded;
        let mut convs: Vec<(usize, &mut Conversation)> = sessions
            .iter_mut()
            .filter_map(|c| requests.iter().position(|(id, _)| *id == c.id).map(|i| (i, c)))
            .collect();
        convs.sort_by_key(|(i, _)| *i);
        let prompts: Vec<&[u32]> = requests.iter().map(|(_, p)| *p).collect();
        let out = {
            let mut rows: Vec<&mut Session> = convs.iter_mut().map(|(_, c)| &mut c.session).collect();
            batch.as_mut().ok_or(BackendError::NoModel)?.generate_with(&mut rows, &prompts, &fed, params, on_token)
        };
        for (i, c) in convs.iter_mut() {
            match &out {
                Ok(tokens) => c.cache.finish(&mut c.session, prompts[*i], &tokens[*i]),
                Err(_) => c.forget_cache(),
            }
        }
        // The snapshots the prompts' steps took.
        loaded.fit_snapshots(budget, &using);
        Ok(out?)
    }

    /// Bound the GPU bytes the prompt-cache snapshots of all sessions hold together (default
    /// [`DEFAULT_SNAPSHOT_BUDGET`]): after a request's prompt is prepared, and after the
    /// request (whose steps take its prompt's snapshots), snapshots are freed, the least
    /// recently used session's oldest first and the request's own last, until they fit.
    /// A smaller budget only makes later requests prefill more; 0 keeps no snapshot past a
    /// request.
    pub fn set_snapshot_budget(&mut self, bytes: u64) {
        self.snapshot_budget = bytes;
        if let Some(loaded) = self.loaded.as_mut() {
            loaded.fit_snapshots(bytes, &[]);
        }
    }

    /// The budget of [`WgpuBackend::set_snapshot_budget`].
    pub fn snapshot_budget(&self) -> u64 {
        self.snapshot_budget
    }

    /// GPU bytes the prompt-cache snapshots of all sessions hold now.
    pub fn snapshot_bytes(&self) -> u64 {
        self.loaded.as_ref().map_or(0, |l| l.sessions.iter().map(|c| c.cache.snapshot_bytes()).sum())
    }

    /// The current session's id.
    pub fn current_session(&self) -> Option<SessionId> {
        self.loaded.as_ref().map(|l| l.cur_ref().id)
    }

    /// The open sessions' ids, oldest first.
    pub fn sessions(&self) -> Vec<SessionId> {
        self.loaded.as_ref().map_or_else(Vec::new, |l| l.sessions.iter().map(|c| c.id).collect())
    }

    /// The prompt cache: a request whose prompt starts with tokens the session already holds
    /// prefills only the rest (see [`PromptCache`]; on by default).
    pub fn prompt_cache(&mut self) -> Result<&mut PromptCache, BackendError> {
        Ok(&mut self.loaded()?.cur().cache)
    }

    /// Like [`LlmBackend::generate_tokens`], but the callback may switch adapters between
    /// tokens: the next token is computed with the new adapter, while the caches keep what the
    /// earlier tokens computed under the previous one (as if the adapter had changed at that
    /// position). The backend's active adapter afterwards is the last one switched to.
    pub fn generate_tokens_with(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32, &mut AdapterSwitch) -> bool,
    ) -> Result<Vec<u32>, BackendError> {
        let resident = &self.resident;
        let loaded = self.loaded.as_mut().ok_or(BackendError::NoModel)?;
        let turn_start = loaded.turn_start;
        let current = loaded.current;
        // Bad input is refused before the prompt cache prepares (and so keeps) anything.
        loaded.cur_ref().session.check_request(prompt, params)?;
        if params.max_tokens == 0 {
            // Nothing runs: the prompt cache keeps what it holds.
            return Ok(Vec::new());
        }
        loaded.touch(&[current]);
        let conv = loaded.cur();
        let fed = match conv.cache.prepare(&mut conv.session, prompt, turn_start) {
            Ok(fed) => fed,
            Err(e) => {
                conv.forget_cache();
                return Err(e.into());
            }
        };
        loaded.fit_snapshots(self.snapshot_budget, &[current]);
        let conv = loaded.cur();
        let mut active = conv.active.clone();
        let mut switched = false;
        let out = conv.session.generate_from_with(prompt, fed, params, |token, session| {
            let mut switch = AdapterSwitch::default();
            let go_on = on_token(token, &mut switch);
            if let Some(request) = switch.request {
                let set: Vec<AdapterWeight> =
                    request.into_iter().map(|(id, scale)| AdapterWeight::new(id, scale)).collect();
                session.set_adapters(resolve(resident, &set)?)?;
                active = set;
                switched = true;
            }
            Ok::<bool, BackendError>(go_on)
        });
        match &out {
            // Tokens before a switch were computed under another adapter.
            Ok(tokens) if !switched => conv.cache.finish(&mut conv.session, prompt, tokens),
            _ => conv.forget_cache(),
        }
        conv.active = active;
        // The snapshots the prompt's steps took.
        loaded.fit_snapshots(self.snapshot_budget, &[current]);
        out
    }

    /// [`LlmBackend::load_model`] with explicit [`LoadOptions`] (e.g. a smaller weight chunk).
    pub fn load_model_with(&mut self, path: &Path, opts: &LoadOptions) -> Result<(), BackendError> {
        let model = Arc::new(Model::load_with(self.ctx.clone(), path, opts)?);
        let tokenizer =
            if path.join("tokenizer.json").is_file() { Some(Arc::new(TextTokenizer::from_dir(path)?)) } else { None };
        let turn_start = tokenizer.as_ref().and_then(|t| t.token_id("<|im_start|>"));
        let mut loaded = Loaded {
            path: path.to_path_buf(),
            model,
            tokenizer,
            turn_start,
            sessions: Vec::new(),
            current: 0,
            batch: None,
            requests: 0,
        };
        loaded.open(&self.opts, &mut self.next_session)?;
        self.resident.clear();
        self.trainer = None;
        self.loaded = Some(loaded);
        Ok(())
    }

    /// Make `adapter` the trainable one: resident under `id`, active at scale 1. Nothing changes
    /// on error.
    fn start_training(&mut self, adapter: LoraAdapter, id: &str) -> Result<AdapterId, BackendError> {
        let loaded = self.loaded()?;
        let model = loaded.model.clone();
        let max_tokens = self.opts.max_batch.min(self.opts.max_context);
        let adapter = Arc::new(adapter);
        let trainer = Trainer::new(&model, adapter.clone(), max_tokens)?;
        let id = self.unique_id(id);
        self.resident.push((id.clone(), adapter));
        if let Err(e) = self.activate_adapter(&id, 1.0) {
            self.resident.retain(|(i, _)| *i != id);
            return Err(e);
        }
        if let Some((old, _)) = self.trainer.take() {
            self.forget_unless_shared(&old);
        }
        self.trainer = Some((id.clone(), trainer));
        Ok(id)
    }

    /// The trainable adapter's id, if any.
    pub fn trainable_adapter(&self) -> Option<&str> {
        self.trainer.as_ref().map(|(id, _)| id.as_str())
    }

    /// The session, the trainer and the scale the trainable adapter runs at (its active scale,
    /// or 1 when another adapter is active), once `events` and `opts` passed the trainer's
    /// checks (a refused step clears no prompt cache).
    fn training(
        &mut self,
        events: &[TokenEvent],
        opts: Option<&LearnOptions>,
    ) -> Result<(&mut Session, &mut Trainer, f32), BackendError> {
        let (id, trainer) = self.trainer.as_mut().ok_or(LearnError::NoTrainableAdapter)?;
        let loaded = self.loaded.as_mut().ok_or(BackendError::NoModel)?;
        trainer.check(&loaded.cur_ref().session, events, opts)?;
        let current = loaded.cur_ref().id;
        for c in &mut loaded.sessions {
            // A step changes the adapter's weights and runs its passes in the current session:
            // every session that applies the adapter holds states computed with the old ones.
            if c.id == current || c.active.iter().any(|a| a.id == *id) {
                c.cache.clear();
            }
        }
        let conv = loaded.cur();
        let scale = conv.active.iter().find(|a| a.id == *id).map_or(1.0, |a| a.scale);
        Ok((&mut conv.session, trainer, scale))
    }

    /// One learning step on token-level events (see [`crate::learn`] for the loss).
    pub fn learn_tokens(&mut self, events: &[TokenEvent], opts: &LearnOptions) -> Result<LearnReport, BackendError> {
        let steps = self.learn_steps();
        let report = {
            let (session, trainer, scale) = self.training(events, Some(opts))?;
            trainer.learn(session, events, opts, scale)
        };
        // A step that was taken (even when reading its report failed) reaches every session.
        if self.learn_steps() != steps {
            self.restack_trainable()?;
        }
        Ok(report?)
    }

    /// After a step: every session forgets a stack that holds the trainable adapter (its weights
    /// are from before the step), and a session whose active set is such a stack rebuilds it. An
    /// error here (the GPU out of memory for a stack) comes after the step was taken: every
    /// session is still visited, and the first error is returned.
    fn restack_trainable(&mut self) -> Result<(), BackendError> {
        let (Some((id, _)), Some(loaded)) = (&self.trainer, self.loaded.as_mut()) else { return Ok(()) };
        let trainable = find_in(&self.resident, id)?.clone();
        if let Some(batch) = loaded.batch.as_mut().filter(|b| b.holds(&trainable)) {
            batch.forget_stack();
        }
        let mut first = None;
        for c in &mut loaded.sessions {
            if c.session.stack_holds(&trainable) {
                c.session.forget_stack();
                if c.active.len() > 1 && c.active.iter().any(|a| a.id == *id) {
                    let rebuilt = resolve(&self.resident, &c.active).and_then(|set| c.session.set_adapters(set));
                    if let Err(e) = rebuilt {
                        first.get_or_insert(e);
                    }
                }
            }
        }
        first.map_or(Ok(()), |e| Err(e.into()))
    }

    /// The gradients of the loss of `events` with respect to every adapted A and B, without
    /// stepping (the adapter is unchanged): for checks against an autograd oracle.
    pub fn learn_gradients(&mut self, events: &[TokenEvent]) -> Result<Vec<ModuleGrad>, BackendError> {
        let (session, trainer, scale) = self.training(events, None)?;
        Ok(trainer.gradients(session, events, scale)?)
    }

    /// Steps the trainable adapter has taken.
    pub fn learn_steps(&self) -> Option<u64> {
        self.trainer.as_ref().map(|(_, t)| t.steps())
    }

    /// Text events as token events: the prompt as a user message through the chat template
    /// (raw text without one), the response followed by the first EOS token.
    pub fn tokenize_events(&self, events: &[FeedbackEvent]) -> Result<Vec<TokenEvent>, BackendError> {
        let loaded = self.loaded.as_ref().ok_or(BackendError::NoModel)?;
        let tok = loaded
            .tokenizer
            .as_ref()
            .ok_or_else(|| BackendError::NoTokenizer { backend: self.backend_name().into() })?;
        let eos = loaded.model.eos_token_ids.first().copied();
        events
            .iter()
            .map(|e| {
                let prompt = match tok.chat_template() {
                    Some(_) => tok.apply_chat_template(&[ChatMessage::new("user", &e.prompt)])?,
                    None => e.prompt.clone(),
                };
                let mut response = tok.encode(&e.response)?;
                response.extend(eos);
                Ok(TokenEvent { prompt: tok.encode(&prompt)?, response, signal: e.signal })
            })
            .collect()
    }
}

/// An id a caller chose: not empty, not blank (an empty id could not be told apart from "none"
/// in logs and lists).
fn check_id(id: &str) -> Result<(), AdapterError> {
    if id.trim().is_empty() {
        return Err(AdapterError::BadId { id: id.into(), why: "an adapter id must not be empty".into() });
    }
    Ok(())
}

/// The session's form of the set `set` (ids resolved; an id given twice is an error).
fn resolve(
    resident: &[(AdapterId, Arc<LoraAdapter>)],
    set: &[AdapterWeight],
) -> Result<Vec<ActiveAdapter>, AdapterError> {
    set.iter()
        .enumerate()
        .map(|(i, a)| {
            if set[..i].iter().any(|b| b.id == a.id) {
                return Err(AdapterError::DuplicateInSet { id: a.id.clone() });
            }
            Ok(ActiveAdapter::new(find_in(resident, &a.id)?.clone(), a.scale).with_layers(a.layers.clone()))
        })
        .collect()
}

/// The resident adapter `id`.
fn find_in<'a>(resident: &'a [(AdapterId, Arc<LoraAdapter>)], id: &str) -> Result<&'a Arc<LoraAdapter>, AdapterError> {
    resident.iter().find(|(i, _)| i == id).map(|(_, a)| a).ok_or_else(|| AdapterError::UnknownId {
        id: id.to_string(),
        resident: resident.iter().map(|(i, _)| i.clone()).collect(),
    })
}

impl LlmBackend for WgpuBackend {
    fn backend_name(&self) -> &str {
        "wgpu"
    }

    fn load_model(&mut self, path: &Path) -> Result<(), BackendError> {
        self.load_model_with(path, &LoadOptions::default())
    }

    fn unload_model(&mut self) {
        self.loaded = None;
        self.resident.clear();
        self.trainer = None;
    }

    fn is_model_loaded(&self) -> bool {
        self.loaded.is_some()
    }

    fn model_info(&self) -> Option<ModelInfo> {
        self.loaded.as_ref().map(|l| ModelInfo {
            path: l.path.clone(),
            config: l.model.config.clone(),
            device: self.ctx.info.name.clone(),
        })
    }

    fn generate_tokens(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>, BackendError> {
        self.generate_tokens_with(prompt, params, &mut |token, _| on_token(token))
    }

    fn tokenizer(&self) -> Option<Arc<TextTokenizer>> {
        self.loaded.as_ref().and_then(|l| l.tokenizer.clone())
    }

    fn embeddings_ids(&mut self, ids: &[u32]) -> Result<Vec<f32>, BackendError> {
        let conv = self.loaded()?.cur();
        // Refused ids leave the conversation's state and cache as they are.
        conv.session.check_at(ids, 0)?;
        conv.cache.clear();
        let session = &mut conv.session;
        session.reset();
        let hidden = session.final_hidden(ids)?;
        session.reset();
        let h = hidden.len() / ids.len();
        let mut mean = vec![0.0f32; h];
        for row in hidden.chunks(h) {
            mean.iter_mut().zip(row).for_each(|(m, v)| *m += v / ids.len() as f32);
        }
        Ok(mean)
    }

    fn load_adapter(&mut self, path: &Path, scale: f32) -> Result<AdapterId, BackendError> {
        let previous = self.active().to_vec();
        let id = self.preload_adapter(path, None)?;
        if let Err(e) = self.activate_adapter(&id, scale) {
            self.resident.retain(|(i, _)| *i != id);
            return Err(e);
        }
        for old in previous {
            self.forget_unless_shared(&old.id);
        }
        Ok(id)
    }

    fn unload_adapter(&mut self) -> Result<(), BackendError> {
        let previous = self.active().to_vec();
        self.bind(Vec::new())?;
        for old in previous {
            self.forget_unless_shared(&old.id);
        }
        Ok(())
    }

    fn active_adapter(&self) -> Result<Option<ActiveAdapterInfo>, BackendError> {
        Ok(self.active().first().and_then(|a| {
            let adapter = self.find(&a.id).ok()?;
            Some(ActiveAdapterInfo { id: a.id.clone(), scale: a.scale, info: adapter.info.clone() })
        }))
    }

    fn preload_adapter(&mut self, path: &Path, id: Option<&str>) -> Result<AdapterId, BackendError> {
        if let Some(id) = id {
            check_id(id)?;
        }
        let model = self.loaded()?.model.clone();
        let adapter = LoraAdapter::load(&model, path)?;
        let id = self.unique_id(id.unwrap_or(&adapter.info.name));
        self.resident.push((id.clone(), Arc::new(adapter)));
        Ok(id)
    }

    fn activate_adapter(&mut self, id: &str, scale: f32) -> Result<(), BackendError> {
        self.bind(vec![AdapterWeight::new(id, scale)])
    }

    fn deactivate_adapter(&mut self) -> Result<(), BackendError> {
        self.bind(Vec::new())
    }

    fn set_adapter_scale(&mut self, scale: f32) -> Result<(), BackendError> {
        match self.active() {
            [one] => self.bind(vec![AdapterWeight { scale, ..one.clone() }]),
            [] => Err(AdapterError::UnknownId { id: "(active adapter)".into(), resident: Vec::new() }.into()),
            many => Err(AdapterError::SeveralActive { ids: many.iter().map(|a| a.id.clone()).collect() }.into()),
        }
    }

    fn set_adapters(&mut self, set: &[AdapterWeight]) -> Result<(), BackendError> {
        self.bind(set.to_vec())
    }

    fn active_adapters(&self) -> Result<Vec<AdapterWeight>, BackendError> {
        Ok(self.active().to_vec())
    }

    fn list_adapters(&self) -> Result<Vec<(AdapterId, AdapterInfo)>, BackendError> {
        Ok(self.resident.iter().map(|(id, a)| (id.clone(), a.info.clone())).collect())
    }

    fn remove_adapter(&mut self, id: &str) -> Result<(), BackendError> {
        self.find(id)?;
        let resident: Vec<(AdapterId, Arc<LoraAdapter>)> =
            self.resident.iter().filter(|(i, _)| i != id).cloned().collect();
        if let Some(loaded) = self.loaded.as_mut() {
            // Out of every session's set first (each rebinds without it). If one cannot (the
            // GPU out of memory for its new stack), the error is returned and the adapter stays
            // resident; sessions rebound before it keep their new set.
            let mut rebound = Vec::new();
            for c in &loaded.sessions {
                if c.active.iter().any(|a| a.id == id) {
                    let rest: Vec<AdapterWeight> = c.active.iter().filter(|a| a.id != id).cloned().collect();
                    rebound.push((c.id, resolve(&resident, &rest)?, rest));
                }
            }
            for (sid, set, rest) in rebound {
                let c = loaded.sessions.iter_mut().find(|c| c.id == sid).ok_or(BackendError::NoModel)?;
                c.session.set_adapters(set)?;
                c.cache.clear();
                c.active = rest;
            }
        }
        self.forget(id);
        Ok(())
    }

    fn create_trainable_adapter(&mut self, spec: &TrainSpec) -> Result<AdapterId, BackendError> {
        if let Some(id) = &spec.id {
            check_id(id)?;
        }
        let model = self.loaded()?.model.clone();
        let parsed = init_adapter(&model.config, spec)?;
        let adapter = LoraAdapter::upload(&model, &parsed)?;
        let id = parsed.name.clone();
        self.start_training(adapter, &id)
    }

    fn import_trainable_adapter(&mut self, path: &Path) -> Result<AdapterId, BackendError> {
        let model = self.loaded()?.model.clone();
        let adapter = LoraAdapter::load(&model, path)?;
        let id = adapter.info.name.clone();
        self.start_training(adapter, &id)
    }

    fn learn(&mut self, events: &[FeedbackEvent], opts: &LearnOptions) -> Result<LearnReport, BackendError> {
        let tokens = self.tokenize_events(events)?;
        self.learn_tokens(&tokens, opts)
    }

    fn export_trainable_adapter(&mut self, dir: &Path) -> Result<(), BackendError> {
        let (_, trainer) = self.trainer.as_ref().ok_or(LearnError::NoTrainableAdapter)?;
        let model = self.loaded.as_ref().ok_or(BackendError::NoModel)?.model.clone();
        let weights = trainer.weights()?;
        Ok(export_peft(dir, &model, &trainer.adapter, &weights)?)
    }
}

/// Requests (by index, in order) grouped into batches whose sessions apply at most [`MAX_SET`]
/// distinct adapters (scale ≠ 0) together: each request joins the current group unless its
/// adapters would take the group past that, then it starts the next.
fn adapter_groups<'a>(sets: impl Iterator<Item = &'a [ActiveAdapter]>) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut held: Vec<&Arc<LoraAdapter>> = Vec::new();
    for (i, set) in sets.enumerate() {
        let live: Vec<&Arc<LoraAdapter>> = set.iter().filter(|a| a.scale != 0.0).map(|a| &a.adapter).collect();
        let new = live.iter().filter(|a| !held.iter().any(|h| Arc::ptr_eq(h, a))).count();
        let fits = held.len() + new <= MAX_SET;
        if !fits {
            held.clear();
        }
        for a in live {
            if !held.iter().any(|h| Arc::ptr_eq(h, a)) {
                held.push(a);
            }
        }
        match groups.last_mut() {
            Some(group) if fits => group.push(i),
            _ => groups.push(vec![i]),
        }
    }
    groups
}
