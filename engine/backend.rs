//! The [`LlmBackend`] trait: how an application embeds an engine. Adapter methods have default
//! implementations that return [`BackendError::AdapterNotSupported`], and learning methods
//! [`BackendError::LearningNotSupported`], so a backend that cannot apply adapters or learn says so
//! instead of pretending; [`crate::WgpuBackend`] implements both.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{AdapterError, GpuError, LearnError, ModelError, RunError};
use crate::learn::{FeedbackEvent, LearnOptions, LearnReport, TrainSpec};
use crate::lora::{AdapterInfo, LayerScales};
use crate::model::TextConfig;
use crate::runtime::GenerateParams;
use crate::text::{ChatDelta, ChatReply, ChatRequest, TextError, TextStream, TextTokenizer};

/// The id of a resident adapter.
pub type AdapterId = String;

/// Errors of a backend.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// This backend does not apply LoRA adapters.
    #[error("adapters are not supported by the {backend} backend")]
    AdapterNotSupported {
        /// The backend's name.
        backend: String,
    },
    /// This backend does not learn from feedback.
    #[error("learning from feedback is not supported by the {backend} backend")]
    LearningNotSupported {
        /// The backend's name.
        backend: String,
    },
    /// No model is loaded.
    #[error("no model is loaded")]
    NoModel,
    /// No open session has this id (never created, or closed).
    #[error("no open session with id {id} (open: {open:?})")]
    UnknownSession {
        /// The id asked for.
        id: u64,
        /// The open sessions.
        open: Vec<u64>,
    },
    /// A session limit: more sessions than the backend keeps, or closing the last one.
    #[error("sessions: {why}")]
    Sessions {
        /// What was refused.
        why: String,
    },
    /// The model directory has no tokenizer, so text entry points cannot work.
    #[error("the {backend} backend has no tokenizer for this model (tokenizer.json missing)")]
    NoTokenizer {
        /// The backend's name.
        backend: String,
    },
    /// Tokenizing, detokenizing or rendering the chat template failed.
    #[error(transparent)]
    Text(#[from] TextError),
    /// Loading the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// An adapter operation failed (the adapter state is unchanged).
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// Running the model failed.
    #[error(transparent)]
    Run(#[from] RunError),
    /// A learning step, or creating, importing or exporting a trainable adapter, failed (the
    /// adapter is unchanged).
    #[error(transparent)]
    Learn(#[from] LearnError),
    /// A GPU error.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// What a loaded model is.
#[derive(Clone, Debug)]
pub struct ModelInfo {
    /// The checkpoint directory.
    pub path: PathBuf,
    /// Its text configuration.
    pub config: TextConfig,
    /// The GPU adapter it runs on.
    pub device: String,
}

/// The adapter applied to the next generation.
#[derive(Clone, Debug)]
pub struct ActiveAdapterInfo {
    /// Its id among the resident adapters.
    pub id: AdapterId,
    /// The user's scale (multiplies alpha / r).
    pub scale: f32,
    /// What it is and covers.
    pub info: AdapterInfo,
}

/// One adapter of an active set ([`LlmBackend::set_adapters`]): a resident adapter's id, its
/// scale (multiplies alpha / r; 0 = off) and per-layer / per-projection factors.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterWeight {
    /// The resident adapter's id.
    pub id: AdapterId,
    /// Its scale.
    pub scale: f32,
    /// Factors per (layer, projection) on top of the scale (none: 1 everywhere).
    pub layers: LayerScales,
}

impl AdapterWeight {
    /// Adapter `id` at `scale` on every layer.
    pub fn new(id: impl Into<AdapterId>, scale: f32) -> Self {
        Self { id: id.into(), scale, layers: LayerScales::default() }
    }

    /// With per-layer / per-projection factors.
    pub fn with_layers(self, layers: LayerScales) -> Self {
        Self { layers, ..self }
    }
}

impl From<(&str, f32)> for AdapterWeight {
    fn from((id, scale): (&str, f32)) -> Self {
        Self::new(id, scale)
    }
}

/// A request, made from a token callback, to switch adapters before the next token.
#[derive(Debug, Default)]
pub struct AdapterSwitch {
    pub(crate) request: Option<Option<(AdapterId, f32)>>,
}

impl AdapterSwitch {
    /// Apply resident adapter `id` at `scale` from the next token on.
    pub fn activate(&mut self, id: &str, scale: f32) {
        self.request = Some(Some((id.to_string(), scale)));
    }

    /// Continue with the base model from the next token on.
    pub fn deactivate(&mut self) {
        self.request = Some(None);
    }
}

/// Emits text deltas while holding back any tail that could still become a stop string.
struct StopFilter<'a> {
    stop: &'a [String],
    text: String,
    emitted: usize,
    stopped: bool,
}

impl<'a> StopFilter<'a> {
    fn new(stop: &'a [String]) -> Self {
        Self { stop, text: String::new(), emitted: 0, stopped: false }
    }

    /// Add a delta; returns the text that is safe to emit now.
    fn push(&mut self, delta: &str) -> &str {
        let start = self.emitted;
        self.text.push_str(delta);
        // No stop string starts before what was emitted (the hold-back covers every start that
        // could still complete), so only the rest is searched: linear in the text, not quadratic.
        let rest = &self.text[start..];
        let hit =
            self.stop.iter().filter(|s| !s.is_empty()).filter_map(|s| rest.find(s.as_str())).min().map(|at| start + at);
        let safe = match hit {
            Some(at) => {
                self.stopped = true;
                self.text.truncate(at);
                at
            }
            None => {
                let hold = self.stop.iter().map(|s| s.len().saturating_sub(1)).max().unwrap_or(0);
                let mut cut = self.text.len().saturating_sub(hold).max(start);
                while !self.text.is_char_boundary(cut) {
                    cut -= 1;
                }
                cut.max(start)
            }
        };
        self.emitted = safe;
        &self.text[start..safe]
    }

    /// The held-back tail at the end of generation.
    fn finish(&mut self) -> &str {
        let start = self.emitted;
        self.emitted = self.text.len();
        &self.text[start..]
    }
}

/// One generation's text as its tokens come: decoded as a stream, cut at the first stop string
/// (held back while a tail could still become one), its deltas handed to the caller, who may
/// stop it; once the caller returned `false` it is not called again (not even for the
/// held-back tail).
pub(crate) struct TextOut<'a> {
    stream: TextStream<'a>,
    filter: StopFilter<'a>,
    failure: Option<TextError>,
    caller_stopped: bool,
}

impl<'a> TextOut<'a> {
    pub(crate) fn new(tok: &'a TextTokenizer, stop: &'a [String]) -> Self {
        Self { stream: tok.stream(), filter: StopFilter::new(stop), failure: None, caller_stopped: false }
    }

    /// Take token `id`, handing `on_text` what is safe to emit; whether to go on (no stop
    /// string, the caller did not stop, the decoder did not fail).
    pub(crate) fn token(&mut self, id: u32, on_text: &mut dyn FnMut(&str) -> bool) -> bool {
        if self.caller_stopped || self.filter.stopped || self.failure.is_some() {
            return false;
        }
        match self.stream.step(id) {
            Ok(Some(delta)) => {
                let safe = self.filter.push(&delta);
                self.caller_stopped = !safe.is_empty() && !on_text(safe);
                !self.caller_stopped && !self.filter.stopped
            }
            Ok(None) => true,
            Err(e) => {
                self.failure = Some(e);
                false
            }
        }
    }

    /// Whether decoding failed (the generation then fails: [`TextOut::finish`] returns it).
    pub(crate) fn failed(&self) -> bool {
        self.failure.is_some()
    }

    /// The decoder's failure, taken out (before any request's tail is emitted).
    pub(crate) fn take_failure(&mut self) -> Option<TextError> {
        self.failure.take()
    }

    /// The generation ended: the held-back tail to `on_text`, and the whole text (up to the
    /// stop string), or the decoder's failure.
    pub(crate) fn finish(mut self, on_text: &mut dyn FnMut(&str) -> bool) -> Result<String, TextError> {
        if let Some(e) = self.failure {
            return Err(e);
        }
        // What the decoder still held (an unfinished character at the end) goes through the
        // filter like any delta, unless the text already ended.
        if !self.caller_stopped && !self.filter.stopped {
            if let Some(rest) = self.stream.finish()? {
                let safe = self.filter.push(&rest);
                self.caller_stopped = !safe.is_empty() && !on_text(safe);
            }
        }
        let tail = self.filter.finish().to_string();
        if !tail.is_empty() && !self.caller_stopped {
            on_text(&tail);
        }
        Ok(self.filter.text)
    }
}

/// An LLM engine as an application embeds it: text in, text out (through the model's own
/// tokenizer and chat template), with token-id entry points underneath.
pub trait LlmBackend {
    /// A short name for messages (`"wgpu"`, …).
    fn backend_name(&self) -> &str;

    /// Load a model directory, replacing any loaded model (and dropping its adapters).
    fn load_model(&mut self, path: &Path) -> Result<(), BackendError>;

    /// Drop the model and everything bound to it.
    fn unload_model(&mut self);

    /// Whether a model is loaded.
    fn is_model_loaded(&self) -> bool;

    /// The loaded model.
    fn model_info(&self) -> Option<ModelInfo>;

    /// Generate from `prompt` (a fresh sequence per call), streaming each token to `on_token`,
    /// which returns `false` to stop.
    fn generate_tokens(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Vec<u32>, BackendError>;

    /// Generate from token ids and collect the tokens.
    fn generate_ids(&mut self, prompt: &[u32], params: &GenerateParams) -> Result<Vec<u32>, BackendError> {
        self.generate_tokens(prompt, params, &mut |_| true)
    }

    /// The model's tokenizer (`None` without `tokenizer.json`).
    fn tokenizer(&self) -> Option<Arc<TextTokenizer>> {
        None
    }

    /// Generate from raw `prompt` text (no chat template), streaming text deltas to `on_text`
    /// (return `false` to stop: it is not called again). Deltas never split a UTF-8 character;
    /// generation stops at EOS, `max_tokens` or the first of `params.stop`, which is not
    /// included.
    fn generate_stream(
        &mut self,
        prompt: &str,
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<String, BackendError> {
        let tok = self.tokenizer().ok_or_else(|| BackendError::NoTokenizer { backend: self.backend_name().into() })?;
        let ids = tok.encode(prompt)?;
        self.generate_stream_ids(&ids, params, on_text)
    }

    /// [`LlmBackend::generate_stream`] from token ids (e.g. a rendered chat prompt encoded without
    /// the post-processor's additions).
    fn generate_stream_ids(
        &mut self,
        ids: &[u32],
        params: &GenerateParams,
        on_text: &mut dyn FnMut(&str) -> bool,
    ) -> Result<String, BackendError> {
        let tok = self.tokenizer().ok_or_else(|| BackendError::NoTokenizer { backend: self.backend_name().into() })?;
        let mut text = TextOut::new(&tok, &params.stop);
        self.generate_tokens(ids, params, &mut |id| text.token(id, on_text))?;
        Ok(text.finish(on_text)?)
    }

    /// Generate from raw `prompt` text and return the text.
    fn generate(&mut self, prompt: &str, params: &GenerateParams) -> Result<String, BackendError> {
        self.generate_stream(prompt, params, &mut |_| true)
    }

    /// Render `request` with the model's chat template (tools, `enable_thinking` and other
    /// template variables, `continue_final_message`) and generate the reply, streaming it split
    /// into reasoning, content and complete tool calls (`on_delta` returns `false` to stop).
    /// Generation stops at EOS, `max_tokens` or the first of `params.stop`.
    fn chat(
        &mut self,
        request: &ChatRequest,
        params: &GenerateParams,
        on_delta: &mut dyn FnMut(ChatDelta<'_>) -> bool,
    ) -> Result<ChatReply, BackendError> {
        let tok = self.tokenizer().ok_or_else(|| BackendError::NoTokenizer { backend: self.backend_name().into() })?;
        let prompt = tok.encode_chat(request)?;
        let mut parser = prompt.reply_parser(request.tools.as_deref());
        let mut open = true;
        let mut emit = |d: ChatDelta<'_>| {
            open = open && on_delta(d);
            open
        };
        self.generate_stream_ids(&prompt.ids, params, &mut |delta| parser.push(delta, &mut emit))?;
        Ok(parser.finish(&mut emit))
    }

    /// An embedding of `ids`: the mean over positions of the model's final (normalised) hidden
    /// states, `[hidden_size]`.
    fn embeddings_ids(&mut self, ids: &[u32]) -> Result<Vec<f32>, BackendError>;

    /// An embedding of `text` (see [`LlmBackend::embeddings_ids`] for the pooling).
    fn embeddings(&mut self, text: &str) -> Result<Vec<f32>, BackendError> {
        let tok = self.tokenizer().ok_or_else(|| BackendError::NoTokenizer { backend: self.backend_name().into() })?;
        let ids = tok.encode(text)?;
        self.embeddings_ids(&ids)
    }

    /// Load a PEFT adapter (directory or `.safetensors` file) and apply it with `scale`; the
    /// adapter it replaces is unloaded. A failed load changes nothing.
    fn load_adapter(&mut self, path: &Path, scale: f32) -> Result<AdapterId, BackendError> {
        let _ = (path, scale);
        Err(self.no_adapters())
    }

    /// Stop applying the active adapter and unload it.
    fn unload_adapter(&mut self) -> Result<(), BackendError> {
        Err(self.no_adapters())
    }

    /// The adapter applied to the next generation (the first of the set when several are).
    fn active_adapter(&self) -> Result<Option<ActiveAdapterInfo>, BackendError> {
        Err(self.no_adapters())
    }

    /// Load an adapter and keep it resident without applying it; `id` defaults to its name.
    fn preload_adapter(&mut self, path: &Path, id: Option<&str>) -> Result<AdapterId, BackendError> {
        let _ = (path, id);
        Err(self.no_adapters())
    }

    /// Apply resident adapter `id` with `scale`.
    fn activate_adapter(&mut self, id: &str, scale: f32) -> Result<(), BackendError> {
        let _ = (id, scale);
        Err(self.no_adapters())
    }

    /// Stop applying any adapter (it stays resident).
    fn deactivate_adapter(&mut self) -> Result<(), BackendError> {
        Err(self.no_adapters())
    }

    /// Change the active adapter's scale (an error while several are active).
    fn set_adapter_scale(&mut self, scale: f32) -> Result<(), BackendError> {
        let _ = scale;
        Err(self.no_adapters())
    }

    /// Replace the whole active set in one call: every resident adapter listed applies with its
    /// scale and factors, their deltas summed as peft sums several active adapters (an empty
    /// list: the base model). Setting the same set again changes nothing. On error (an unknown
    /// id, an id given twice, a bad scale or factor) the active set is unchanged.
    fn set_adapters(&mut self, set: &[AdapterWeight]) -> Result<(), BackendError> {
        let _ = set;
        Err(self.no_adapters())
    }

    /// The active set, as last given (the single-adapter calls set a set of one).
    fn active_adapters(&self) -> Result<Vec<AdapterWeight>, BackendError> {
        Err(self.no_adapters())
    }

    /// The resident adapters.
    fn list_adapters(&self) -> Result<Vec<(AdapterId, AdapterInfo)>, BackendError> {
        Err(self.no_adapters())
    }

    /// Unload resident adapter `id` (deactivating it if active).
    fn remove_adapter(&mut self, id: &str) -> Result<(), BackendError> {
        let _ = id;
        Err(self.no_adapters())
    }

    /// Create a trainable LoRA adapter (PEFT initialisation: B = 0, so generation is unchanged
    /// until the first step), make it resident and active at scale 1. Steps update it in place.
    fn create_trainable_adapter(&mut self, spec: &TrainSpec) -> Result<AdapterId, BackendError> {
        let _ = spec;
        Err(self.no_learning())
    }

    /// Load a PEFT adapter to continue training it (its weights become the anchor), resident and
    /// active at scale 1.
    fn import_trainable_adapter(&mut self, path: &Path) -> Result<AdapterId, BackendError> {
        let _ = path;
        Err(self.no_learning())
    }

    /// One learning step on a batch of feedback events; the next generation uses the result. The
    /// step runs its forward passes in the backend's session, so a sequence left there is reset.
    fn learn(&mut self, events: &[FeedbackEvent], opts: &LearnOptions) -> Result<LearnReport, BackendError> {
        let _ = (events, opts);
        Err(self.no_learning())
    }

    /// Write the trainable adapter as a PEFT directory (`adapter_config.json` +
    /// `adapter_model.safetensors`).
    fn export_trainable_adapter(&mut self, dir: &Path) -> Result<(), BackendError> {
        let _ = dir;
        Err(self.no_learning())
    }

    /// The error of the learning defaults.
    fn no_learning(&self) -> BackendError {
        BackendError::LearningNotSupported { backend: self.backend_name().into() }
    }

    /// The error the default adapter methods return.
    fn no_adapters(&self) -> BackendError {
        BackendError::AdapterNotSupported { backend: self.backend_name().to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::StopFilter;

    fn run(stop: &[&str], deltas: &[&str]) -> (String, String, bool) {
        let stop: Vec<String> = stop.iter().map(|s| s.to_string()).collect();
        let mut f = StopFilter::new(&stop);
        let mut streamed = String::new();
        for d in deltas {
            streamed.push_str(f.push(d));
            if f.stopped {
                break;
            }
        }
        streamed.push_str(f.finish());
        (streamed, f.text.clone(), f.stopped)
    }

    /// The demo model's tokenizer (a byte-level BPE, as Qwen's).
    fn demo() -> crate::TextTokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/assets/demo");
        crate::TextTokenizer::from_dir(&dir).expect("demo tokenizer")
    }

    /// Deltas and text of `ids` through a `TextOut` with no stop strings.
    fn streamed(tok: &crate::TextTokenizer, ids: &[u32]) -> (String, String) {
        let mut out = super::TextOut::new(tok, &[]);
        let mut deltas = String::new();
        for &id in ids {
            assert!(out.token(id, &mut |d| {
                deltas.push_str(d);
                true
            }));
        }
        let text = out
            .finish(&mut |d| {
                deltas.push_str(d);
                true
            })
            .expect("finish");
        (deltas, text)
    }

    #[test]
    fn a_character_left_unfinished_at_the_end_comes_out_as_decoding_gives_it() {
        let tok = demo();
        let id = |t: &str| tok.token_id(t).unwrap_or_else(|| panic!("token {t}"));
        // "a", then the first byte of a three-byte character (byte-level token "ä" is 0xE4), and
        // a literal U+FFFD (bytes EF BF BD) at the very end.
        let unfinished = [id("a"), id("ä")];
        let replacement = [id("a"), id("ï"), id("¿"), id("½")];
        for ids in [&unfinished[..], &replacement[..]] {
            let whole = tok.decode(ids).expect("decode");
            assert!(whole.ends_with('\u{FFFD}'), "{whole:?}");
            assert_eq!(streamed(&tok, ids), (whole.clone(), whole), "{ids:?}");
        }
    }

    #[test]
    fn stop_strings_cut_the_text_and_are_never_streamed() {
        assert_eq!(run(&["END"], &["hello E", "N", "D more"]), ("hello ".into(), "hello ".into(), true));
        assert_eq!(run(&["xx", "END"], &["aEN", "Xb"]), ("aENXb".into(), "aENXb".into(), false));
        assert_eq!(run(&[], &["é", "ü"]), ("éü".into(), "éü".into(), false));
        assert_eq!(run(&["ü!"], &["aé", "ü", "!"]), ("aé".into(), "aé".into(), true));
    }

    /// Split into one-character deltas and into two deltas at every boundary, each text gives
    /// what cutting the whole text at its first stop string gives.
    #[test]
    fn stop_strings_are_found_however_the_text_is_split() {
        let stops: &[&[&str]] = &[&["abcab"], &["ab", "bca"], &["é!é", "zz"], &["cabx"]];
        for text in ["xxabcabcabx", "abcab", "zé!é!éz", "ababcabca", "no stop here"] {
            for stop in stops {
                let want = stop.iter().filter_map(|s| text.find(s)).min().map_or(text, |at| &text[..at]);
                let chars: Vec<String> = text.chars().map(String::from).collect();
                let one: Vec<&str> = chars.iter().map(String::as_str).collect();
                assert_eq!(run(stop, &one).0, want, "{text:?} by characters, stops {stop:?}");
                for (at, _) in text.char_indices() {
                    assert_eq!(
                        run(stop, &[&text[..at], &text[at..]]).0,
                        want,
                        "{text:?} split at {at}, stops {stop:?}"
                    );
                }
            }
        }
    }
}
