// The cached-keys part of attention (prepended by the loader to attention.wgsl and
// attention_one.wgsl, after attention_common.wgsl): the KV cache bindings, the query row in
// workgroup memory and the online softmax over blocks of WG keys.
//
// kc/vc: [Hkv, S_max, hd] cache (keys normed + rotated), or pooled caches of several sessions
// [slots · Hkv, S_max, hd] (attend_rows: a row's KV heads from slot · Hkv, the kvh that
// attend_cached takes); attention_one.wgsl writes the token's key and value into them,
// attention.wgsl only reads them.

@group(0) @binding(3) var<storage, read_write> kc: array<f32>;
@group(0) @binding(4) var<storage, read_write> vc: array<f32>;

var<workgroup> qs: array<f32, 512>;  // the query row, hd <= 512
var<workgroup> ps: array<f32, 64>;   // scores, then probabilities, of one key block

// The online softmax state of a head: running max, running sum and the unnormalised output
// (dims li + i * WG of invocation li).
struct Online {
    m: f32,
    l: f32,
    acc: array<f32, MAX_DIMS>,
}

// Attention of the query in qs over cache positions k0 .. k1 of KV head kvh, in blocks of WG
// keys: each invocation scores one key of the block, then accumulates MAX_DIMS output dims over
// the whole block.
fn attend_cached(kvh: u32, k0: u32, k1: u32, li: u32) -> Online {
    var m = -3.4e38;
    var l = 0.0;
    var acc: array<f32, MAX_DIMS>;
    for (var s0 = k0; s0 < k1; s0 += WG) {
        let s = s0 + li;
        var score = -3.4e38;
        if (s < k1) {
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
        if (s < k1) {
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
        let block = min(WG, k1 - s0);
        for (var i = 0u; i < MAX_DIMS; i++) {
            if (li + i * WG < p.hd) {
                acc[i] *= corr;
            }
        }
        // Four keys at a time over every owned dim: each dim's sum runs in key order as before,
        // but the loads of four value rows for all dims are issued together, not one memory
        // round trip per key and dim (hd = 256: 16 rounds per block instead of 256).
        let vb = (kvh * p.s_max + s0) * p.hd + li;
        var j = 0u;
        for (; j + 4u <= block; j += 4u) {
            let pr = vec4<f32>(ps[j], ps[j + 1u], ps[j + 2u], ps[j + 3u]);
            let r = vb + j * p.hd;
            for (var i = 0u; i < MAX_DIMS; i++) {
                if (li + i * WG < p.hd) {
                    let c = r + i * WG;
                    let v = vec4<f32>(vc[c], vc[c + p.hd], vc[c + 2u * p.hd], vc[c + 3u * p.hd]);
                    acc[i] = fma(pr.w, v.w, fma(pr.z, v.z, fma(pr.y, v.y, fma(pr.x, v.x, acc[i]))));
                }
            }
        }
        for (; j < block; j++) {
            let c = vb + j * p.hd;
            for (var i = 0u; i < MAX_DIMS; i++) {
                if (li + i * WG < p.hd) {
                    acc[i] = fma(ps[j], vc[c + i * WG], acc[i]);
                }
            }
        }
        m = bm;
        workgroupBarrier();
    }
    return Online(m, l, acc);
}
