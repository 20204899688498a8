// The candidates of a sampled token choice on the GPU: the k largest logits in the order of
// `Sampler::sample` in sampler.rs (f32 total order, larger first, equal values to the lower id),
// so the host reads back k (value, id) pairs instead of the vocabulary and samples from them.
//
// topk_mask:   for the repetition penalty, the logits of the (unique) history ids are copied out
//              (hist_out, exact; the host applies the penalty) and replaced by the lowest key, so
//              the candidates are the k largest of the other tokens.
// topk_blocks: workgroup b takes logits[b * block .. (b + 1) * block) and writes its k best
//              (key, id) pairs, best first; after every block's pairs, its softmax mass at the
//              inverse temperature inv_t: (m, s) with m the block's largest finite logit and
//              s = sum exp((l - m) * inv_t) over its finite logits (the masked history entries
//              left out), in f32, as two f32 bit patterns at dst[2 * (blocks * k + b)]. Sampling
//              without top-k needs the whole row's mass (sampler.rs bounds its rounding); with
//              inv_t = 0 (top-k sampling) the masses are skipped.
// topk_final:  one workgroup merges the blocks' pairs into the k best overall.
//
// A key is the f32 bit pattern mapped so that unsigned order is the total order (NaN with the
// sign bit clear above +inf, with it set below -inf). Selection runs k rounds: every invocation
// offers its best entry not yet taken, a tree reduction finds the round's winner, and its owner
// marks it taken. Entries past the end have key 0 and id 0xffffffff (they lose to every logit).

struct Params {
    n: u32,       // logits
    block: u32,   // logits per workgroup of topk_blocks (at most WG * PER)
    parts: u32,   // topk_final: pairs to merge (blocks * k, at most WG * PER)
    k: u32,       // pairs kept per block and overall
    hist: u32,    // topk_mask: history ids
    inv_t: f32,   // topk_blocks: 1 / temperature for the block masses (0: no masses)
    _pad1: u32,
    _pad2: u32,
}

const WG: u32 = 256u;
const PER: u32 = 32u;           // entries an invocation holds
const MASKED: u32 = 0xffffffffu; // f32 bits whose key is 0 (the lowest)
const NONE: u32 = 0xffffffffu;   // id of an empty entry

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> src: array<u32>;  // mask, blocks: logits (f32 bits); final: pairs
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;  // mask: history values; blocks, final: pairs
@group(0) @binding(3) var<storage, read> hist_ids: array<u32>;   // mask only

var<workgroup> win_k: array<u32, 256>;
var<workgroup> win_i: array<u32, 256>;

fn key_of(bits: u32) -> u32 {
    return select(bits | 0x80000000u, ~bits, (bits & 0x80000000u) != 0u);
}

// Whether (ak, ai) comes before (bk, bi).
fn before(ak: u32, ai: u32, bk: u32, bi: u32) -> bool {
    return ak > bk || (ak == bk && ai < bi);
}

// k rounds over the entries the invocations hold (`m` each); pair r goes to dst[out + 2 r].
fn select_rounds(keys: ptr<function, array<u32, 32>>, ids: ptr<function, array<u32, 32>>, m: u32, li: u32, out: u32) {
    var taken = 0u;
    for (var r = 0u; r < p.k; r++) {
        var bk = 0u;
        var bi = NONE;
        var bj = PER;
        for (var j = 0u; j < m; j++) {
            if ((taken & (1u << j)) == 0u && before((*keys)[j], (*ids)[j], bk, bi)) {
                bk = (*keys)[j];
                bi = (*ids)[j];
                bj = j;
            }
        }
        win_k[li] = bk;
        win_i[li] = bi;
        workgroupBarrier();
        for (var s = WG / 2u; s > 0u; s >>= 1u) {
            if (li < s && before(win_k[li + s], win_i[li + s], win_k[li], win_i[li])) {
                win_k[li] = win_k[li + s];
                win_i[li] = win_i[li + s];
            }
            workgroupBarrier();
        }
        let wk = win_k[0];
        let wi = win_i[0];
        if (bj < PER && bi == wi && bk == wk) {
            taken |= 1u << bj;
        }
        if (li == 0u) {
            dst[out + 2u * r] = wk;
            dst[out + 2u * r + 1u] = wi;
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn topk_mask(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < p.hist) {
        let id = hist_ids[i];
        dst[i] = src[id];
        src[id] = MASKED;
    }
}

// Lowest value a block's largest logit starts from (an empty block's mass is 0 at it).
const NO_MAX: f32 = -3.4028235e38; // -f32::MAX

// The softmax mass of masses (ma, sa) and (mb, sb) together, at the larger maximum.
fn merge_mass(ma: f32, sa: f32, mb: f32, sb: f32) -> vec2<f32> {
    let m = max(ma, mb);
    return vec2<f32>(m, sa * exp((ma - m) * p.inv_t) + sb * exp((mb - m) * p.inv_t));
}

// Workgroup b's softmax mass into dst after the blocks' pairs (the invocations' masses merged
// by a tree; runs after select_rounds, whose last barrier frees win_k / win_i).
fn block_mass(keys: ptr<function, array<u32, 32>>, m: u32, li: u32, b: u32, blocks: u32) {
    var mx = NO_MAX;
    for (var j = 0u; j < m; j++) {
        let bits = topk_bits((*keys)[j]);
        if ((bits & 0x7f800000u) != 0x7f800000u) {
            mx = max(mx, bitcast<f32>(bits));
        }
    }
    var sum = 0.0;
    for (var j = 0u; j < m; j++) {
        let bits = topk_bits((*keys)[j]);
        if ((bits & 0x7f800000u) != 0x7f800000u) {
            sum += exp((bitcast<f32>(bits) - mx) * p.inv_t);
        }
    }
    win_k[li] = bitcast<u32>(mx);
    win_i[li] = bitcast<u32>(sum);
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (li < s) {
            let v = merge_mass(bitcast<f32>(win_k[li]), bitcast<f32>(win_i[li]), bitcast<f32>(win_k[li + s]),
                bitcast<f32>(win_i[li + s]));
            win_k[li] = bitcast<u32>(v.x);
            win_i[li] = bitcast<u32>(v.y);
        }
        workgroupBarrier();
    }
    if (li == 0u) {
        dst[2u * (blocks * p.k + b)] = win_k[0];
        dst[2u * (blocks * p.k + b) + 1u] = win_i[0];
    }
}

// The f32 bits a key stands for (key_of inverted; the masked entries' key 0 gives MASKED, a NaN).
fn topk_bits(key: u32) -> u32 {
    return select(~key, key & 0x7fffffffu, (key & 0x80000000u) != 0u);
}

@compute @workgroup_size(256)
fn topk_blocks(
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) li: u32,
) {
    var keys: array<u32, 32>;
    var ids: array<u32, 32>;
    let start = wg.x * p.block;
    let m = p.block / WG;
    for (var j = 0u; j < m; j++) {
        let i = start + j * WG + li;
        keys[j] = 0u;
        ids[j] = NONE;
        if (i < p.n) {
            keys[j] = key_of(src[i]);
            ids[j] = i;
        }
    }
    select_rounds(&keys, &ids, m, li, 2u * wg.x * p.k);
    if (p.inv_t > 0.0) {
        block_mass(&keys, m, li, wg.x, nwg.x);
    }
}

@compute @workgroup_size(256)
fn topk_final(@builtin(local_invocation_index) li: u32) {
    var keys: array<u32, 32>;
    var ids: array<u32, 32>;
    let m = (p.parts + WG - 1u) / WG;
    for (var j = 0u; j < m; j++) {
        let e = j * WG + li;
        keys[j] = 0u;
        ids[j] = NONE;
        if (e < p.parts) {
            keys[j] = src[2u * e];
            ids[j] = src[2u * e + 1u];
        }
    }
    select_rounds(&keys, &ids, m, li, 0u);
}
