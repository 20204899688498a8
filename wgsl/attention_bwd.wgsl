// Backward of the gated full attention (see attention.wgsl for the forward and the layouts), for
// the R response rows whose output gradient is known: rows i = 0..R at positions pos0 + i, all
// keys from position 0. Scores and probabilities are recomputed, never stored. f32 throughout.
//
//   y = O * sigmoid(gate),  O_i = sum_j P_ij v_j,  P_i = softmax_j(scale q_i . k_j), j <= pos_i
//   dO = dy * sigmoid(gate);  dgate = dy * O * s (1 - s)
//   dP_ij = dO_i . v_j;  D_i = sum_j P_ij dP_ij;  dS_ij = P_ij (dP_ij - D_i)
//   dq_i = scale sum_j dS_ij k_j;  dk_j = scale sum_i dS_ij q_i;  dv_j = sum_i P_ij dO_i
//
// attn_bwd_q (one workgroup per (row, query head)): dq (of the rotated query) and dgate into
//   dqg [R, Hq, 2*hd] (query | gate, as q_proj's output), and (m, l, D) per (row, head) in stats.
// attn_bwd_kv (one workgroup per (key position, kv head)): dk (of the rotated key) and dv into
//   [keys, Hkv*hd], summed over the query heads of the group and the rows that see the key.

struct Params {
    rows: u32,       // R
    pos0: u32,       // position of row 0 (rows in q/qg are positions)
    hq: u32,
    hkv: u32,
    hd: u32,
    s_max: u32,
    scale: f32,
    _pad: u32,
}

const WG: u32 = 64u;
const MAX_DIMS: u32 = 8u;   // hd <= WG * MAX_DIMS

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;    // [T, Hq, hd] rotated queries
@group(0) @binding(2) var<storage, read> qg: array<f32>;   // [T, Hq, 2*hd] q_proj output
@group(0) @binding(3) var<storage, read> kc: array<f32>;   // [Hkv, S_max, hd]
@group(0) @binding(4) var<storage, read> vc: array<f32>;   // [Hkv, S_max, hd]
@group(0) @binding(5) var<storage, read> dy: array<f32>;   // [R, Hq*hd] gradient of the gated output
@group(0) @binding(6) var<storage, read_write> out0: array<f32>;  // q: dqg | kv: stats (read)
@group(0) @binding(7) var<storage, read_write> out1: array<f32>;  // q: stats | kv: dk
@group(0) @binding(8) var<storage, read_write> out2: array<f32>;  // kv: dv

var<workgroup> va: array<f32, 512>;
var<workgroup> vb: array<f32, 512>;
var<workgroup> ps: array<f32, 64>;
var<workgroup> ds: array<f32, 64>;

fn key_base(kvh: u32, s: u32) -> u32 {
    return (kvh * p.s_max + s) * p.hd;
}

// (q_i . k_s, dO_i . v_s) for key s of kv head kvh, with q_i in va and dO_i in vb.
fn key_terms(kvh: u32, s: u32) -> vec2<f32> {
    var dot = 0.0;
    var dv = 0.0;
    for (var d = 0u; d < p.hd; d++) {
        dot = fma(va[d], kc[key_base(kvh, s) + d], dot);
        dv = fma(vb[d], vc[key_base(kvh, s) + d], dv);
    }
    return vec2<f32>(dot, dv);
}

// va = q_i, vb = dO_i of row i, head h.
@compute @workgroup_size(64)
fn attn_bwd_q(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let i = wg.x;
    let h = wg.y;
    let pos = p.pos0 + i;
    let kvh = h / (p.hq / p.hkv);
    let qb = (pos * p.hq + h) * p.hd;
    let gb = (pos * p.hq + h) * 2u * p.hd + p.hd;
    let yb = (i * p.hq + h) * p.hd;
    for (var d = li; d < p.hd; d += WG) {
        va[d] = q[qb + d];
        vb[d] = dy[yb + d] * sigmoid(qg[gb + d]);
    }
    workgroupBarrier();
    let n_keys = pos + 1u;
    var m = -3.4e38;
    for (var s = li; s < n_keys; s += WG) {
        var dot = 0.0;
        for (var d = 0u; d < p.hd; d++) {
            dot = fma(va[d], kc[key_base(kvh, s) + d], dot);
        }
        m = max(m, dot * p.scale);
    }
    m = reduce_max(m, li);
    var l = 0.0;
    for (var s = li; s < n_keys; s += WG) {
        var dot = 0.0;
        for (var d = 0u; d < p.hd; d++) {
            dot = fma(va[d], kc[key_base(kvh, s) + d], dot);
        }
        l += exp(dot * p.scale - m);
    }
    l = reduce_sum(l, li);
    // Pass 2: O and D.
    var o: array<f32, MAX_DIMS>;
    var dsum = 0.0;
    for (var s0 = 0u; s0 < n_keys; s0 += WG) {
        let s = s0 + li;
        var pr = 0.0;
        var dp = 0.0;
        if (s < n_keys) {
            let kt = key_terms(kvh, s);
            pr = exp(kt.x * p.scale - m) / l;
            dp = kt.y;
        }
        dsum = fma(pr, dp, dsum);
        ps[li] = pr;
        workgroupBarrier();
        let block = min(WG, n_keys - s0);
        for (var k = 0u; k < MAX_DIMS; k++) {
            let d = li + k * WG;
            if (d < p.hd) {
                var a = o[k];
                for (var j = 0u; j < block; j++) {
                    a = fma(ps[j], vc[key_base(kvh, s0 + j) + d], a);
                }
                o[k] = a;
            }
        }
        workgroupBarrier();
    }
    let dd = reduce_sum(dsum, li);
    let ob = (i * p.hq + h) * 2u * p.hd;
    for (var k = 0u; k < MAX_DIMS; k++) {
        let d = li + k * WG;
        if (d < p.hd) {
            let sg = sigmoid(qg[gb + d]);
            out0[ob + p.hd + d] = dy[yb + d] * o[k] * sg * (1.0 - sg);
        }
    }
    // Pass 3: dq.
    var dq: array<f32, MAX_DIMS>;
    for (var s0 = 0u; s0 < n_keys; s0 += WG) {
        let s = s0 + li;
        var g = 0.0;
        if (s < n_keys) {
            let kt = key_terms(kvh, s);
            g = exp(kt.x * p.scale - m) / l * (kt.y - dd);
        }
        ds[li] = g;
        workgroupBarrier();
        let block = min(WG, n_keys - s0);
        for (var k = 0u; k < MAX_DIMS; k++) {
            let d = li + k * WG;
            if (d < p.hd) {
                var a = dq[k];
                for (var j = 0u; j < block; j++) {
                    a = fma(ds[j], kc[key_base(kvh, s0 + j) + d], a);
                }
                dq[k] = a;
            }
        }
        workgroupBarrier();
    }
    for (var k = 0u; k < MAX_DIMS; k++) {
        let d = li + k * WG;
        if (d < p.hd) {
            out0[ob + d] = dq[k] * p.scale;
        }
    }
    if (li == 0u) {
        let sb = (i * p.hq + h) * 4u;
        out1[sb] = m;
        out1[sb + 1u] = l;
        out1[sb + 2u] = dd;
    }
}

// va = k_j, vb = v_j of key position j, kv head kvh. Pairs (row, head of the group) in blocks.
@compute @workgroup_size(64)
fn attn_bwd_kv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let j = wg.x;
    let kvh = wg.y;
    let group = p.hq / p.hkv;
    for (var d = li; d < p.hd; d += WG) {
        va[d] = kc[key_base(kvh, j) + d];
        vb[d] = vc[key_base(kvh, j) + d];
    }
    workgroupBarrier();
    // Rows whose position is >= j.
    var first = 0u;
    if (j > p.pos0) {
        first = j - p.pos0;
    }
    var n_pairs = 0u;
    if (first < p.rows) {
        n_pairs = (p.rows - first) * group;
    }
    var dk: array<f32, MAX_DIMS>;
    var dv: array<f32, MAX_DIMS>;
    for (var e0 = 0u; e0 < n_pairs; e0 += WG) {
        let e = e0 + li;
        var pr = 0.0;
        var g = 0.0;
        if (e < n_pairs) {
            let i = first + e / group;
            let h = kvh * group + e % group;
            let pos = p.pos0 + i;
            let qb = (pos * p.hq + h) * p.hd;
            let gb = (pos * p.hq + h) * 2u * p.hd + p.hd;
            let yb = (i * p.hq + h) * p.hd;
            var dot = 0.0;
            var dpv = 0.0;
            for (var d = 0u; d < p.hd; d++) {
                dot = fma(q[qb + d], va[d], dot);
                dpv = fma(dy[yb + d] * sigmoid(qg[gb + d]), vb[d], dpv);
            }
            let sb = (i * p.hq + h) * 4u;
            pr = exp(dot * p.scale - out0[sb]) / out0[sb + 1u];
            g = pr * (dpv - out0[sb + 2u]);
        }
        ps[li] = pr;
        ds[li] = g;
        workgroupBarrier();
        let block = min(WG, n_pairs - e0);
        for (var k = 0u; k < MAX_DIMS; k++) {
            let d = li + k * WG;
            if (d < p.hd) {
                var ak = dk[k];
                var av = dv[k];
                for (var x = 0u; x < block; x++) {
                    let e2 = e0 + x;
                    let i = first + e2 / group;
                    let h = kvh * group + e2 % group;
                    let pos = p.pos0 + i;
                    let qb = (pos * p.hq + h) * p.hd;
                    let gb = (pos * p.hq + h) * 2u * p.hd + p.hd;
                    let yb = (i * p.hq + h) * p.hd;
                    ak = fma(ds[x], q[qb + d], ak);
                    av = fma(ps[x], dy[yb + d] * sigmoid(qg[gb + d]), av);
                }
                dk[k] = ak;
                dv[k] = av;
            }
        }
        workgroupBarrier();
    }
    let kb = (j * p.hkv + kvh) * p.hd;
    for (var k = 0u; k < MAX_DIMS; k++) {
        let d = li + k * WG;
        if (d < p.hd) {
            out1[kb + d] = dk[k] * p.scale;
            out2[kb + d] = dv[k];
        }
    }
}
