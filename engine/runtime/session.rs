//! A session: one sequence's caches on one model. Prompts longer than the session's batch are
//! processed in chunks; each chunk is one command buffer.

use std::sync::Arc;

use crate::error::RunError;
use crate::gpu::{read_f32, GpuContext, IoBindCache};
use crate::model::Model;
use crate::runtime::cache::{layer_states, rope_table, LayerState, Scratch};
use crate::runtime::forward::{self, StepOutput};

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
        Self {
            max_context: 2048,
            max_batch: 128,
        }
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

    /// Forget the sequence: zero the GDN states and rewind the position.
    pub fn reset(&mut self) {
        let ctx = &self.model.ctx;
        let mut enc = ctx
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("reset") });
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

    fn run(&mut self, ids: &[u32], all: bool, capture: bool) -> Result<StepOutput, RunError> {
        if ids.is_empty() {
            return Err(RunError::EmptyInput);
        }
        let vocab = self.model.config.vocab_size;
        if let Some((index, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(RunError::TokenOutOfRange { id, index, vocab });
        }
        if self.pos + ids.len() > self.opts.max_context {
            return Err(RunError::ContextFull {
                needed: self.pos + ids.len(),
                capacity: self.opts.max_context,
            });
        }
        let mut logits = Logits {
            rows: 0,
            vocab,
            data: Vec::new(),
        };
        let mut hidden = None;
        for chunk in ids.chunks(self.opts.max_batch) {
            let out = forward::step(self, chunk, all, capture)?;
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
        Ok(read_f32(
            self.ctx(),
            &self.logits,
            0,
            rows * self.model.config.vocab_size,
        )?)
    }
}
