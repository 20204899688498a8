//! The [`LlmBackend`] trait: how an application embeds an engine. Adapter methods have default
//! implementations that return [`BackendError::AdapterNotSupported`], so a backend that cannot
//! apply adapters says so instead of pretending; [`crate::WgpuBackend`] implements them.

use std::path::{Path, PathBuf};

use crate::error::{AdapterError, GpuError, ModelError, RunError};
use crate::lora::AdapterInfo;
use crate::model::TextConfig;
use crate::runtime::GenerateParams;

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
    /// No model is loaded.
    #[error("no model is loaded")]
    NoModel,
    /// Loading the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// An adapter operation failed (the adapter state is unchanged).
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// Running the model failed.
    #[error(transparent)]
    Run(#[from] RunError),
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

/// An LLM engine as an application embeds it. Generation works on token ids here; text entry
/// points come with the tokenizer.
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

    /// Generate and collect the tokens.
    fn generate(&mut self, prompt: &[u32], params: &GenerateParams) -> Result<Vec<u32>, BackendError> {
        self.generate_tokens(prompt, params, &mut |_| true)
    }

    /// An embedding of `ids`: the mean over positions of the model's final (normalised) hidden
    /// states, `[hidden_size]`.
    fn embeddings(&mut self, ids: &[u32]) -> Result<Vec<f32>, BackendError>;

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

    /// The adapter applied to the next generation.
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

    /// Change the active adapter's scale.
    fn set_adapter_scale(&mut self, scale: f32) -> Result<(), BackendError> {
        let _ = scale;
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

    /// The error the default adapter methods return.
    fn no_adapters(&self) -> BackendError {
        BackendError::AdapterNotSupported { backend: self.backend_name().to_string() }
    }
}
