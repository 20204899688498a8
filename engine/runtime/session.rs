//! A session: one sequence's caches on one model. Prompts longer than the session's batch are
//! processed in chunks; each chunk is one command buffer.

use std::sync::Arc;

use crate::error::{AdapterError, RunError};
use crate::gpu::{read_f32, GpuContext, IoBindCache};
use crate::lora::LoraAdapter;
use crate::model::Model;
use crate::runtime::cache::{layer_states, rope_table, LayerState, Scratch};
use crate::runtime::forward::{self, Capture, Rows, StepOutput};

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
    /// The logits of row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The last row.
    pub fn last(&self) -> &[f32] {
        self.row(self.rows - 1)
    }
}

/// The adapter a session applies, with the user's scale.
#[derive(Clone)]
pub struct ActiveAdapter {
    /// The resident adapter.
    pub adapter: Arc<LoraAdapter>,
    /// Multiplies alpha / r.
    pub scale: f32,
}

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
    pub(crate) adapter: Option<ActiveAdapter>,
    pub(crate) lora_t: Option<(wgpu::Buffer, usize)>,
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
        let ctx = model.ctx.clone();
        let c = &model.config;
        let scratch = Scratch::new(&ctx, c, opts.max_batch)?;
        let states = layer_states(&ctx, c, opts.max_context)?;
        let ids = ctx.storage_buffer("ids", (opts.max_batch * 4) as u64, true)?;
        let mut table = rope_table(c, opts.max_context);
        table.resize(table.len().max(2), 0.0); // one vec2 even without rotary dims
        let rope = ctx.upload("rope", bytemuck::cast_slice(&table))?;
        let row_bytes = (c.vocab_size * 4) as u64;
        let logits_rows = ((ctx.max_binding() / row_bytes) as usize).clamp(1, opts.max_batch);
        let logits = ctx.storage_buffer("logits", row_bytes * logits_rows as u64, true)?;
        let dispatches = forward::max_dispatches(&model, opts.max_batch, logits_rows);
        let params = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("uniform arena"),
            size: dispatches as u64 * 256,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
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
            io: IoBindCache::new(params),
            adapter: None,
            lora_t: None,
        };
        s.reset();
        Ok(s)
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens in the cache.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The adapter the next step applies.
    pub fn adapter(&self) -> Option<&ActiveAdapter> {
        self.adapter.as_ref()
    }

    /// Apply `adapter` with `scale` from the next step on (`None`: the base model). This binds
    /// other bind groups; nothing is uploaded unless the session's LoRA scratch must grow. The
    /// caches are kept: tokens already in them keep the states computed under the previous
    /// adapter (switching between tokens of one generation). Call [`Session::reset`] to start a
    /// request cleanly under the new adapter. On error nothing changes.
    pub fn set_adapter(&mut self, adapter: Option<(Arc<LoraAdapter>, f32)>) -> Result<(), AdapterError> {
        let Some((adapter, scale)) = adapter else {
            self.adapter = None;
            return Ok(());
        };
        if !scale.is_finite() {
            return Err(AdapterError::BadScale(scale));
        }
        if !adapter.is_for(&self.model) {
            return Err(AdapterError::BadConfig {
                field: "adapter".into(),
                expected: "an adapter loaded for this session's model".into(),
                found: format!("{} (loaded for another model)", adapter.info.name),
            });
        }
        let width = adapter.max_group_rank();
        if self.lora_t.as_ref().is_none_or(|(_, w)| *w < width) {
            let bytes = (self.opts.max_batch * width * 4) as u64;
            let buffer = self.model.ctx.storage_buffer("lora t", bytes, true)?;
            self.lora_t = Some((buffer, width));
        }
        self.adapter = Some(ActiveAdapter { adapter, scale });
        Ok(())
    }

    /// Forget the sequence: zero the GDN states and rewind the position.
    pub fn reset(&mut self) {
        let ctx = &self.model.ctx;
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("reset") });
        for st in &self.states {
            if let LayerState::Gdn { conv, state } = st {
                enc.clear_buffer(conv, 0, None);
                enc.clear_buffer(state, 0, None);
            }
        }
        ctx.queue.submit([enc.finish()]);
        self.pos = 0;
    }

    /// Run `ids` through the model at the current position, extend the caches, and return the
    /// logits of the last token.
    pub fn feed(&mut self, ids: &[u32]) -> Result<Logits, RunError> {
        let out = self.run(ids, false, false)?;
        Ok(out.logits)
    }

    /// Like [`Session::feed`] but returns the logits of every position of `ids`.
    pub fn feed_all(&mut self, ids: &[u32]) -> Result<Logits, RunError> {
        let out = self.run(ids, true, false)?;
        Ok(out.logits)
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
        let out = self.run(ids, true, true)?;
        Ok((out.logits, out.hidden.unwrap_or_default()))
    }

    /// The final-norm hidden states `[T, H]` of `ids` (the input of lm_head), extending the caches.
    pub fn final_hidden(&mut self, ids: &[u32]) -> Result<Vec<f32>, RunError> {
        self.check(ids)?;
        let h = self.model.config.hidden_size;
        let mut out = Vec::with_capacity(ids.len() * h);
        for chunk in ids.chunks(self.opts.max_batch) {
            forward::step(self, chunk, Rows::Hidden, Capture::None)?;
            out.extend(read_f32(self.ctx(), &self.scratch.xnorm, 0, chunk.len() * h)?);
            self.pos += chunk.len();
        }
        Ok(out)
    }

    fn check(&self, ids: &[u32]) -> Result<(), RunError> {
        if ids.is_empty() {
            return Err(RunError::EmptyInput);
        }
        let vocab = self.model.config.vocab_size;
        if let Some((index, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(RunError::TokenOutOfRange { id, index, vocab });
        }
        if self.pos + ids.len() > self.opts.max_context {
            return Err(RunError::ContextFull { needed: self.pos + ids.len(), capacity: self.opts.max_context });
        }
        Ok(())
    }

    fn run(&mut self, ids: &[u32], all: bool, capture: bool) -> Result<StepOutput, RunError> {
        self.check(ids)?;
        let vocab = self.model.config.vocab_size;
        let mut logits = Logits { rows: 0, vocab, data: Vec::new() };
        let mut hidden = None;
        for chunk in ids.chunks(self.opts.max_batch) {
            let tap = if capture { Capture::Layers } else { Capture::None };
            let out = forward::step(self, chunk, if all { Rows::All } else { Rows::Last }, tap)?;
            self.pos += chunk.len();
            if all {
                logits.rows += out.logits.rows;
                logits.data.extend(out.logits.data);
            } else {
                logits = out.logits;
            }
            hidden = out.hidden;
        }
        Ok(StepOutput { logits, hidden })
    }

    pub(crate) fn ctx(&self) -> &GpuContext {
        &self.model.ctx
    }

    pub(crate) fn read_logits(&self, rows: usize) -> Result<Vec<f32>, RunError> {
        Ok(read_f32(self.ctx(), &self.logits, 0, rows * self.model.config.vocab_size)?)
    }
}
