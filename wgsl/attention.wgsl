// Gated full attention (Qwen3_5Attention): per-head q/k RMSNorm1p, partial NeoX RoPE, KV cache
// write, causal GQA softmax attention, sigmoid output gate. f32 throughout.
//
// qg:    [T, Hq, 2*hd]   q_proj output: per head [query | gate]
// kraw:  [T, Hkv*hd], vraw: [T, Hkv*hd]
// q:     [T, Hq, hd]     normed + rotated queries
// kc/vc: [Hkv, S_max, hd] cache (keys normed + rotated)
// rope:  [S_max, R/2] pairs (cos, sin) for every cache position
// out:   [T, Hq*hd]      attention output times sigmoid(gate)

struct Params {
    t: u32,          // tokens in this step
    pos0: u32,       // cache position of the first token
    hq: u32,
    hkv: u32,
    hd: u32,
    rot_half: u32,   // R/2
    s_max: u32,
    eps: f32,
    scale: f32,      // hd^-0.5
    k_offset: u32,   // first element of the raw keys in kraw (prep_kv)
    v_offset: u32,   // first element of the raw values in vraw (prep_kv)
    _pad: u32,
}

const WG: u32 = 64u;
const MAX_DIMS: u32 = 8u;   // hd <= WG * MAX_DIMS

@group(0) @binding(0) var<uniform> p: Params;

@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> qg: array<f32>;
@group(0) @binding(3) var<storage, read> kc: array<f32>;
@group(0) @binding(4) var<storage, read> vc: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

var<workgroup> qs: array<f32, 512>;  // the query row, hd <= 512
var<workgroup> ps: array<f32, 64>;   // scores, then probabilities, of one key block

// One workgroup per (token, query head): online softmax over blocks of WG keys. Each invocation
// scores one key of the block, then accumulates MAX_DIMS output dims over the whole block.
@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let t = wg.x;
    let h = wg.y;
    let kvh = h / (p.hq / p.hkv);
    let qb = (t * p.hq + h) * p.hd;
    for (var d = li; d < p.hd; d += WG) {
        qs[d] = q[qb + d];
    }
    workgroupBarrier();
    let n_keys = p.pos0 + t + 1u;
    var m = -3.4e38;
    var l = 0.0;
    var acc: array<f32, MAX_DIMS>;
    for (var s0 = 0u; s0 < n_keys; s0 += WG) {
        let s = s0 + li;
        var score = -3.4e38;
        if (s < n_keys) {
            let kb = (kvh * p.s_max + s) * p.hd;
            var dot = 0.0;
            for (var d = 0u; d < p.hd; d++) {
                dot = fma(qs[d], kc[kb + d], dot);
            }
            score = dot * p.scale;
        }
        ps[li] = score;
        workgroupBarrier();
        var bm = m;
        for (var j = 0u; j < WG; j++) {
            bm = max(bm, ps[j]);
        }
        workgroupBarrier();
        var pr = 0.0;
        if (s < n_keys) {
            pr = exp(score - bm);
        }
        ps[li] = pr;
        workgroupBarrier();
        let corr = exp(m - bm);
        var bl = 0.0;
        for (var j = 0u; j < WG; j++) {
            bl += ps[j];
        }
        l = l * corr + bl;
        let block = min(WG, n_keys - s0);
        for (var i = 0u; i < MAX_DIMS; i++) {
            let d = li + i * WG;
            if (d < p.hd) {
                var a = acc[i] * corr;
                for (var j = 0u; j < block; j++) {
                    a = fma(ps[j], vc[(kvh * p.s_max + s0 + j) * p.hd + d], a);
                }
                acc[i] = a;
            }
        }
        m = bm;
        workgroupBarrier();
    }
    let ob = (t * p.hq + h) * p.hd;
    let gb = (t * p.hq + h) * 2u * p.hd + p.hd;
    for (var i = 0u; i < MAX_DIMS; i++) {
        let d = li + i * WG;
        if (d < p.hd) {
            let gate = qg[gb + d];
            out[ob + d] = acc[i] / l * sigmoid(gate);
        }
    }
}
