// Gated DeltaNet token mixer for one token (decode), in one dispatch: causal conv + SiLU of the
// head's q, k and v channels, the gated delta rule, and the gated RMSNorm of the head's output.
// The same math as gdn_conv.wgsl + gdn_rule.wgsl + norm.wgsl `rms_norm_gated` (see there for the
// formulas), with the per-head work shared instead of repeated: one workgroup per value head
// convolves the head's channels once into workgroup memory, computes the q/k l2 norms once, then
// each invocation updates state columns; the output norm is a workgroup sum. Both sums are summed
// in two levels (`total`): each invocation's strided partial, then CHUNKS chunk sums, then every
// invocation adds the chunks: CHUNK + CHUNKS loads each instead of Dk or Dv.
//
// mixed:      [C + Vd + 2 Hv]  the concatenated input projections' output: in_proj_qkv's (C),
//                           then in_proj_z's, in_proj_b's and in_proj_a's (zba below = from C),
//                           from element mixed_at (0 for a session; a batch's row per session)
// conv_in:    [C, K-1]      conv history before the token; conv_out: after it (another buffer)
// state_in:   [Hv, Dk, Dv]  recurrent state before the token; state_out: after it
// core:       [Vd]          gated-normed output (the input of out_proj), from element core_at
// With a grid of R rows (workgroup_id.y = row r, a batched generation's pooled states), row r
// reads mixed from mixed_at + r (C + Vd + 2 Hv), writes core from core_at + r Vd, and steps the
// states of slot slots[r] (one byte each): conv history slot * C (K-1), recurrent state
// slot * Hv Dk Dv. A grid of one row with slot 0 is the single-session step.
// prm:        [C*K conv taps | A_log (Hv) | dt_bias (Hv) | norm weight (Dv)]
// A value head reads key head h / (Hv / Hk); the first value head of each key head writes that
// key head's q/k conv history (the others read the same inputs and compute the same values).
//
// gdn_decode_lora also writes the LoRA shrink of out_proj's input, split by value head: after the
// grid's R output rows (from core_at + R Vd), row r's part h (of rank_pad = rank rounded up to 4
// floats, the padding zero; part r Hv + h) = A[:, h*Dv .. (h+1)*Dv] . core[h*Dv .. (h+1)*Dv] of
// the row's output, where A is the group's [rank, Vd] shrink matrix; out_proj's matvec sums each
// row's Hv parts in its prologue (matvec.wgsl for one row, matvec_batch.wgsl for 2 to 8: no
// shrink dispatch).

struct Params {       // one GdnParams on the host; gdn_conv.wgsl's and gdn_rule.wgsl's are its first fields
    t: u32,           // 1 here
    c: u32,
    k: u32,
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    eps: f32,
    lora_rank: u32,   // gdn_decode_lora: the rank of the shrink (otherwise unused)
    mixed_at: u32,    // first element of the token's row in mixed (a batch's session row)
    core_at: u32,     // first element of its output row in core
    row0: u32,        // gdn_conv.wgsl's and gdn_rule.wgsl's first row (unused here)
    slots: array<vec4<u32>, 4>, // row r's state slot: byte r % 4 of word r / 4
}

const WG: u32 = 128u;
const CHUNK: u32 = 8u;     // parts per chunk sum
const CHUNKS: u32 = 16u;
const_assert CHUNK * CHUNKS == WG;
const MAX_D: u32 = 256u;   // largest Dk and Dv this kernel takes (the host checks)

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> mixed: array<f32>;
@group(0) @binding(2) var<storage, read> conv_in: array<f32>;
@group(0) @binding(3) var<storage, read_write> conv_out: array<f32>;
@group(0) @binding(4) var<storage, read> state_in: array<f32>;
@group(0) @binding(5) var<storage, read_write> state_out: array<f32>;
@group(0) @binding(6) var<storage, read_write> core: array<f32>;
@group(1) @binding(0) var<storage, read> prm: array<f32>;
@group(2) @binding(0) var<storage, read> lora_a: array<vec4<f32>>; // gdn_decode_lora: A

var<workgroup> qs: array<f32, MAX_D>;
var<workgroup> ks: array<f32, MAX_D>;
var<workgroup> vs: array<f32, MAX_D>;
var<workgroup> os: array<f32, MAX_D>;
var<workgroup> parts: array<vec2<f32>, WG>;
var<workgroup> chunks: array<vec2<f32>, CHUNKS>;

// The workgroup's row: where its token's inputs, output and states start (`rows`).
var<private> mixed_at: u32;
var<private> core_at: u32;
var<private> conv_at: u32;
var<private> state_at: u32;

// Place row r's inputs, output and states (see the header).
fn rows(r: u32) {
    let slot = (p.slots[r / 16u][(r / 4u) % 4u] >> (8u * (r % 4u))) & 0xffu;
    let vd = p.hv * p.dv;
    mixed_at = p.mixed_at + r * (p.c + vd + 2u * p.hv);
    core_at = p.core_at + r * vd;
    conv_at = slot * p.c * (p.k - 1u);
    state_at = slot * p.hv * p.dk * p.dv;
}

// The workgroup's sum of every invocation's `own`, returned to all. Stores `own`, then a barrier,
// so the workgroup-memory writes before the call are visible after it.
fn total(li: u32, own: vec2<f32>) -> vec2<f32> {
    parts[li] = own;
    workgroupBarrier();
    if (li < CHUNKS) {
        var s = vec2<f32>(0.0);
        for (var i = 0u; i < CHUNK; i++) {
            s += parts[li * CHUNK + i];
        }
        chunks[li] = s;
    }
    workgroupBarrier();
    var t = vec2<f32>(0.0);
    for (var c = 0u; c < CHUNKS; c++) {
        t += chunks[c];
    }
    return t;
}

// silu(conv) of channel ch for this token; shifts the history into conv_out when `write`.
fn conv_channel(ch: u32, write: bool) -> f32 {
    let km1 = p.k - 1u;
    var acc = 0.0;
    let at = conv_at + ch * km1;
    for (var j = 0u; j < km1; j++) {
        let v = conv_in[at + j];
        acc = fma(prm[ch * p.k + j], v, acc);
        if (write && j > 0u) {
            conv_out[at + j - 1u] = v;
        }
    }
    let cur = mixed[mixed_at + ch];
    acc = fma(prm[ch * p.k + km1], cur, acc);
    if (write && km1 > 0u) {
        conv_out[at + km1 - 1u] = cur;
    }
    return silu(acc);
}

// State rows i .. i+3 of the column at state_in[sb] (rows Dv apart).
fn state_rows(sb: u32, i: u32) -> vec4<f32> {
    let dv = p.dv;
    return vec4<f32>(state_in[sb + i * dv], state_in[sb + (i + 1u) * dv], state_in[sb + (i + 2u) * dv], state_in[sb + (i + 3u) * dv]);
}

// The head's convolved keys i .. i+3.
fn key_rows(i: u32) -> vec4<f32> {
    return vec4<f32>(ks[i], ks[i + 1u], ks[i + 2u], ks[i + 3u]);
}

// Value head h's step; its output row is left in qs[0..Dv) when `keep` (qs is not read after the
// barrier before the output norm).
fn head_step(h: u32, li: u32, keep: bool) {
    let group = p.hv / p.hk;
    let kh = h / group;
    let kd = p.hk * p.dk;
    let owner = h % group == 0u;
    var own = vec2<f32>(0.0);
    for (var i = li; i < p.dk; i += WG) {
        let q = conv_channel(kh * p.dk + i, owner);
        let k = conv_channel(kd + kh * p.dk + i, owner);
        qs[i] = q;
        ks[i] = k;
        own = fma(vec2<f32>(q, k), vec2<f32>(q, k), own);
    }
    for (var j = li; j < p.dv; j += WG) {
        vs[j] = conv_channel(2u * kd + h * p.dv + j, true);
    }
    let qk = total(li, own);
    let qn = inverseSqrt(qk.x + 1e-6) * inverseSqrt(f32(p.dk));
    let kn = inverseSqrt(qk.y + 1e-6);
    let gates = p.c * p.k;
    let vd = p.hv * p.dv;
    let beta = sigmoid(mixed[mixed_at + p.c + vd + h]);
    let decay = exp(-exp(prm[gates + h]) * softplus(mixed[mixed_at + p.c + vd + p.hv + h] + prm[gates + p.hv + h]));
    // Column j of the state: both sums over its Dk rows four rows at a time (four independent
    // sums, their loads in flight together), then the Dk mod 4 tail.
    var oo = 0.0;
    for (var j = li; j < p.dv; j += WG) {
        let sb = state_at + h * p.dk * p.dv + j;
        var m4 = vec4<f32>(0.0);
        var i = 0u;
        for (; i + 4u <= p.dk; i += 4u) {
            m4 = fma(state_rows(sb, i) * decay, key_rows(i) * kn, m4);
        }
        var mem = (m4.x + m4.y) + (m4.z + m4.w);
        for (; i < p.dk; i++) {
            mem = fma(state_in[sb + i * p.dv] * decay, ks[i] * kn, mem);
        }
        let delta = beta * (vs[j] - mem);
        var o4 = vec4<f32>(0.0);
        i = 0u;
        for (; i + 4u <= p.dk; i += 4u) {
            let s = fma(key_rows(i) * kn, vec4<f32>(delta), state_rows(sb, i) * decay);
            state_out[sb + i * p.dv] = s.x;
            state_out[sb + (i + 1u) * p.dv] = s.y;
            state_out[sb + (i + 2u) * p.dv] = s.z;
            state_out[sb + (i + 3u) * p.dv] = s.w;
            o4 = fma(s, vec4<f32>(qs[i], qs[i + 1u], qs[i + 2u], qs[i + 3u]) * qn, o4);
        }
        var o = (o4.x + o4.y) + (o4.z + o4.w);
        for (; i < p.dk; i++) {
            let s = fma(ks[i] * kn, delta, state_in[sb + i * p.dv] * decay);
            state_out[sb + i * p.dv] = s;
            o = fma(s, qs[i] * qn, o);
        }
        os[j] = o;
        oo = fma(o, o, oo);
    }
    let ss = total(li, vec2<f32>(oo, 0.0)).x;
    let scale = inverseSqrt(ss / f32(p.dv) + p.eps);
    let nw = gates + 2u * p.hv;
    for (var j = li; j < p.dv; j += WG) {
        let zv = mixed[mixed_at + p.c + h * p.dv + j];
        let o = os[j] * scale * prm[nw + j] * silu(zv);
        core[core_at + h * p.dv + j] = o;
        if (keep) {
            qs[j] = o;
        }
    }
}

@compute @workgroup_size(128)
fn gdn_decode(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    rows(wg.y);
    head_step(wg.x, li, false);
}

@compute @workgroup_size(128)
fn gdn_decode_lora(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    let h = wg.x;
    rows(wg.y);
    head_step(h, li, true);
    workgroupBarrier();
    let vd = p.hv * p.dv;
    let rank_pad = (p.lora_rank + 3u) & ~3u;
    let at = p.core_at + nwg.y * vd + (wg.y * p.hv + h) * rank_pad;
    for (var r = li; r < rank_pad; r += WG) {
        var sum = 0.0;
        if (r < p.lora_rank) {
            let a0 = (r * vd + h * p.dv) / 4u;
            for (var q = 0u; q < p.dv / 4u; q++) {
                let j = 4u * q;
                sum += dot(lora_a[a0 + q], vec4<f32>(qs[j], qs[j + 1u], qs[j + 2u], qs[j + 3u]));
            }
        }
        core[at + r] = sum;
    }
}
