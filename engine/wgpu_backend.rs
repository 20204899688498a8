//! [`WgpuBackend`]: the [`LlmBackend`] of this crate. Adapters stay resident on the GPU;
//! activating, switching or deactivating one changes which bind groups the next step binds.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::{ActiveAdapterInfo, AdapterId, AdapterSwitch, BackendError, LlmBackend, ModelInfo};
use crate::error::{AdapterError, LearnError};
use crate::gpu::GpuContext;
use crate::learn::{
    export_peft, init_adapter, FeedbackEvent, LearnOptions, LearnReport, ModuleGrad, TokenEvent, TrainSpec, Trainer,
};
use crate::lora::{AdapterInfo, LoraAdapter};
use crate::model::{LoadOptions, Model};
use crate::runtime::{GenerateParams, PromptCache, Session, SessionOptions};
use crate::text::{ChatMessage, TextTokenizer};

struct Loaded {
    path: PathBuf,
    model: Arc<Model>,
    session: Session,
    tokenizer: Option<Arc<TextTokenizer>>,
    /// What the session's state can be reused for.
    cache: PromptCache,
    /// `<|im_start|>`, where chat turns start (a snapshot point of the prompt cache).
    turn_start: Option<u32>,
}

/// The wgpu backend: one model, one session, any number of resident adapters, one active.
pub struct WgpuBackend {
    ctx: Arc<GpuContext>,
    opts: SessionOptions,
    loaded: Option<Loaded>,
    resident: Vec<(AdapterId, Arc<LoraAdapter>)>,
    active: Option<(AdapterId, f32)>,
    trainer: Option<(AdapterId, Trainer)>,
}

impl WgpuBackend {
    /// A backend on the default GPU (see [`GpuContext::new`]).
    pub fn new(opts: SessionOptions) -> Result<Self, BackendError> {
        Ok(Self::with_context(Arc::new(GpuContext::new()?), opts))
    }

    /// A backend on an existing context.
    pub fn with_context(ctx: Arc<GpuContext>, opts: SessionOptions) -> Self {
        Self { ctx, opts, loaded: None, resident: Vec::new(), active: None, trainer: None }
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

    /// Bind `active` to the session (nothing else changes on error).
    fn bind(&mut self, active: Option<(AdapterId, f32)>) -> Result<(), BackendError> {
        let adapter = match &active {
            Some((id, scale)) => Some((self.find(id)?.clone(), *scale)),
            None => None,
        };
        let loaded = self.loaded()?;
        loaded.session.set_adapter(adapter)?;
        // Always: `session()` may have bound something else meanwhile, so an unchanged
        // `self.active` does not prove the cached tokens were computed with this adapter.
        loaded.cache.clear();
        self.active = active;
        Ok(())
    }

    /// Drop resident adapter `id` (and its trainer, if it was the trainable one).
    fn forget(&mut self, id: &str) {
        self.resident.retain(|(i, _)| i != id);
        if self.trainer.as_ref().is_some_and(|(t, _)| t == id) {
            self.trainer = None;
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
        let loaded = self.loaded()?;
        loaded.cache.clear();
        Ok(&mut loaded.session)
    }

    /// The prompt cache: a request whose prompt starts with tokens the session already holds
    /// prefills only the rest (see [`PromptCache`]; on by default).
    pub fn prompt_cache(&mut self) -> Result<&mut PromptCache, BackendError> {
        Ok(&mut self.loaded()?.cache)
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
        let mut active = self.active.clone();
        let loaded = self.loaded.as_mut().ok_or(BackendError::NoModel)?;
        let fed = match loaded.cache.prepare(&mut loaded.session, prompt, loaded.turn_start) {
            Ok(fed) => fed,
            Err(e) => {
                loaded.cache.clear();
                return Err(e.into());
            }
        };
        let mut switched = false;
        let out = loaded.session.generate_from_with(prompt, fed, params, |token, session| {
            let mut switch = AdapterSwitch::default();
            let go_on = on_token(token, &mut switch);
            if let Some(request) = switch.request {
                let adapter = match &request {
                    Some((id, scale)) => Some((find_in(resident, id)?.clone(), *scale)),
                    None => None,
                };
                session.set_adapter(adapter)?;
                active = request;
                switched = true;
            }
            Ok::<bool, BackendError>(go_on)
        });
        match &out {
            // Tokens before a switch were computed under another adapter.
            Ok(tokens) if !switched => loaded.cache.finish(&loaded.session, prompt, tokens),
            _ => loaded.cache.clear(),
        }
        self.active = active;
        out
    }

    /// [`LlmBackend::load_model`] with explicit [`LoadOptions`] (e.g. a smaller weight chunk).
    pub fn load_model_with(&mut self, path: &Path, opts: &LoadOptions) -> Result<(), BackendError> {
        let model = Arc::new(Model::load_with(self.ctx.clone(), path, opts)?);
        let tokenizer =
            if path.join("tokenizer.json").is_file() { Some(Arc::new(TextTokenizer::from_dir(path)?)) } else { None };
        let session = Session::new(model.clone(), self.opts.clone())?;
        self.resident.clear();
        self.active = None;
        self.trainer = None;
        let turn_start = tokenizer.as_ref().and_then(|t| t.token_id("<|im_start|>"));
        let cache = PromptCache::default();
        self.loaded = Some(Loaded { path: path.to_path_buf(), model, session, tokenizer, cache, turn_start });
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
            self.resident.retain(|(i, _)| *i != old);
        }
        self.trainer = Some((id.clone(), trainer));
        Ok(id)
    }

    /// The trainable adapter's id, if any.
    pub fn trainable_adapter(&self) -> Option<&str> {
        self.trainer.as_ref().map(|(id, _)| id.as_str())
    }

    /// The session, the trainer and the scale the trainable adapter runs at (its active scale,
    /// or 1 when another adapter is active).
    fn training(&mut self) -> Result<(&mut Session, &mut Trainer, f32), BackendError> {
        let (id, trainer) = self.trainer.as_mut().ok_or(LearnError::NoTrainableAdapter)?;
        let scale = self.active.as_ref().filter(|(a, _)| a == id).map_or(1.0, |(_, s)| *s);
        let loaded = self.loaded.as_mut().ok_or(BackendError::NoModel)?;
        // A step changes the adapter's weights and runs its passes in the session.
        loaded.cache.clear();
        Ok((&mut loaded.session, trainer, scale))
    }

    /// One learning step on token-level events (see [`crate::learn`] for the loss).
    pub fn learn_tokens(&mut self, events: &[TokenEvent], opts: &LearnOptions) -> Result<LearnReport, BackendError> {
        let (session, trainer, scale) = self.training()?;
        Ok(trainer.learn(session, events, opts, scale)?)
    }

    /// The gradients of the loss of `events` with respect to every adapted A and B, without
    /// stepping (the adapter is unchanged): for checks against an autograd oracle.
    pub fn learn_gradients(&mut self, events: &[TokenEvent]) -> Result<Vec<ModuleGrad>, BackendError> {
        let (session, trainer, scale) = self.training()?;
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
        self.active = None;
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
        let loaded = self.loaded()?;
        loaded.cache.clear();
        let session = &mut loaded.session;
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
        let previous = self.active.clone();
        let id = self.preload_adapter(path, None)?;
        if let Err(e) = self.activate_adapter(&id, scale) {
            self.resident.retain(|(i, _)| *i != id);
            return Err(e);
        }
        if let Some((old, _)) = previous {
            self.forget(&old);
        }
        Ok(id)
    }

    fn unload_adapter(&mut self) -> Result<(), BackendError> {
        if let Some((id, _)) = self.active.clone() {
            self.bind(None)?;
            self.forget(&id);
        }
        Ok(())
    }

    fn active_adapter(&self) -> Result<Option<ActiveAdapterInfo>, BackendError> {
        Ok(self.active.as_ref().and_then(|(id, scale)| {
            let adapter = self.find(id).ok()?;
            Some(ActiveAdapterInfo { id: id.clone(), scale: *scale, info: adapter.info.clone() })
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
        self.bind(Some((id.to_string(), scale)))
    }

    fn deactivate_adapter(&mut self) -> Result<(), BackendError> {
        self.bind(None)
    }

    fn set_adapter_scale(&mut self, scale: f32) -> Result<(), BackendError> {
        match self.active.clone() {
            Some((id, _)) => self.bind(Some((id, scale))),
            None => Err(AdapterError::UnknownId { id: "(active adapter)".into(), resident: Vec::new() }.into()),
        }
    }

    fn list_adapters(&self) -> Result<Vec<(AdapterId, AdapterInfo)>, BackendError> {
        Ok(self.resident.iter().map(|(id, a)| (id.clone(), a.info.clone())).collect())
    }

    fn remove_adapter(&mut self, id: &str) -> Result<(), BackendError> {
        self.find(id)?;
        if self.active.as_ref().is_some_and(|(a, _)| a == id) {
            self.bind(None)?;
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
        Ok(export_peft(dir, &model.config, &trainer.adapter, &weights)?)
    }
}
