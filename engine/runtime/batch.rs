//! Batched decode: one token of each of several sessions in one step, every session with its
//! own adapter set. The projections run once for all rows (M = N: every weight is read once for
//! the N tokens); the mixers' cores (GDN conv, delta rule and gated norm; attention over the KV
//! cache) run per session on its own states, at its own position. Each row's LoRA comes from one
//! stack of every adapter any row applies, with a scale table of one row per session: a row's
//! factors are 0 on the ranks of adapters its set does not hold (the BGMV idea: one shrink and
//! one fused expand for all rows, each row its own adapters).

use std::sync::Arc;

use crate::error::{AdapterError, GpuError, RunError};
use crate::gpu::{read_f32_via, IoBindCache, Recorder, Staging};
use crate::kernels::attention::{attention_one, AttnOneIo};
use crate::kernels::gdn::{gated_delta, gdn_step, GdnIo, GdnStepIo};
use crate::kernels::misc::{argmax_rows, argmax_scratch_bytes, embed};
use crate::kernels::norm::{rms_norm, rms_norm_gated, NormIo};
use crate::lora::{InputGroup, LoraAdapter, Proj};
use crate::model::{AttnWeights, GdnWeights, Mixer, Model, TextConfig};
use crate::runtime::adapters::{stack_tables, table_base, ActiveAdapter, BoundSet};
use crate::runtime::cache::{LayerState, Scratch};
use crate::runtime::forward::{
    attn_params, block_input, gdn_params, gdn_step_fits, lin, lm_head, mixer_out, mlp_block, norm_rows, project,
    LayerLora, Parts, Shrunk, Src, ATTN_IN, GDN_IN,
};
use crate::runtime::sampler::Sampler;
use crate::runtime::session::{Logits, Session};
use crate::runtime::GenerateParams;

/// Most sessions one batched step takes.
pub const MAX_BATCH_SESSIONS: usize = 64;

/// One row's adapters as the scale table sees them: (adapter address, scale bits, factors).
type RowKey = Vec<(usize, u32, crate::lora::LayerScales)>;

/// The LoRA of a batch: the stack of every adapter the rows apply and the rows' scale tables.
struct BatchLora {
    key: Vec<RowKey>,
    sources: Vec<Arc<LoraAdapter>>,
    bound: BoundSet,
    t: wgpu::Buffer,
}

/// What batched steps reuse: scratch for `rows` tokens, the ids and logits buffers, the bind
/// groups, the LoRA stack and tables of the last set of rows.
pub struct Batch {
    model: Arc<Model>,
    rows: usize,
    scratch: Scratch,
    ids: wgpu::Buffer,
    logits: wgpu::Buffer,
    staging: Staging,
    /// Greedy steps: the rows' block candidates, their (id, non-finite flag) pairs and the
    /// staging those come back through (8 bytes a row).
    argmax_parts: wgpu::Buffer,
    chosen: wgpu::Buffer,
    chosen_staging: Staging,
    io: IoBindCache,
    lora: Option<BatchLora>,
}

/// What a batched step gives `generate`: every row's logits, or every row's greedy choice made
/// on the GPU.
enum StepOut {
    Logits(Logits),
    /// Per row: the chosen id and whether its logits had a NaN or an infinity.
    Chosen(Vec<(u32, bool)>),
}

impl Batch {
    /// Buffers for steps of up to `rows` sessions of `model`.
    pub fn new(model: Arc<Model>, rows: usize) -> Result<Self, RunError> {
        if rows == 0 || rows > MAX_BATCH_SESSIONS {
            return Err(RunError::BadParam {
                name: "rows",
                value: rows.to_string(),
                expected: "1 to 64 sessions (MAX_BATCH_SESSIONS)",
            });
        }
        let ctx = model.ctx.clone();
        let c = &model.config;
        let scratch = Scratch::new(&ctx, c, rows)?;
        let ids = ctx.storage_buffer("batch ids", (rows * 4) as u64, true)?;
        let logits = ctx.storage_buffer("batch logits", (rows * c.vocab_size * 4) as u64, true)?;
        let staging = Staging::new(&ctx, "batch logits readback", (rows * c.vocab_size * 4) as u64);
        let argmax_parts =
            ctx.storage_buffer("batch argmax parts", rows as u64 * argmax_scratch_bytes(c.vocab_size), true)?;
        let chosen = ctx.storage_buffer("batch chosen ids", (rows * 8) as u64, true)?;
        let chosen_staging = Staging::new(&ctx, "batch chosen readback", (rows * 8) as u64);
        let params = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("batch uniform arena"),
            size: 512 * 256,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        Ok(Self {
            model,
            rows,
            scratch,
            ids,
            logits,
            staging,
            argmax_parts,
            chosen,
            chosen_staging,
            io: IoBindCache::new(params),
            lora: None,
        })
    }

    /// Forget the stack of the last rows (its adapters changed: a learning step, a removal).
    pub fn forget_stack(&mut self) {
        self.lora = None;
    }

    /// Whether the kept stack holds `adapter`.
    pub fn holds(&self, adapter: &Arc<LoraAdapter>) -> bool {
        self.lora.as_ref().is_some_and(|l| l.sources.iter().any(|s| Arc::ptr_eq(s, adapter)))
    }

    /// What a step of `sessions` needs that does not depend on their tokens: a row each, the
    /// batch's model, at most `MAX_SET` distinct adapters over all rows.
    fn check_rows(&self, sessions: &[&mut Session]) -> Result<(), RunError> {
        let n = sessions.len();
        if n == 0 || n > self.rows {
            return Err(RunError::BadParam {
                name: "sessions",
                value: format!("{n} sessions"),
                expected: "1 to the batch's rows",
            });
        }
        if sessions.iter().any(|s| !Arc::ptr_eq(&s.model, &self.model)) {
            return Err(RunError::BadParam {
                name: "sessions",
                value: "a session of another model".into(),
                expected: "sessions of the batch's model",
            });
        }
        let mut sources: Vec<&Arc<LoraAdapter>> = Vec::new();
        for a in sessions.iter().flat_map(|s| s.adapters()).filter(|a| a.scale != 0.0) {
            if !sources.iter().any(|s| Arc::ptr_eq(s, &a.adapter)) {
                sources.push(&a.adapter);
            }
        }
        if sources.len() > crate::lora::MAX_SET {
            let e = AdapterError::SetTooLarge { found: sources.len(), limit: crate::lora::MAX_SET };
            return Err(Box::new(e).into());
        }
        Ok(())
    }

    /// The most sessions one step takes.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// One token for each session (`ids[i]` for `sessions[i]`, at its position, under its own
    /// adapter set), in one step; returns every row's logits and commits the token to each
    /// session. Nothing changes on error.
    pub fn step(&mut self, sessions: &mut [&mut Session], ids: &[u32]) -> Result<Logits, RunError> {
        self.submit(sessions, ids, false)?;
        let (ctx, n, vocab) = (&self.model.ctx, sessions.len(), self.model.config.vocab_size);
        let data = read_f32_via(ctx, &self.logits, 0, n * vocab, &self.staging)?;
        commit(sessions);
        Ok(Logits { rows: n, vocab, data })
    }

    /// [`Batch::step`] returning only every row's greedy choice (`sampler::argmax`'s rule, made
    /// on the GPU: 8 bytes a row read back): the id and whether the row had a NaN or an
    /// infinity.
    fn step_greedy(&mut self, sessions: &mut [&mut Session], ids: &[u32]) -> Result<Vec<(u32, bool)>, RunError> {
        let index = self.submit(sessions, ids, true)?;
        let words = self.chosen_staging.read_words(&self.model.ctx, index, 2 * sessions.len())?;
        commit(sessions);
        Ok(words.chunks_exact(2).map(|p| (p[0], p[1] != 0)).collect())
    }

    /// Record and submit one step of every row (with `choose`, the rows' greedy choices copied
    /// into the chosen staging); nothing is committed.
    fn submit(
        &mut self,
        sessions: &mut [&mut Session],
        ids: &[u32],
        choose: bool,
    ) -> Result<wgpu::SubmissionIndex, RunError> {
        let n = sessions.len();
        if ids.len() != n {
            return Err(RunError::BadParam {
                name: "ids",
                value: format!("{n} sessions, {} ids", ids.len()),
                expected: "one id per session",
            });
        }
        self.check_rows(sessions)?;
        for (s, id) in sessions.iter().zip(ids) {
            s.check(std::slice::from_ref(id))?;
        }
        self.bind_lora(sessions)?;
        let model = self.model.clone();
        let ctx = &model.ctx;
        let c = &model.config;
        ctx.write(&self.ids, 0, bytemuck::cast_slice(ids));
        let sc = &self.scratch;
        let mut rec = Recorder::new(ctx, &mut self.io);
        embed(&mut rec, &model.embed, &self.ids, n, &sc.hidden)?;
        for (i, layer) in model.layers.iter().enumerate() {
            let lora = self.lora.as_ref().map(|l| LayerLora { bound: &l.bound, t: &l.t, layer: i });
            let mixer_in = block_input(&mut rec, c, sc, &layer.input_norm, false, lora, InputGroup::MixerIn, n)?;
            match &layer.mixer {
                Mixer::Gdn(w) => gdn_rows(&mut rec, c, sc, w, sessions, i, mixer_in, lora)?,
                Mixer::Attention(w) => attention_rows(&mut rec, c, sc, w, sessions, i, mixer_in, lora)?,
            }
            let mlp_in = block_input(&mut rec, c, sc, &layer.post_norm, false, lora, InputGroup::MlpIn, n)?;
            mlp_block(&mut rec, c, sc, &layer.mlp, mlp_in, lora, n)?;
        }
        rms_norm(&mut rec, &model.norm, &norm_rows(sc, c, 0, n))?;
        lm_head(&mut rec, &model, Src::plain(&sc.xnorm), &self.logits, 0, n)?;
        if choose {
            argmax_rows(&mut rec, &self.logits, &self.argmax_parts, &self.chosen, (c.vocab_size, n))?;
            rec.copy(&self.chosen, 0, self.chosen_staging.buffer(), 0, (8 * n) as u64);
        }
        Ok(rec.submit()?)
    }

    /// Continue every session with its prompt and generate up to `params.max_tokens` tokens for
    /// each, decoding the sessions together: each prompt is prefilled on its own session but
    /// its last token, then every step decodes one token of every session not yet finished (EOS
    /// with `stop_at_eos`, or `max_tokens`; a session whose context fills stops there too, with
    /// what it has, where [`Session::generate`] would return `ContextFull`: the other sessions
    /// go on). Each session samples with its own [`Sampler`] from its row (the whole row is
    /// read back), except plain greedy decoding, whose choice is made on the GPU with
    /// `sampler::argmax`'s rule (ties, NaN) and read back as 8 bytes a row.
    /// `fed[i]` tokens of `prompts[i]` are already in session `i` (a prompt cache's reuse; 0
    /// without one).
    pub fn generate(
        &mut self,
        sessions: &mut [&mut Session],
        prompts: &[&[u32]],
        fed: &[usize],
        params: &GenerateParams,
    ) -> Result<Vec<Vec<u32>>, RunError> {
        let n = sessions.len();
        self.check_rows(sessions)?;
        if prompts.len() != n || fed.len() != n {
            return Err(RunError::BadParam {
                name: "prompts",
                value: format!("{n} sessions, {} prompts, {} fed counts", prompts.len(), fed.len()),
                expected: "one prompt and one fed count per session",
            });
        }
        let mut samplers = Vec::with_capacity(n);
        for (i, s) in sessions.iter().enumerate() {
            if fed[i] >= prompts[i].len() || fed[i] > s.pos {
                return Err(RunError::BadParam {
                    name: "fed",
                    value: format!("{} of a {}-token prompt", fed[i], prompts[i].len()),
                    expected: "fewer tokens than the prompt has, all of them in the session",
                });
            }
            s.check(&prompts[i][fed[i]..])?;
            samplers.push(Sampler::from_params(params)?);
        }
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); n];
        if params.max_tokens == 0 {
            return Ok(out);
        }
        let mut history: Vec<Vec<u32>> = prompts.iter().map(|p| p.to_vec()).collect();
        let mut next: Vec<u32> = Vec::with_capacity(n);
        for (i, s) in sessions.iter_mut().enumerate() {
            let rest = &prompts[i][fed[i]..];
            if rest.len() > 1 {
                s.prefill(&rest[..rest.len() - 1])?;
            }
            next.push(rest[rest.len() - 1]);
        }
        let eos = self.model.eos_token_ids.clone();
        // Plain greedy rows (the same params for every row) are chosen on the GPU.
        let greedy = samplers.first().is_some_and(Sampler::is_plain_greedy);
        let mut live: Vec<usize> = (0..n).collect();
        while !live.is_empty() {
            let step = {
                let mut rows: Vec<&mut Session> = Vec::with_capacity(live.len());
                for (i, s) in sessions.iter_mut().enumerate() {
                    if live.contains(&i) {
                        rows.push(&mut **s);
                    }
                }
                let ids: Vec<u32> = live.iter().map(|&i| next[i]).collect();
                if greedy {
                    StepOut::Chosen(self.step_greedy(&mut rows, &ids)?)
                } else {
                    StepOut::Logits(self.step(&mut rows, &ids)?)
                }
            };
            let mut still = Vec::with_capacity(live.len());
            for (r, &i) in live.iter().enumerate() {
                let (id, finite) = match &step {
                    StepOut::Chosen(c) => (c[r].0, !c[r].1),
                    StepOut::Logits(logits) => {
                        let row = logits.row(r);
                        let finite = row.iter().all(|l| l.is_finite());
                        (if finite { samplers[i].sample_after(row, &history[i]) } else { 0 }, finite)
                    }
                };
                if !finite {
                    return Err(RunError::NonFiniteLogits { position: sessions[i].pos - 1 });
                }
                history[i].push(id);
                out[i].push(id);
                next[i] = id;
                let done = (params.stop_at_eos && eos.contains(&id)) || out[i].len() >= params.max_tokens;
                if !done && sessions[i].pos < sessions[i].opts.max_context {
                    still.push(i);
                }
            }
            live = still;
        }
        Ok(out)
    }

    /// The stack and scale tables for the sets of `sessions` (row `r` = session `r`), reused
    /// while the rows' sets stay the same; `None` when no row applies an adapter.
    fn bind_lora(&mut self, sessions: &[&mut Session]) -> Result<(), RunError> {
        let live =
            |s: &Session| -> Vec<ActiveAdapter> { s.adapters().iter().filter(|a| a.scale != 0.0).cloned().collect() };
        let sets: Vec<Vec<ActiveAdapter>> = sessions.iter().map(|s| live(s)).collect();
        let key: Vec<RowKey> = sets
            .iter()
            .map(|set| {
                set.iter().map(|a| (Arc::as_ptr(&a.adapter) as usize, a.scale.to_bits(), a.layers.clone())).collect()
            })
            .collect();
        if self.lora.as_ref().is_some_and(|l| l.key == key) {
            return Ok(());
        }
        let mut sources: Vec<Arc<LoraAdapter>> = Vec::new();
        for a in sets.iter().flatten() {
            if !sources.iter().any(|s| Arc::ptr_eq(s, &a.adapter)) {
                sources.push(a.adapter.clone());
            }
        }
        if sources.is_empty() {
            self.lora = None;
            return Ok(());
        }
        // The kept stack serves any rows whose adapters it holds (a row that finished, or a
        // session that left, only zeroes factors): no rebuild in the middle of a generation.
        let kept = self
            .lora
            .as_ref()
            .filter(|l| sources.iter().all(|s| l.sources.iter().any(|k| Arc::ptr_eq(k, s))))
            .map(|l| (l.sources.clone(), l.bound.lora.clone()));
        let (sources, stack) = match (kept, sources.as_slice()) {
            (Some(kept), _) => kept,
            (None, [one]) => (sources.clone(), one.clone()),
            (None, _) => {
                let stack = Arc::new(LoraAdapter::stack(&self.model, &sources).map_err(Box::new)?);
                (sources, stack)
            }
        };
        let layers = self.model.config.num_layers();
        let base = table_base(self.rows, &stack);
        let rows: Vec<Vec<&ActiveAdapter>> = sets.iter().map(|s| s.iter().collect()).collect();
        let row_refs: Vec<&[&ActiveAdapter]> = rows.iter().map(|r| r.as_slice()).collect();
        let (table, tables) = stack_tables(&stack, &sources, &row_refs, base, layers);
        let ctx = &self.model.ctx;
        let bytes = ((base + table.len()) * 4) as u64;
        let t = match self.lora.as_ref().filter(|l| l.t.size() >= bytes) {
            Some(l) => l.t.clone(),
            None => ctx.storage_buffer("batch lora t", bytes, true)?,
        };
        ctx.write(&t, (base * 4) as u64, bytemuck::cast_slice(&table));
        let bound = BoundSet { lora: stack, seg_scale: vec![[1.0; 12]; layers], tables };
        self.lora = Some(BatchLora { key, sources, bound, t });
        Ok(())
    }
}

/// A GDN layer for every row: the input projections for all rows, then per session its row
/// through the conv, delta rule and gated norm on its own states (copied into and out of the
/// session's scratch), then out_proj for all rows.
#[allow(clippy::too_many_arguments)]
fn gdn_rows(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &GdnWeights,
    sessions: &[&mut Session],
    layer: usize,
    (src, s): (Src, Option<Shrunk>),
    lora: Option<LayerLora>,
) -> Result<(), GpuError> {
    let n = sessions.len();
    let (cd, vd, hv) = (c.conv_dim(), c.value_dim(), c.linear_value_heads);
    let part = |i: usize| Parts { w: &w.in_proj, order: &GDN_IN, parts: i..i + 1 };
    project(rec, c, part(0), &lin(src.x, &sc.wide_a, n, cd), src, &s)?;
    project(rec, c, part(1), &lin(src.x, &sc.mid_a, n, vd), src, &s)?;
    project(rec, c, part(2), &lin(src.x, &sc.beta, n, hv), src, &s)?;
    project(rec, c, part(3), &lin(src.x, &sc.decay, n, hv), src, &s)?;
    let params = gdn_params(c, 1);
    let f = |e: usize| (e * 4) as u64;
    for (k, sess) in sessions.iter().enumerate() {
        let LayerState::Gdn { conv, state } = &sess.states[layer] else {
            return Err(mismatch(layer));
        };
        let (from, to) = (sess.parity, 1 - sess.parity);
        let own = &sess.scratch;
        if gdn_step_fits(c) {
            let m = &own.mixer_in;
            rec.copy(&sc.wide_a, f(k * cd), m, 0, f(cd));
            rec.copy(&sc.mid_a, f(k * vd), m, f(cd), f(vd));
            rec.copy(&sc.beta, f(k * hv), m, f(cd + vd), f(hv));
            rec.copy(&sc.decay, f(k * hv), m, f(cd + vd + hv), f(hv));
            let io = GdnStepIo {
                mixed: m,
                conv_in: &conv[from],
                conv_out: &conv[to],
                state_in: &state[from],
                state_out: &state[to],
                core: &own.mid_b,
            };
            gdn_step(rec, &w.step_params, &params, &io, None)?;
        } else {
            rec.copy(&sc.wide_a, f(k * cd), &own.wide_a, 0, f(cd));
            rec.copy(&sc.mid_a, f(k * vd), &own.mid_a, 0, f(vd));
            rec.copy(&sc.beta, f(k * hv), &own.beta, 0, f(hv));
            rec.copy(&sc.decay, f(k * hv), &own.decay, 0, f(hv));
            let io = GdnIo {
                mixed: &own.wide_a,
                conv_y: &own.wide_b,
                conv_in: &conv[from],
                conv_out: &conv[to],
                b: &own.beta,
                a: &own.decay,
                core: &own.mid_b,
                state_in: &state[from],
                state_out: &state[to],
            };
            gated_delta(rec, &w.conv_w, &w.gate_p, &params, &io)?;
            let norm = NormIo {
                x: &own.mid_a,
                y: &own.mid_b,
                x_offset: 0,
                y_offset: 0,
                rows: hv,
                n: c.linear_value_dim,
                eps: c.rms_norm_eps,
            };
            rms_norm_gated(rec, &w.norm, &norm)?;
        }
        rec.copy(&own.mid_b, 0, &sc.mid_b, f(k * vd), f(vd));
    }
    mixer_out(rec, c, sc, &w.out_proj, Proj::OutProj, lora, n, None)
}

/// An attention layer for every row: q|gate, k and v for all rows, then per session its row
/// through q/k norm, RoPE at its position, its KV cache and attention, then o_proj for all rows.
#[allow(clippy::too_many_arguments)]
fn attention_rows(
    rec: &mut Recorder,
    c: &TextConfig,
    sc: &Scratch,
    w: &AttnWeights,
    sessions: &[&mut Session],
    layer: usize,
    (src, s): (Src, Option<Shrunk>),
    lora: Option<LayerLora>,
) -> Result<(), GpuError> {
    let n = sessions.len();
    let (q_out, kv, attn) = (2 * c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_heads * c.head_dim);
    let part = |parts| Parts { w: &w.qkv, order: &ATTN_IN, parts };
    project(rec, c, part(0..1), &lin(src.x, &sc.wide_a, n, q_out), src, &s)?;
    project(rec, c, part(1..2), &lin(src.x, &sc.mid_a, n, kv), src, &s)?;
    project(rec, c, part(2..3), &lin(src.x, &sc.mid_c, n, kv), src, &s)?;
    let f = |e: usize| (e * 4) as u64;
    for (k, sess) in sessions.iter().enumerate() {
        let LayerState::Attention { k: k_cache, v: v_cache } = &sess.states[layer] else {
            return Err(mismatch(layer));
        };
        let own = &sess.scratch;
        let m = &own.mixer_in;
        rec.copy(&sc.wide_a, f(k * q_out), m, 0, f(q_out));
        rec.copy(&sc.mid_a, f(k * kv), m, f(q_out), f(kv));
        rec.copy(&sc.mid_c, f(k * kv), m, f(q_out + kv), f(kv));
        let params = attn_params(c, (1, sess.pos, sess.opts.max_context), (q_out, q_out + kv));
        let io = AttnOneIo { qkv: m, k_cache, v_cache, rope: &sess.rope, out: &own.mid_b };
        attention_one(rec, &w.qk_norm, &params, &io, None)?;
        rec.copy(&own.mid_b, 0, &sc.mid_b, f(k * attn), f(attn));
    }
    mixer_out(rec, c, sc, &w.o_proj, Proj::OProj, lora, n, None)
}

/// Every row's session takes the step's token.
fn commit(sessions: &mut [&mut Session]) {
    for s in sessions.iter_mut() {
        s.commit(1);
    }
}

fn mismatch(layer: usize) -> GpuError {
    GpuError::Validation {
        during: format!("layer {layer}"),
        message: "layer state does not match the layer type".into(),
    }
}
