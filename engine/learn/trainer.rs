//! The trainable adapter's optimiser state and one learning step: the frozen forward (with the
//! live adapter) taps the last layer's mixer and MLP inputs, then one command buffer per event
//! records the backward through lm_head, the final norm, the MLP, the post-attention norm, o_proj,
//! the attention and the q/k norm + RoPE, summing the LoRA gradients; one more records clipping and AdamW on every tensor in place, so the next
//! generation binds the updated weights without any upload.

use std::ops::Range;
use std::sync::Arc;

use crate::error::{GpuError, LearnError};
use crate::gpu::{read_f32, GpuContext, IoBindCache, Recorder};
use crate::kernels::learn::{
    adamw, attention_bwd, ce_grad, lora_grad, matmul_dx, matmul_dx_scratch, norm_rope_bwd, rms_norm_bwd, sum_squares,
    swiglu_bwd, AdamParams, AdamTensor, AttnBwdIo, AttnBwdParams, DxIo, DxWeight, NormRopeBwdParams, View,
};
use crate::kernels::matmul::{linear, linear_rows, Fuse, LinearIo, LoraExpand, WeightRows};
use crate::kernels::misc::swiglu;
use crate::kernels::norm::{rms_norm, NormIo};
use crate::learn::{check_learnable, validate_events, LearnOptions, LearnReport, ModuleGrad, Signal, TokenEvent};
use crate::lora::{InputGroup, LoraAdapter, LoraGroup, LoraMember, Proj};
use crate::model::{Dtype, Mixer, Model};
use crate::runtime::cache::LayerState;
use crate::runtime::session::{Capture, Input, LearnTaps, Rows};
use crate::runtime::Session;

/// One trainable tensor (a group's concatenated A, or one projection's B) and its state.
struct Tensor {
    /// The buffer holding the parameter, from element `offset` (the B matrices of an input
    /// group share one buffer).
    param: wgpu::Buffer,
    offset: usize,
    grad: wgpu::Buffer,
    m: wgpu::Buffer,
    v: wgpu::Buffer,
    anchor: wgpu::Buffer,
    n: usize,
}

/// Activations and gradients of one event's response rows (`rows` ≤ `max_rows`).
struct Buffers {
    /// What the forward copies out for the backward (`LearnTaps`): every row of the event.
    mixer_in: wgpu::Buffer,
    qg: wgpu::Buffer,
    q: wgpu::Buffer,
    kraw: wgpu::Buffer,
    attn_out: wgpu::Buffer,
    hidden: wgpu::Buffer,
    final_norm: wgpu::Buffer,
    dag: wgpu::Buffer,
    dqg: wgpu::Buffer,
    stats: wgpu::Buffer,
    dk: wgpu::Buffer,
    dv: wgpu::Buffer,
    tap: wgpu::Buffer,
    logits: wgpu::Buffer,
    rowinfo: wgpu::Buffer,
    loss: wgpu::Buffer,
    dxn: wgpu::Buffer,
    dh: wgpu::Buffer,
    n2: wgpu::Buffer,
    dn2: wgpu::Buffer,
    g: wgpu::Buffer,
    u: wgpu::Buffer,
    a: wgpu::Buffer,
    du: wgpu::Buffer,
    t: wgpu::Buffer,
    ur: wgpu::Buffer,
    /// The partial products of split `matmul_dx` reductions, and its size in floats.
    dx_slices: (wgpu::Buffer, usize),
}

/// A live adapter being trained.
pub(crate) struct Trainer {
    pub(crate) adapter: Arc<LoraAdapter>,
    model: Arc<Model>,
    layer: usize,
    tensors: Vec<Tensor>,
    /// Tensor index of each input group's A.
    a_of: [Option<usize>; 4],
    /// Tensor index of each projection's B.
    b_of: Vec<(Proj, usize)>,
    norms: wgpu::Buffer,
    io: IoBindCache,
    bufs: Buffers,
    max_rows: usize,
    max_tokens: usize,
    step: u64,
    baseline: f32,
}

/// The group slot of `proj` in `a_of`.
fn slot(group: InputGroup) -> usize {
    group as usize
}

impl Trainer {
    /// Train `adapter` (already uploaded for `model`); events hold at most `max_tokens` tokens.
    pub(crate) fn new(model: &Arc<Model>, adapter: Arc<LoraAdapter>, max_tokens: usize) -> Result<Self, LearnError> {
        let c = &model.config;
        let layer = c.num_layers() - 1;
        if !matches!(model.layers[layer].mixer, Mixer::Attention(_)) {
            return Err(LearnError::NotLearnable {
                layer,
                module: "(last layer)".into(),
                why: "the last layer is not a full-attention layer".into(),
            });
        }
        for &(l, proj) in &adapter.info.modules {
            check_learnable(c, l, proj)?;
        }
        let ctx: &GpuContext = &model.ctx;
        let mut tensors = Vec::new();
        let mut a_of = [None; 4];
        let mut b_of = Vec::new();
        let mut enc = ctx.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("anchors") });
        let mut add = |name: String, param: &wgpu::Buffer, offset: usize, n: usize| -> Result<usize, LearnError> {
            let bytes = (n * 4) as u64;
            let f = |what: &str| ctx.storage_buffer(&format!("{name} {what}"), bytes, true);
            let (grad, m, v, anchor) = (f("grad")?, f("m")?, f("v")?, f("anchor")?);
            let t = Tensor { param: param.clone(), offset, grad, m, v, anchor, n };
            enc.copy_buffer_to_buffer(param, (offset * 4) as u64, &t.anchor, 0, bytes);
            tensors.push(t);
            Ok(tensors.len() - 1)
        };
        for group in [InputGroup::MixerIn, InputGroup::MixerOut, InputGroup::MlpIn, InputGroup::MlpOut] {
            let Some(g) = adapter.group(layer, group) else { continue };
            let [chunk] = g.a.chunks.as_slice() else {
                return Err(LearnError::NotLearnable {
                    layer,
                    module: format!("{group:?} A"),
                    why: "a LoRA A larger than one storage binding".into(),
                });
            };
            a_of[slot(group)] = Some(add(format!("{group:?} A"), &chunk.buffer, 0, g.rank_total * g.a.cols)?);
            for m in &g.members {
                b_of.push((m.proj, add(format!("{} B", m.proj.path()), &g.b, m.b_offset, m.out * m.rank)?));
            }
        }
        ctx.submit(enc.finish(), 0);
        let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let max_rows = ((ctx.max_binding() / (v * 4) as u64) as usize).clamp(1, max_tokens);
        let rank = adapter.max_group_rank().max(1);
        let f = |name: &str, width: usize| ctx.storage_buffer(name, (max_rows * width * 4) as u64, true);
        let all = |name: &str, width: usize| ctx.storage_buffer(name, (max_tokens * width * 4) as u64, true);
        let (attn, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let bufs = Buffers {
            mixer_in: all("learn mixer input", h)?,
            qg: all("learn q_proj output", 2 * attn)?,
            q: all("learn rotated queries", attn)?,
            kraw: all("learn raw keys", kv)?,
            attn_out: all("learn attention output", attn)?,
            hidden: all("learn final residual", h)?,
            final_norm: all("learn final norm", h)?,
            dag: f("learn d attention", attn)?,
            dqg: f("learn d q_proj", 2 * attn)?,
            stats: f("learn softmax stats", 4 * c.num_heads)?,
            dk: all("learn dk", kv)?,
            dv: all("learn dv", kv)?,
            tap: f("learn tap", h)?,
            logits: f("learn logits", v)?,
            rowinfo: f("learn rowinfo", 2)?,
            loss: f("learn loss", 1)?,
            dxn: f("learn dxn", h)?,
            dh: f("learn dh", h)?,
            n2: f("learn n2", h)?,
            dn2: f("learn dn2", h)?,
            g: f("learn g", i)?,
            u: f("learn u", i)?,
            a: f("learn a", i)?,
            du: f("learn du", i)?,
            t: all("learn t", rank)?,
            ur: all("learn ur", rank)?,
            dx_slices: {
                let floats = dx_scratch_floats(model, &adapter, layer, max_rows, max_tokens);
                // A scratch past one binding is not made: matmul_dx then runs every reduction whole.
                let floats = if (floats * 4) as u64 > ctx.max_binding() { 0 } else { floats };
                (ctx.storage_buffer("learn dx slices", (floats.max(1) * 4) as u64, true)?, floats)
            },
        };
        let norms = ctx.storage_buffer("learn norms", (tensors.len() * 4) as u64, true)?;
        Ok(Self {
            adapter,
            model: model.clone(),
            layer,
            tensors,
            a_of,
            b_of,
            norms,
            // The recorder grows the arena to what a learning step records.
            io: IoBindCache::with_arena(ctx, "learn uniform arena", 256 * 256),
            bufs,
            max_rows,
            max_tokens,
            step: 0,
            baseline: 0.5,
        })
    }

    /// Steps taken.
    pub(crate) fn steps(&self) -> u64 {
        self.step
    }

    /// Per-event loss weights `w_e / E` for the current baseline.
    fn coefficients(&self, events: &[TokenEvent]) -> Vec<f32> {
        let e = events.len() as f32;
        events
            .iter()
            .map(|ev| match ev.signal {
                Signal::Preferred => 1.0 / e,
                Signal::Score(s) => (s - self.baseline) / e,
            })
            .collect()
    }

    /// Sum the gradients of `events` into the gradient buffers (running the frozen forward with
    /// the adapter at `scale`); returns each event's mean response cross-entropy.
    fn accumulate(&mut self, session: &mut Session, events: &[TokenEvent], scale: f32) -> Result<Vec<f32>, LearnError> {
        self.check(session, events, None)?;
        let coefs = self.coefficients(events);
        let previous = session.adapters().to_vec();
        session.set_adapter(Some((self.adapter.clone(), scale)))?;
        let mut ce = Vec::with_capacity(events.len());
        let mut result = Ok(());
        for (i, (ev, coef)) in events.iter().zip(&coefs).enumerate() {
            match self.event(session, ev, *coef, scale, i == 0) {
                Ok(c) => ce.push(c),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        session.reset();
        session.set_adapters(previous)?;
        result.map(|_| ce)
    }

    /// Forward and backward of one event; `first` overwrites the gradients instead of adding.
    fn event(
        &mut self,
        session: &mut Session,
        ev: &TokenEvent,
        coef: f32,
        scale: f32,
        first: bool,
    ) -> Result<f32, LearnError> {
        let model = self.model.clone();
        let c = &model.config;
        let (p, r) = (ev.prompt.len(), ev.response.len());
        let ids: Vec<u32> = ev.prompt.iter().chain(&ev.response).copied().collect();
        session.reset();
        let bf = &self.bufs;
        let taps = LearnTaps {
            mixer_in: &bf.mixer_in,
            mlp_in: &bf.tap,
            qg: &bf.qg,
            q: &bf.q,
            kraw: &bf.kraw,
            attn_out: &bf.attn_out,
            hidden: &bf.hidden,
            final_norm: &bf.final_norm,
        };
        let tap = Capture::Learn { layer: self.layer, row0: p - 1, rows: r, taps };
        session.step(Input::Ids(&ids), Rows::Hidden, tap)?;
        let rowinfo: Vec<u32> = ev.response.iter().flat_map(|&t| [t, (coef / r as f32).to_bits()]).collect();
        model.ctx.write(&self.bufs.rowinfo, 0, bytemuck::cast_slice(&rowinfo));
        let Self { io, bufs: b, tensors, a_of, b_of, adapter, layer: li, .. } = self;
        let params = |proj: Proj| -> Option<(&Tensor, &Tensor)> {
            let a = a_of[slot(proj.group())]?;
            let (_, bi) = b_of.iter().find(|(q, _)| *q == proj)?;
            Some((&tensors[a], &tensors[*bi]))
        };
        let mut rec = Recorder::new(&model.ctx, io);
        let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let layer = &model.layers[*li];
        // LoRA gradients of member m over `rows` rows of dy / x / t (t from row t_row0).
        let grads_rows = |rec: &mut Recorder,
                          g: &LoraGroup,
                          m: &LoraMember,
                          dy: (&wgpu::Buffer, usize),
                          x: View,
                          (t_row0, rows): (usize, usize)| match params(m.proj) {
            Some((ta, tb)) => module_grads(rec, b, (ta, tb), g, m, dy, x, (t_row0, rows), m.scaling * scale, first),
            None => Ok(()),
        };
        let grads = |rec: &mut Recorder, g: &LoraGroup, m: &LoraMember, dy: (&wgpu::Buffer, usize), x: View| {
            grads_rows(rec, g, m, dy, x, (0, r))
        };
        // Head: logits of the rows predicting the response, CE gradient, back through lm_head
        // and the final norm: dh = ∂L/∂(residual after the last layer).
        linear(&mut rec, model.output(), &lin(r, &b.final_norm, (p - 1) * h, &b.logits, v), None)?;
        ce_grad(&mut rec, &b.logits, &b.rowinfo, &b.loss, r, v)?;
        matmul_dx(&mut rec, &DxWeight::chunks(model.output()), 0..v, &dx(b, r, &b.logits, v, &b.dxn, h))?;
        let eps = c.rms_norm_eps;
        rms_norm_bwd(&mut rec, &model.norm, (&b.hidden, (p - 1) * h), (&b.dxn, 0), (&b.dh, 0), r, h, eps, false)?;
        // MLP recompute from the tapped input: n2, g, u (with the adapter), a = silu(g)·u.
        let norm = NormIo { x: &b.tap, y: &b.n2, x_offset: 0, y_offset: 0, rows: r, n: h, eps };
        rms_norm(&mut rec, &layer.post_norm, &norm)?;
        let mlp_in = adapter.group(*li, InputGroup::MlpIn);
        if let Some(g) = mlp_in {
            linear(&mut rec, &g.a, &lin(r, &b.n2, 0, &b.t, g.rank_total), None)?;
        }
        let expand = |proj: Proj| -> Option<LoraExpand<'_>> {
            let g = mlp_in?;
            let m = g.member(proj)?;
            Some(LoraExpand::single(
                &b.t,
                (m.t_offset, g.rank_total),
                (m.rank, m.b_offset),
                m.scaling * scale,
                &g.b_bind,
            ))
        };
        let gate_up = &layer.mlp.gate_up;
        let (gate, up) = (WeightRows { w: gate_up, rows: 0..i }, WeightRows { w: gate_up, rows: i..2 * i });
        let (gate_io, up_io) = (lin(r, &b.n2, 0, &b.g, i), lin(r, &b.n2, 0, &b.u, i));
        linear_rows(&mut rec, gate, &gate_io, expand(Proj::GateProj).as_ref(), Fuse::NONE)?;
        linear_rows(&mut rec, up, &up_io, expand(Proj::UpProj).as_ref(), Fuse::NONE)?;
        rec.copy(&b.g, 0, &b.a, 0, (r * i * 4) as u64);
        swiglu(&mut rec, &b.a, &b.u, r * i)?;
        // down_proj: da = dh · W (into du), its LoRA gradients, and da += s · (dh·B) · A.
        matmul_dx(&mut rec, &DxWeight::chunks(&layer.mlp.down_proj), 0..h, &dx(b, r, &b.dh, h, &b.du, i))?;
        if let Some(g) = adapter.group(*li, InputGroup::MlpOut) {
            linear(&mut rec, &g.a, &lin(r, &b.a, 0, &b.t, g.rank_total), None)?;
            for m in &g.members {
                grads(&mut rec, g, m, (&b.dh, h), View { buf: &b.a, offset: 0, stride: i })?;
                let da = DxIo { scale: m.scaling * scale, accumulate: true, ..dx(b, r, &b.ur, m.rank, &b.du, i) };
                matmul_dx(&mut rec, &DxWeight::chunks(&g.a), m.t_offset..m.t_offset + m.rank, &da)?;
            }
        }
        // SwiGLU backward: with da moved into a, a becomes ∂L/∂g and du ∂L/∂u.
        rec.copy(&b.du, 0, &b.a, 0, (r * i * 4) as u64);
        swiglu_bwd(&mut rec, &b.g, &b.u, &b.a, &b.du, r * i)?;
        // dn2 = ∂L/∂(post-norm output), needed only to reach the attention block.
        let o_group = adapter.group(*li, InputGroup::MixerOut);
        let qkv_group = adapter.group(*li, InputGroup::MixerIn);
        let need_mixer = o_group.is_some() || qkv_group.is_some();
        if need_mixer {
            matmul_dx(&mut rec, &DxWeight::chunks(gate_up), 0..i, &dx(b, r, &b.a, i, &b.dn2, h))?;
            let up = DxIo { accumulate: true, ..dx(b, r, &b.du, i, &b.dn2, h) };
            matmul_dx(&mut rec, &DxWeight::chunks(gate_up), i..2 * i, &up)?;
        }
        // gate/up LoRA gradients (t = n2·Aᵀ again: the down shrink reused the buffer).
        if let Some(g) = mlp_in {
            linear(&mut rec, &g.a, &lin(r, &b.n2, 0, &b.t, g.rank_total), None)?;
            for m in &g.members {
                let dy = if m.proj == Proj::GateProj { &b.a } else { &b.du };
                grads(&mut rec, g, m, (dy, i), View { buf: &b.n2, offset: 0, stride: h })?;
                if need_mixer {
                    let dn2 = DxIo { scale: m.scaling * scale, accumulate: true, ..dx(b, r, &b.ur, m.rank, &b.dn2, h) };
                    matmul_dx(&mut rec, &DxWeight::chunks(&g.a), m.t_offset..m.t_offset + m.rank, &dn2)?;
                }
            }
        }
        let Mixer::Attention(attn_w) = &layer.mixer else {
            return Err(LearnError::NotLearnable {
                layer: *li,
                module: "(last layer)".into(),
                why: "the last layer is not a full-attention layer".into(),
            });
        };
        let (hq, hkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let attn = hq * hd;
        // o_proj: dh += the post-attention norm's backward of dn2 (dh is then ∂L/∂o_proj's
        // output), its LoRA gradients from the attention output the forward left in the scratch,
        // and dag = ∂L/∂(gated attention output) = dh · (W + s·B·A).
        if need_mixer {
            rms_norm_bwd(&mut rec, &layer.post_norm, (&b.tap, 0), (&b.dn2, 0), (&b.dh, 0), r, h, eps, true)?;
        }
        if let Some(g) = o_group {
            linear(&mut rec, &g.a, &lin(r, &b.attn_out, (p - 1) * attn, &b.t, g.rank_total), None)?;
            for m in &g.members {
                grads(&mut rec, g, m, (&b.dh, h), View { buf: &b.attn_out, offset: (p - 1) * attn, stride: attn })?;
            }
        }
        if let Some(g) = qkv_group {
            matmul_dx(&mut rec, &DxWeight::chunks(&attn_w.o_proj), 0..h, &dx(b, r, &b.dh, h, &b.dag, attn))?;
            if let Some((og, m)) = o_group.and_then(|g| g.member(Proj::OProj).map(|m| (g, m))) {
                let dag = DxIo { scale: m.scaling * scale, accumulate: true, ..dx(b, r, &b.ur, m.rank, &b.dag, attn) };
                matmul_dx(&mut rec, &DxWeight::chunks(&og.a), m.t_offset..m.t_offset + m.rank, &dag)?;
            }
            // Attention backward, then the q/k norm + RoPE backward in place.
            let LayerState::Attention { k: k_cache, v: v_cache } = &session.states[*li] else {
                return Err(LearnError::NotLearnable {
                    layer: *li,
                    module: "(last layer)".into(),
                    why: "the session's state of the last layer is not an attention cache".into(),
                });
            };
            let keys = p - 1 + r;
            let params = AttnBwdParams {
                rows: r as u32,
                pos0: (p - 1) as u32,
                hq: hq as u32,
                hkv: hkv as u32,
                hd: hd as u32,
                s_max: session.opts.max_context as u32,
                scale: (hd as f32).powf(-0.5),
                _pad: 0,
            };
            let io = AttnBwdIo {
                q: &b.q,
                qg: &b.qg,
                k_cache,
                v_cache,
                dy: &b.dag,
                dqg: &b.dqg,
                stats: &b.stats,
                dk: &b.dk,
                dv: &b.dv,
            };
            attention_bwd(&mut rec, &params, &io, keys)?;
            let rope = NormRopeBwdParams {
                heads: hq as u32,
                hd: hd as u32,
                rot_half: (c.rotary_dim / 2) as u32,
                pos0: (p - 1) as u32,
                x_offset: ((p - 1) * 2 * attn) as u32,
                x_row: (2 * attn) as u32,
                x_head: (2 * hd) as u32,
                y_offset: 0,
                y_row: (2 * attn) as u32,
                y_head: (2 * hd) as u32,
                eps,
                _pad: 0,
            };
            norm_rope_bwd(&mut rec, &attn_w.q_norm, &b.qg, &session.rope, &b.dqg, &rope, r)?;
            let kv = hkv * hd;
            let rope_k = NormRopeBwdParams {
                heads: hkv as u32,
                pos0: 0,
                x_offset: 0,
                x_row: kv as u32,
                x_head: hd as u32,
                y_row: kv as u32,
                y_head: hd as u32,
                ..rope
            };
            norm_rope_bwd(&mut rec, &attn_w.k_norm, &b.kraw, &session.rope, &b.dk, &rope_k, keys)?;
            // LoRA gradients of q (response rows) and k, v (every key row) from the tapped input.
            linear(&mut rec, &g.a, &lin(keys, &b.mixer_in, 0, &b.t, g.rank_total), None)?;
            for m in &g.members {
                let x0 = if m.proj == Proj::QProj { p - 1 } else { 0 };
                let x = View { buf: &b.mixer_in, offset: x0 * h, stride: h };
                let (dy, rows) = match m.proj {
                    Proj::QProj => ((&b.dqg, 2 * attn), r),
                    Proj::KProj => ((&b.dk, kv), keys),
                    _ => ((&b.dv, kv), keys),
                };
                grads_rows(&mut rec, g, m, dy, x, (x0, rows))?;
            }
        }
        rec.submit()?;
        let loss = read_f32(&model.ctx, &b.loss, 0, r)?;
        Ok(loss.iter().sum::<f32>() / r as f32)
    }

    /// What [`Trainer::learn`] (with `opts`) or [`Trainer::gradients`] (without) would refuse
    /// about its input, checked before anything runs.
    pub(crate) fn check(
        &self,
        session: &Session,
        events: &[TokenEvent],
        opts: Option<&LearnOptions>,
    ) -> Result<(), LearnError> {
        if let Some(o) = opts {
            o.validate()?;
        }
        let vocab = self.model.config.vocab_size;
        validate_events(events, vocab, self.max_tokens.min(session.opts.max_context), self.max_rows)
    }

    /// Sum `events`' gradients and return them per module, without stepping.
    pub(crate) fn gradients(
        &mut self,
        session: &mut Session,
        events: &[TokenEvent],
        scale: f32,
    ) -> Result<Vec<ModuleGrad>, LearnError> {
        self.accumulate(session, events, scale)?;
        self.read(|t| (&t.grad, 0))
    }

    /// The adapter's current weights per module.
    pub(crate) fn weights(&self) -> Result<Vec<ModuleGrad>, LearnError> {
        self.read(|t| (&t.param, t.offset))
    }

    fn read(&self, pick: impl Fn(&Tensor) -> (&wgpu::Buffer, usize)) -> Result<Vec<ModuleGrad>, LearnError> {
        let ctx = &self.model.ctx;
        let mut out = Vec::new();
        for group in [InputGroup::MixerIn, InputGroup::MixerOut, InputGroup::MlpIn, InputGroup::MlpOut] {
            let (Some(g), Some(ai)) = (self.adapter.group(self.layer, group), self.a_of[slot(group)]) else {
                continue;
            };
            let (buf, offset) = pick(&self.tensors[ai]);
            let a = read_f32(ctx, buf, offset, self.tensors[ai].n)?;
            for m in &g.members {
                let Some((_, bi)) = self.b_of.iter().find(|(p, _)| *p == m.proj) else { continue };
                let cols = g.a.cols;
                out.push(ModuleGrad {
                    layer: self.layer,
                    proj: m.proj,
                    a: a[m.t_offset * cols..(m.t_offset + m.rank) * cols].to_vec(),
                    b: {
                        let (buf, offset) = pick(&self.tensors[*bi]);
                        read_f32(ctx, buf, offset, self.tensors[*bi].n)?
                    },
                });
            }
        }
        Ok(out)
    }

    /// One optimiser step on `events`: gradients, global-norm clipping, AdamW with the anchor
    /// pull, in place on the live adapter.
    pub(crate) fn learn(
        &mut self,
        session: &mut Session,
        events: &[TokenEvent],
        opts: &LearnOptions,
        scale: f32,
    ) -> Result<LearnReport, LearnError> {
        opts.validate()?;
        let event_ce = self.accumulate(session, events, scale)?;
        if let Some((i, &ce)) = event_ce.iter().enumerate().find(|(_, ce)| !ce.is_finite()) {
            return Err(LearnError::NonFinite { what: format!("loss of event {i}"), value: ce });
        }
        let t = (self.step + 1) as i32;
        let ctx = self.model.ctx.clone();
        let mut rec = Recorder::new(&ctx, &mut self.io);
        for (k, x) in self.tensors.iter().enumerate() {
            sum_squares(&mut rec, &x.grad, &self.norms, x.n, k)?;
        }
        for (k, x) in self.tensors.iter().enumerate() {
            let params = AdamParams {
                n: x.n as u32,
                slot: k as u32,
                slots: self.tensors.len() as u32,
                offset: x.offset as u32,
                lr: opts.lr,
                beta1: opts.beta1,
                beta2: opts.beta2,
                eps: opts.eps,
                weight_decay: opts.weight_decay,
                anchor_l2: opts.anchor_l2,
                bc1: 1.0 - opts.beta1.powi(t),
                bc2: 1.0 - opts.beta2.powi(t),
                max_norm: opts.max_grad_norm,
                ..Default::default()
            };
            let tensor = AdamTensor { grad: &x.grad, param: &x.param, m: &x.m, v: &x.v, anchor: &x.anchor };
            adamw(&mut rec, &tensor, &self.norms, &params)?;
        }
        rec.submit()?;
        let norms = read_f32(&ctx, &self.norms, 0, self.tensors.len())?;
        let total: f32 = norms.iter().sum();
        if !total.is_finite() {
            // adamw.wgsl updated nothing.
            return Err(LearnError::NonFinite { what: "gradient norm".into(), value: total.sqrt() });
        }
        self.step += 1;
        let scores: Vec<f32> =
            events.iter().filter_map(|e| if let Signal::Score(s) = e.signal { Some(s) } else { None }).collect();
        if !scores.is_empty() {
            let mean = scores.iter().sum::<f32>() / scores.len() as f32;
            self.baseline = opts.baseline_momentum * self.baseline + (1.0 - opts.baseline_momentum) * mean;
        }
        Ok(LearnReport { step: self.step, event_ce, grad_norm: total.sqrt(), baseline: self.baseline })
    }
}

/// A linear layer over `m` rows from `x_offset` of x into `y` (row stride `y_stride`).
fn lin<'a>(m: usize, x: &'a wgpu::Buffer, x_offset: usize, y: &'a wgpu::Buffer, y_stride: usize) -> LinearIo<'a> {
    LinearIo { x, x_offset, m, y, y_offset: 0, y_stride, accumulate: false }
}

/// `dx = dy · W` over `m` rows, both from element 0.
fn dx<'a>(
    b: &'a Buffers,
    m: usize,
    dy: &'a wgpu::Buffer,
    dy_stride: usize,
    dx: &'a wgpu::Buffer,
    dx_stride: usize,
) -> DxIo<'a> {
    let slices = Some((&b.dx_slices.0, b.dx_slices.1));
    DxIo { dy, dy_offset: 0, dy_stride, m, dx, dx_offset: 0, dx_stride, scale: 1.0, accumulate: false, slices }
}

/// Member `m`'s B in its group's B buffer seen as a `[_, rank]` matrix, and the rows it takes.
fn b_rows<'a>(g: &'a LoraGroup, m: &LoraMember) -> (DxWeight<'a>, Range<usize>) {
    let b0 = m.b_offset / m.rank;
    let bw = DxWeight { bind_group: &g.b_bind, dtype: Dtype::F32, row_start: 0, rows: b0 + m.out, k: m.rank, sb: 0 };
    (bw, b0..b0 + m.out)
}

/// Floats of scratch the learning step's split `matmul_dx` reductions need: the input gradients
/// through lm_head and the last layer's projections over up to `max_rows` response rows, and
/// through each LoRA B over up to `max_tokens` rows (k and v take every key row).
fn dx_scratch_floats(model: &Model, adapter: &LoraAdapter, li: usize, max_rows: usize, max_tokens: usize) -> usize {
    let c = &model.config;
    let g = model.ctx.min_workgroups();
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let layer = &model.layers[li];
    let mut weights = vec![(model.output(), 0..c.vocab_size), (&layer.mlp.down_proj, 0..h)];
    weights.extend([(&layer.mlp.gate_up, 0..i), (&layer.mlp.gate_up, i..2 * i)]);
    if let Mixer::Attention(a) = &layer.mixer {
        weights.push((&a.o_proj, 0..h));
    }
    let base = weights.into_iter().map(|(w, rows)| matmul_dx_scratch(&DxWeight::chunks(w), rows, max_rows, g));
    let groups = [InputGroup::MixerIn, InputGroup::MixerOut, InputGroup::MlpIn, InputGroup::MlpOut];
    let bs = groups.into_iter().filter_map(|group| adapter.group(li, group)).flat_map(|grp| {
        grp.members.iter().map(move |m| {
            let (bw, rows) = b_rows(grp, m);
            matmul_dx_scratch(&[bw], rows, max_tokens, g)
        })
    });
    base.chain(bs).max().unwrap_or(0)
}

/// dB = s·dyᵀ·t and dA = s·(dy·B)ᵀ·x over `rows` rows for member `m` of group `g` (its shrink
/// `t = x·Aᵀ` already in `b.t`, used from row `t_row0`; dy·B is left in `b.ur` for the caller's
/// input gradient).
#[allow(clippy::too_many_arguments)]
fn module_grads(
    rec: &mut Recorder,
    b: &Buffers,
    (ta, tb): (&Tensor, &Tensor),
    g: &LoraGroup,
    m: &LoraMember,
    dy: (&wgpu::Buffer, usize),
    x: View,
    (t_row0, rows): (usize, usize),
    s: f32,
    first: bool,
) -> Result<(), GpuError> {
    let out = dy.1;
    let dy_view = View { buf: dy.0, offset: 0, stride: out };
    let t_view = View { buf: &b.t, offset: t_row0 * g.rank_total + m.t_offset, stride: g.rank_total };
    let gb = View { buf: &tb.grad, offset: 0, stride: m.rank };
    lora_grad(rec, dy_view, t_view, gb, out, m.rank, rows, s, !first)?;
    let (bw, b_rows) = b_rows(g, m);
    let io = DxIo {
        dy: dy.0,
        dy_offset: 0,
        dy_stride: out,
        m: rows,
        dx: &b.ur,
        dx_offset: 0,
        dx_stride: m.rank,
        scale: 1.0,
        accumulate: false,
        slices: Some((&b.dx_slices.0, b.dx_slices.1)),
    };
    matmul_dx(rec, &[bw], b_rows, &io)?;
    let ga = View { buf: &ta.grad, offset: m.t_offset * g.a.cols, stride: g.a.cols };
    let ur = View { buf: &b.ur, offset: 0, stride: m.rank };
    lora_grad(rec, ur, x, ga, m.rank, g.a.cols, rows, s, !first)
}
