//! One step of a session: the embedding, the layer loop of `forward.rs`, the final norm and what
//! the step's rows ask for (logits, hidden states, a greedy choice or sampling candidates), recorded
//! into one command buffer and submitted.

use crate::error::{GpuError, RunError};
use crate::gpu::{GpuContext, GpuWeight, Recorder};
use crate::kernels::misc::{argmax, embed};
use crate::lora::InputGroup;
use crate::model::Mixer;
use crate::runtime::cache::{LayerState, Scratch};
use crate::runtime::forward::{
    attention_block, block_input, folds_norm, gdn_block, head_input, lm_head, mlp_block, residual_out, LayerLora,
    NextReads, NextWrites, Src,
};

use super::{Logits, Session};

pub(crate) struct StepOutput {
    pub logits: Logits,
    pub hidden: Option<Vec<f32>>,
    /// The submission of the step's layers (a greedy choice is ready when it completes).
    pub index: wgpu::SubmissionIndex,
}

/// A step's tokens.
#[derive(Clone, Copy)]
pub(crate) enum Input<'a> {
    /// Ids from the host.
    Ids(&'a [u32]),
    /// The one id an earlier step's greedy choice left in the session's id buffer.
    Chosen,
}

fn capture_slot(rec: &mut Recorder, sc: &Scratch, dst: Option<&wgpu::Buffer>, slot: usize, bytes: u64) {
    if let Some(dst) = dst {
        rec.copy(&sc.hidden, 0, dst, slot as u64 * bytes, bytes);
    }
}

/// What a step copies out of the residual stream besides its result.
#[derive(Clone, Copy)]
pub(crate) enum Capture<'a> {
    /// Nothing.
    None,
    /// The residual stream after the embedding and after every layer (`[L+1, T, H]`).
    Layers,
    /// What a learning step differentiates, from the attention layer `layer` (see [`LearnTaps`]),
    /// with rows `row0..row0 + rows` of the residual stream entering its MLP.
    Learn { layer: usize, row0: usize, rows: usize, taps: LearnTaps<'a> },
}

/// Where a learning step's forward copies what the backward reads, each from element 0 and for
/// every row of the step unless said otherwise (`T` rows).
#[derive(Clone, Copy)]
pub(crate) struct LearnTaps<'a> {
    /// The layer's normalised mixer input `[T, H]`.
    pub mixer_in: &'a wgpu::Buffer,
    /// Rows `row0..row0 + rows` of the residual entering the layer's MLP `[rows, H]`.
    pub mlp_in: &'a wgpu::Buffer,
    /// q_proj's output (query and gate per head) `[T, 2·Hq·hd]`.
    pub qg: &'a wgpu::Buffer,
    /// The normed, rotated queries `[T, Hq·hd]`.
    pub q: &'a wgpu::Buffer,
    /// k_proj's output `[T, Hkv·hd]`.
    pub kraw: &'a wgpu::Buffer,
    /// The gated attention output (o_proj's input) `[T, Hq·hd]`.
    pub attn_out: &'a wgpu::Buffer,
    /// The residual after the last layer `[T, H]`.
    pub hidden: &'a wgpu::Buffer,
    /// The final norm's output `[T, H]`.
    pub final_norm: &'a wgpu::Buffer,
}

/// Which positions of a step get the final norm and lm_head.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Rows {
    /// The last position: logits for sampling.
    Last,
    /// Every position's logits.
    All,
    /// Every position's final-norm hidden state, no logits.
    Hidden,
    /// The last position's greedy choice, made on the GPU: the id goes into the session's id
    /// buffer (the next step's input) and into its choice staging slot; nothing is read back here.
    Choose {
        /// The staging slot (of two) the id is copied into.
        slot: usize,
    },
    /// The last position's sampling candidates, found on the GPU: the `k` best logits outside
    /// the `hist` history ids the session uploaded, and the history's own logits, copied into the
    /// session's candidate staging; nothing is read back here.
    Sample {
        /// Candidates.
        k: usize,
        /// Distinct history ids.
        hist: usize,
        /// For sampling without top-k: the inverse temperature at which the candidate pass's
        /// blocks' softmax masses are copied out after the flag.
        mass: Option<f32>,
    },
}

impl Session {
    /// Record and submit one step of `input` (at most `max_batch` tokens) at the session's position.
    /// The GDN layers read the state pair at the session's parity and write the other one: the step
    /// takes effect when the caller commits it ([`Session::commit`]).
    pub(crate) fn step(&mut self, input: Input, rows: Rows, capture: Capture) -> Result<StepOutput, RunError> {
        let model = self.model.clone();
        let ctx: &GpuContext = &model.ctx;
        let c = &model.config;
        let t = match input {
            Input::Ids(ids) => {
                ctx.write(&self.ids, 0, bytemuck::cast_slice(ids));
                ids.len()
            }
            Input::Chosen => 1,
        };
        let h = c.hidden_size;
        let (from, to) = (self.parity, 1 - self.parity);
        let slot_bytes = (t * h * 4) as u64;
        let row = (h * 4) as u64;
        let captured = if matches!(capture, Capture::Layers) {
            Some(ctx.storage_buffer("hidden capture", slot_bytes * (c.num_layers() as u64 + 1), false)?)
        } else {
            None
        };
        let last = matches!(rows, Rows::Last | Rows::Choose { .. } | Rows::Sample { .. });
        let (r0, n) = if last { (t - 1, 1) } else { (0, t) };
        let first_rows = if rows == Rows::Hidden { 0 } else { n.min(self.logits_rows) };
        // Rows whose normalised values nobody reads back (not learning, not the final hidden
        // states, every logits row in this step's lm_head): each block norm goes into the
        // projections that read it and their shrink (no dispatch of its own) where they take it
        // (one token, or the batched matvec's 2 to 8: `folds_norm`), and the final norm into
        // lm_head where its rows take it (one row, the last, whatever the step's length). One
        // token also folds the SwiGLU product, and each residual projection writes the next
        // block's input.
        let foldable =
            self.fused && rows != Rows::Hidden && !matches!(capture, Capture::Learn { .. }) && first_rows == n;
        let fold = |w: &GpuWeight| foldable && folds_norm(w, t);
        let chain = foldable && t == 1;
        // One token not captured for learning: attention runs q|k|v in one dispatch, read in place.
        let one = t == 1 && !matches!(capture, Capture::Learn { .. });
        // Snapshots asked for inside the step or at its end (`Session::snapshot_at`).
        let taps = self.step_taps(t)?;
        let index = {
            let sc = &self.scratch;
            let mut rec = Recorder::new(ctx, &mut self.io).profiled(self.profile.as_mut());
            embed(&mut rec, &model.embed, &self.ids, t, &sc.hidden)?;
            capture_slot(&mut rec, sc, captured.as_ref(), 0, slot_bytes);
            let active = self.lora.bound.as_ref().zip(self.lora.t.as_ref());
            let layer_lora = |i: usize| active.map(|(bound, (t, _))| LayerLora { bound, t, layer: i });
            // With the norms folded, each residual projection also writes the next block's input
            // shrink (no shrink dispatch but layer 0's mixer input's) and its input through the
            // block's norm weight (lm_head's too).
            let next_writes = |i: usize, group, norm, w| {
                if chain {
                    residual_out(ctx, layer_lora(i), (group, norm), w, &sc.hidden)
                } else {
                    (NextWrites::default(), NextReads::default())
                }
            };
            let mut written = NextReads::default();
            let mut gdn_layers = 0;
            for (i, layer) in model.layers.iter().enumerate() {
                let lora = layer_lora(i);
                let mixer_in = block_input(
                    &mut rec,
                    c,
                    sc,
                    &layer.input_norm,
                    fold(layer.mixer.input_weight()),
                    lora,
                    (InputGroup::MixerIn, std::mem::take(&mut written)),
                    t,
                )?;
                let mixer_w = match &layer.mixer {
                    Mixer::Gdn(w) => &w.out_proj,
                    Mixer::Attention(w) => &w.o_proj,
                };
                let (to_mlp, mlp_reads) = next_writes(i, Some(InputGroup::MlpIn), &layer.post_norm, mixer_w);
                if let Capture::Learn { layer, taps, .. } = capture {
                    if layer == i {
                        rec.copy(&sc.xnorm, 0, taps.mixer_in, 0, t as u64 * row);
                    }
                }
                match (&layer.mixer, &self.states[i]) {
                    (Mixer::Gdn(w), LayerState::Gdn { conv, state }) => {
                        let g = gdn_layers;
                        gdn_layers += 1;
                        let states = ([&conv[from], &conv[to]], [&state[from], &state[to]], &taps.splits(g)[..]);
                        gdn_block(&mut rec, c, sc, w, states, mixer_in, (lora, to_mlp), t)?;
                        for [conv_at, state_at] in taps.at_end(g) {
                            rec.copy(&conv[to], 0, conv_at, 0, conv[to].size());
                            rec.copy(&state[to], 0, state_at, 0, state[to].size());
                        }
                    }
                    (Mixer::Attention(w), LayerState::Attention { k, v }) => {
                        let cache = (k, v);
                        let rope = &self.rope;
                        attention_block(
                            &mut rec,
                            c,
                            sc,
                            w,
                            cache,
                            rope,
                            self.pos,
                            self.opts.max_context,
                            mixer_in,
                            (lora, to_mlp),
                            (t, one),
                        )?
                    }
                    _ => {
                        return Err(RunError::Gpu(GpuError::Validation {
                            during: format!("layer {i}"),
                            message: "layer state does not match the layer type".into(),
                        }))
                    }
                }
                if let Capture::Learn { layer, row0, rows, taps } = capture {
                    if layer == i {
                        // The attention block's activations (its single-token path is not taken when
                        // learning, so they are in the per-projection buffers).
                        let (attn, kv) =
                            ((c.num_heads * c.head_dim * 4) as u64, (c.num_kv_heads * c.head_dim * 4) as u64);
                        let tt = t as u64;
                        rec.copy(&sc.wide_a, 0, taps.qg, 0, tt * 2 * attn);
                        rec.copy(&sc.wide_b, 0, taps.q, 0, tt * attn);
                        rec.copy(&sc.mid_a, 0, taps.kraw, 0, tt * kv);
                        rec.copy(&sc.mid_b, 0, taps.attn_out, 0, tt * attn);
                        rec.copy(&sc.hidden, row0 as u64 * row, taps.mlp_in, 0, rows as u64 * row);
                    }
                }
                let mlp_fold = fold(&layer.mlp.gate_up);
                let mlp_in =
                    block_input(&mut rec, c, sc, &layer.post_norm, mlp_fold, lora, (InputGroup::MlpIn, mlp_reads), t)?;
                // The next layer's input, or lm_head's after the last.
                let (group, next_norm) = match model.layers.get(i + 1) {
                    Some(n) => (Some(InputGroup::MixerIn), &n.input_norm),
                    None => (None, &model.norm),
                };
                let to_next;
                (to_next, written) = next_writes(i + 1, group, next_norm, &layer.mlp.down_proj);
                mlp_block(&mut rec, c, sc, &layer.mlp, mlp_in, (lora, to_next), t)?;
                capture_slot(&mut rec, sc, captured.as_ref(), i + 1, slot_bytes);
            }
            let head_fold = foldable && folds_norm(model.output(), first_rows);
            let head_src = head_input(&mut rec, &model, sc, (head_fold, written.input), (r0, n))?;
            if let Capture::Learn { taps, .. } = capture {
                rec.copy(&sc.hidden, 0, taps.hidden, 0, t as u64 * row);
                rec.copy(&sc.xnorm, 0, taps.final_norm, 0, t as u64 * row);
            }
            if first_rows > 0 {
                lm_head(&mut rec, &model, head_src, &self.logits, r0, first_rows)?;
            }
            if let Rows::Choose { slot } = rows {
                // The id and the row's non-finite flag.
                argmax(&mut rec, &self.logits, &self.parts, &self.ids, c.vocab_size)?;
                rec.copy(&self.ids, 0, self.chosen[slot].buffer(), 0, 8);
            }
            if let Rows::Sample { k, hist, mass } = rows {
                let b = &self.sample;
                // The row's non-finite flag, before the mask overwrites the history's logits (with
                // the lowest key, a NaN pattern); the argmax's id is not used.
                argmax(&mut rec, &self.logits, &self.parts, &b.flag, c.vocab_size)?;
                b.record(&mut rec, &self.logits, (&b.flag, 4), c.vocab_size, (k, hist, mass))?;
            }
            let index = rec.submit()?;
            self.step_taken(taps);
            if let Rows::Choose { .. } | Rows::Sample { .. } = rows {
                let logits = Logits { rows: 0, vocab: c.vocab_size, data: Vec::new() };
                return Ok(StepOutput { logits, hidden: None, index });
            }
            index
        };
        let mut data = self.read_logits(first_rows)?;
        let mut done = first_rows;
        while done < n && rows != Rows::Hidden {
            let rows = (n - done).min(self.logits_rows);
            let mut rec = Recorder::new(ctx, &mut self.io).profiled(self.profile.as_mut());
            lm_head(&mut rec, &model, Src::plain(&self.scratch.xnorm), &self.logits, r0 + done, rows)?;
            rec.submit()?;
            data.extend(self.read_logits(rows)?);
            done += rows;
        }
        let hidden = match &captured {
            Some(buf) => Some(crate::gpu::read_f32(ctx, buf, 0, (c.num_layers() + 1) * t * h)?),
            None => None,
        };
        Ok(StepOutput { logits: Logits { rows: done, vocab: c.vocab_size, data }, hidden, index })
    }
}
