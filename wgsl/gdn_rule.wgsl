// The gated delta rule, recurrent form, for every token of the step in order (see
// gdn_conv.wgsl for the layouts). One invocation owns column j of S_h (Dk values): the update
// of a column depends only on that column, so no barriers are needed. The first token reads the
// state from state_in, every write goes to state (the session's other state buffer), so a step
// that is discarded leaves the state it started from.
//
//   S = exp(g) S;  delta = beta (v - S^T k);  S += k delta^T;  o = S^T q
// with q, k l2-normalised (eps 1e-6 inside the sum), q scaled by Dk^-0.5, beta = sigmoid(b),
// g = -exp(A_log) softplus(a + dt_bias), v-head h reading k-head h / (Hv / Hk).

struct Params {
    t: u32,
    c: u32,
    k: u32,
    hk: u32,
    hv: u32,
    dk: u32,
    dv: u32,
    eps: f32,        // gdn_step.wgsl's gated norm (unused here)
    lora_rank: u32,  // gdn_step.wgsl's LoRA shrink (unused here)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> y: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read> a: array<f32>;
@group(0) @binding(4) var<storage, read_write> core: array<f32>;
@group(0) @binding(5) var<storage, read> state_in: array<f32>;
@group(0) @binding(6) var<storage, read_write> state: array<f32>;
@group(1) @binding(0) var<storage, read> gate_p: array<f32>;

// The state before the current token.
fn prev(first: bool, idx: u32) -> f32 {
    if (first) {
        return state_in[idx];
    }
    return state[idx];
}

@compute @workgroup_size(64)
fn delta_rule(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let h = gid.y;
    if (j >= p.dv || h >= p.hv) {
        return;
    }
    let kh = h / (p.hv / p.hk);
    let kd = p.hk * p.dk;
    let vd = p.hv * p.dv;
    let sb = h * p.dk * p.dv + j;
    let a_scale = exp(gate_p[h]);
    let dt_bias = gate_p[p.hv + h];
    let q_scale = inverseSqrt(f32(p.dk));
    for (var t = 0u; t < p.t; t++) {
        let first = t == 0u;
        let qb = t * p.c + kh * p.dk;
        let kb = qb + kd;
        var qq = 0.0;
        var kk = 0.0;
        for (var i = 0u; i < p.dk; i++) {
            qq = fma(y[qb + i], y[qb + i], qq);
            kk = fma(y[kb + i], y[kb + i], kk);
        }
        let qn = inverseSqrt(qq + 1e-6) * q_scale;
        let kn = inverseSqrt(kk + 1e-6);
        let beta = sigmoid(b[t * p.hv + h]);
        let decay = exp(-a_scale * softplus(a[t * p.hv + h] + dt_bias));
        var mem = 0.0;
        for (var i = 0u; i < p.dk; i++) {
            mem = fma(prev(first, sb + i * p.dv) * decay, y[kb + i] * kn, mem);
        }
        let delta = beta * (y[t * p.c + 2u * kd + h * p.dv + j] - mem);
        var o = 0.0;
        for (var i = 0u; i < p.dk; i++) {
            let s = fma(y[kb + i] * kn, delta, prev(first, sb + i * p.dv) * decay);
            state[sb + i * p.dv] = s;
            o = fma(s, y[qb + i] * qn, o);
        }
        core[t * vd + h * p.dv + j] = o;
    }
}
