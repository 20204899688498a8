// The gated delta rule, recurrent form, for every token of the step in order (see
// gdn_conv.wgsl for the layouts).
//
//   S = exp(g) S;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q
// with q, k l2-normalised (eps 1e-6 inside the sum), q scaled by Dk^-0.5, beta = sigmoid(b),
// g = -exp(A_log) softplus(a + dt_bias), v-head h reading k-head h / (Hv / Hk).
//
// The state stays in registers for the whole step: it is read from state_in once and written to
// state once (the session's other buffer, so a discarded step leaves the state it started from).
// A workgroup owns BV columns of one head's S; its invocations split the Dk rows into slices of
// RPI rows, invocation (slice r, column j) holding S[r*RPI .. r*RPI + RPI, j]. Per token each
// invocation sums its rows' S^T k (and the slice's q.q, k.k); after a barrier every invocation of
// a column adds up the slices' partials, so mem_j = decay kn (S^T k)_j, updates its rows and sums
// their S'^T q (o from the updated state, as the reference computes it). One barrier per token:
// the slices' S'^T q partials of token t are added up after token t + 1's barrier (the last
// token's after one more), and the partials, outputs and gates are double-buffered (token t
// writes half t % 2, which is written again only after token t + 1's barrier, and every reader
// of token t has passed it by then). The head's beta and decay are found once per token, WG
// tokens at a time into workgroup memory.

struct Params {       // the first fields of gdn_step.wgsl's (one GdnParams on the host)
    t: u32,
    c: u32,
    k: u32,
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    eps: f32,        // gdn_step.wgsl's gated norm (unused here)
    lora_rank: u32,  // gdn_step.wgsl's LoRA shrink (unused here)
    mixed_at: u32,   // gdn_step.wgsl's row offsets (unused here)
    core_at: u32,
    row0: u32,       // the first row of y, b, a and core this dispatch runs (gdn_conv.wgsl)
}

const WG: u32 = 64u;
const RPI: u32 = 32u; // state rows per invocation; Dk <= WG * RPI (the host checks)

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> a: array<f32>;
@group(0) @binding(4) var<storage, read_write> core: array<f32>;
@group(0) @binding(5) var<storage, read> state_in: array<f32>;
@group(0) @binding(6) var<storage, read_write> state: array<f32>;
@group(1) @binding(0) var<storage, read> gate_p: array<f32>;

var<workgroup> part: array<vec4<f32>, 2u * WG>; // 2 x WG: (S^T k of (slice, column), the slice's q.q, k.k, -)
var<workgroup> outs: array<f32, 2u * WG>;        // 2 x WG: S'^T q of (slice, column)
var<workgroup> gates: array<vec2<f32>, 2u * WG>; // 2 x WG: (beta, decay) of the tokens of a block of WG

// Token `tok`'s output in column `col` of core: its slices' S'^T q partials (half tok % 2 of
// outs, in slice order) times its q norm.
fn store_output(tok: u32, slices: u32, bv: u32, jl: u32, col: u32, q_norm: f32) {
    var o = 0.0;
    for (var rr = 0u; rr < slices; rr++) {
        o += outs[(tok % 2u) * WG + rr * bv + jl];
    }
    core[(p.row0 + tok) * p.hv * p.dv + col] = o * q_norm;
}

// Grid: [ceil(Dv / BV), Hv] with BV = WG / ceil(Dk / RPI).
@compute @workgroup_size(64)
fn delta_rule(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let slices = (p.dk + RPI - 1u) / RPI;
    let bv = WG / slices;
    let r = li / bv;
    let jl = li % bv;
    let h = wg.y;
    let j = wg.x * bv + jl;
    let live = r < slices && j < p.dv;
    let i0 = min(r, slices - 1u) * RPI;
    let rows = select(0u, min(RPI, p.dk - i0), live); // rows of S this invocation holds
    let kh = h / (p.hv / p.hk);
    let kd = p.hk * p.dk;
    let sb = h * p.dk * p.dv + j;
    let a_scale = exp(gate_p[h]);
    let dt_bias = gate_p[p.hv + h];
    let q_scale = inverseSqrt(f32(p.dk));

    var s: array<f32, RPI>;
    var kv: array<f32, RPI>;
    var qv: array<f32, RPI>;
    for (var i = 0u; i < RPI; i++) {
        s[i] = 0.0;
        if (i < rows) {
            s[i] = state_in[sb + (i0 + i) * p.dv];
        }
    }
    var q_norm = 0.0; // the previous token's rsqrt(q.q + eps) * Dk^-0.5
    for (var t = 0u; t < p.t; t++) {
        // Every WG tokens, invocation li finds token t + li's beta and decay once for the head,
        // into the block's half of gates (read after this token's barrier).
        let gate_half = ((t / WG) % 2u) * WG;
        if (t % WG == 0u) {
            let tg = t + li;
            if (tg < p.t) {
                let at = (p.row0 + tg) * p.hv + h;
                gates[gate_half + li] = vec2<f32>(sigmoid(b[at]), exp(-a_scale * softplus(a[at] + dt_bias)));
            }
        }
        let qb = (p.row0 + t) * p.c + kh * p.dk + i0;
        let kb = qb + kd;
        var sk = 0.0;
        var qq = 0.0;
        var kk = 0.0;
        // Rows past the slice read whatever follows (WGSL bounds every access) and count as
        // zero, so every invocation runs the same loops, with no branch inside.
        for (var i = 0u; i < RPI; i++) {
            let qi = select(0.0, y[qb + i], i < rows);
            let ki = select(0.0, y[kb + i], i < rows);
            qv[i] = qi;
            kv[i] = ki;
            sk = fma(s[i], ki, sk);
            qq = fma(qi, qi, qq);
            kk = fma(ki, ki, kk);
        }
        let half = (t % 2u) * WG;
        part[half + li] = vec4<f32>(sk, qq, kk, 0.0);
        workgroupBarrier();
        // The previous token's output: its slices' S'^T q partials are complete now.
        if (t > 0u && live && r == 0u) {
            store_output(t - 1u, slices, bv, jl, h * p.dv + j, q_norm);
        }
        var sums = vec3<f32>(0.0);
        for (var rr = 0u; rr < slices; rr++) {
            sums += part[half + rr * bv + jl].xyz;
        }
        let kn = inverseSqrt(sums.z + 1e-6);
        let g = gates[gate_half + t % WG];
        var v = 0.0;
        if (live) {
            v = y[(p.row0 + t) * p.c + 2u * kd + h * p.dv + j];
        }
        let delta = g.x * (v - g.y * kn * sums.x);
        let kd_delta = kn * delta;
        var o = 0.0;
        for (var i = 0u; i < RPI; i++) {
            s[i] = fma(kv[i], kd_delta, s[i] * g.y);
            o = fma(s[i], qv[i], o);
        }
        outs[half + li] = o;
        q_norm = inverseSqrt(sums.y + 1e-6) * q_scale;
    }
    // The last token's output, after one more barrier.
    workgroupBarrier();
    if (p.t > 0u && live && r == 0u) {
        store_output(p.t - 1u, slices, bv, jl, h * p.dv + j, q_norm);
    }
    for (var i = 0u; i < RPI; i++) {
        if (i < rows) {
            state[sb + (i0 + i) * p.dv] = s[i];
        }
    }
}
