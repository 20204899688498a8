// Greedy token choice on the GPU, with the rule of `argmax` in sampler.rs: the first index of the
// largest non-NaN logit; when every logit is NaN, the last index. As a total order on (value,
// index) candidates: a non-NaN value beats NaN, a larger value beats a smaller one, equal values
// go to the lower index, and between NaNs the higher index wins. The order is associative, so the
// blocked tree reduction picks exactly what the sequential scan picks.
//
// Both passes also note whether any logit is not finite (NaN or ±inf): generation refuses to
// choose from such a row, and this is the only look at the logits greedy decoding gets.
//
// argmax_blocks: workgroup (b, r) scans logits[r * n + b * block .. r * n + (b + 1) * block) and
//                writes its candidate (value bits, index, non-finite flag) of row r.
// argmax_final:  workgroup r reduces row r's block candidates and writes the chosen id into
//                ids[2 r] (row 0: the next step's input) and the flag into ids[2 r + 1] (the two
//                words per row the host reads). One row per session step; a batched step's rows
//                are its sessions.

struct Params {
    n: u32,       // logits per row
    block: u32,   // logits per workgroup of argmax_blocks
    parts: u32,   // block candidates per row
    _pad: u32,
}

const WG: u32 = 256u;
const NAN_BITS: u32 = 0x7fc00000u;

@group(0) @binding(0) var<uniform> p: Params;

var<workgroup> best_v: array<u32, 256>;
var<workgroup> best_i: array<u32, 256>;
var<workgroup> any_bad: atomic<u32>;

// Workgroup memory is not zero-initialised (the context turns that off): clear the flag first.
fn clear_flag(li: u32) {
    if (li == 0u) {
        atomicStore(&any_bad, 0u);
    }
    workgroupBarrier();
}

fn is_nan(bits: u32) -> bool {
    return (bits & 0x7fffffffu) > 0x7f800000u;
}

fn is_non_finite(bits: u32) -> bool {
    return (bits & 0x7fffffffu) >= 0x7f800000u;
}

// Whether candidate a (value bits, index) beats candidate b.
fn beats(av: u32, ai: u32, bv: u32, bi: u32) -> bool {
    let an = is_nan(av);
    let bn = is_nan(bv);
    if (an != bn) {
        return bn;
    }
    if (an) {
        return ai > bi;
    }
    let a = bitcast<f32>(av);
    let b = bitcast<f32>(bv);
    if (a != b) {
        return a > b;
    }
    return ai < bi;
}

// Tree reduction of the workgroup's candidates into slot 0.
fn reduce(li: u32) {
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s && beats(best_v[li + s], best_i[li + s], best_v[li], best_i[li])) {
            best_v[li] = best_v[li + s];
            best_i[li] = best_i[li + s];
        }
        workgroupBarrier();
    }
}

@group(0) @binding(1) var<storage, read> src: array<u32>;        // blocks: logits (f32 bits); final: candidates
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;  // blocks: candidates (value bits, index); final: ids

@compute @workgroup_size(256)
fn argmax_blocks(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let start = wg.x * p.block;
    let end = min(start + p.block, p.n);
    let row = wg.y * p.n;
    // The empty candidate: a NaN at index 0 loses to every logit and to every later NaN.
    clear_flag(li);
    var bv = NAN_BITS;
    var bi = 0u;
    var bad = false;
    for (var i = start + li; i < end; i += WG) {
        let v = src[row + i];
        bad = bad || is_non_finite(v);
        if (beats(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    if (bad) {
        atomicOr(&any_bad, 1u);
    }
    best_v[li] = bv;
    best_i[li] = bi;
    reduce(li);
    if (li == 0u) {
        let at = 3u * (wg.y * p.parts + wg.x);
        dst[at] = best_v[0];
        dst[at + 1u] = best_i[0];
        dst[at + 2u] = atomicLoad(&any_bad);
    }
}

@compute @workgroup_size(256)
fn argmax_final(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    clear_flag(li);
    var bv = NAN_BITS;
    var bi = 0u;
    var bad = 0u;
    let row = 3u * wg.x * p.parts;
    for (var i = li; i < p.parts; i += WG) {
        let v = src[row + 3u * i];
        let j = src[row + 3u * i + 1u];
        bad |= src[row + 3u * i + 2u];
        if (beats(v, j, bv, bi)) {
            bv = v;
            bi = j;
        }
    }
    if (bad != 0u) {
        atomicOr(&any_bad, 1u);
    }
    best_v[li] = bv;
    best_i[li] = bi;
    reduce(li);
    if (li == 0u) {
        dst[2u * wg.x] = best_i[0];
        dst[2u * wg.x + 1u] = atomicLoad(&any_bad);
    }
}
