// Gated full attention for one token (decode) in two dispatches, split over the cached keys as
// flash-decoding does: what attention_prep.wgsl's prep_q and prep_kv and attention.wgsl's attend
// do for a step of one token (the same math, see there for the layouts), with the token's own key
// and value kept in workgroup memory.
//
// attend_one: one workgroup per (query head, split). It normalises and rotates its query, attends
// over its split's cached keys (split_keys positions from split · split_keys, up to pos0) with the
// online softmax of attention.wgsl and writes the unnormalised result as its part: [m, l,
// acc[0 .. hd)] at part[(h · splits + split) · (hd + 2)]. The last split also normalises and
// rotates its KV head's new key (the raw rows of the concatenated q|gate, k, v projection output
// `qkv`: q|gate from q_offset, k from k_offset, v from v_offset) and merges it as one more block;
// its query head that is first of its KV head writes the key and value into the cache at pos0. No
// workgroup reads that position from the cache, so nothing orders the writer and the readers.
// Splits spread a long cache over many workgroups: one workgroup per head walked every key.
//
// attend_one_merge: one workgroup per query head combines the head's parts (each rescaled by
// exp(m − max m)), divides by the summed l, applies the gate and writes its output row to `out`
// from out_offset. attend_one_merge_lora also writes the LoRA shrink of o_proj's input, split by
// head: after the output row out[0 .. Hq*hd], part h (of rank_pad = rank rounded up to 4 floats,
// the padding zero) = A[:, h*hd .. (h+1)*hd] . out[h*hd .. (h+1)*hd], where A is the group's
// [rank, Hq*hd] shrink matrix; matvec.wgsl sums the Hq parts in o_proj's prologue (no shrink
// dispatch). attend_rows_merge_lora does the same for each row of a batched step, row r's Hq
// parts from lora_at + r Hq rank_pad (after all the rows' outputs; matvec_batch.wgsl sums them).
//
// attend_rows / attend_rows_merge: the same for the rows of a batched step, each row one
// session's token (grid z = row r): its q|gate|k|v at r · row_stride from the offsets and its
// output at r · out_stride from out_offset, at its own position (positions[r]) in cache slot
// slots[r] of pooled caches (KV heads slot · Hkv .. of [slots · Hkv, s_max, hd]). The grid's
// splits are those of the furthest row (split_keys keys each); a row takes as many as its keys
// need (the rest of its workgroups return at once) and its parts start at r · Hq · splits.

@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> rope: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
@group(0) @binding(6) var<storage, read_write> part: array<f32>;  // [rows, Hq, splits, 2 + hd]
@group(1) @binding(0) var<storage, read> qk_norm: array<f32>;   // [q_norm (hd) | k_norm (hd)]
@group(2) @binding(0) var<storage, read> lora_a: array<vec4<f32>>; // attend_one_merge_lora: A

var<workgroup> ks: array<f32, 512>;   // the token's rotated key (the query is in qs)
var<workgroup> vs: array<f32, 512>;   // the token's value row; then the head's output

// One token's attention: where its q|gate, k and v rows start in qkv and its output row in out,
// its position, its first KV head in the cache, its splits and its first part.
struct Row {
    q: u32,
    k: u32,
    v: u32,
    out: u32,
    pos: u32,
    kv0: u32,
    splits: u32,
    part0: u32,
}

// The token of a single-token step.
fn one_row() -> Row {
    return Row(p.q_offset, p.k_offset, p.v_offset, p.out_offset, p.pos0, 0u, p.splits, 0u);
}

// Row r of a batched step.
fn batch_row(r: u32) -> Row {
    let pos = p.positions[r / 4u][r % 4u];
    let slot = (p.slots[r / 16u][(r / 4u) % 4u] >> (8u * (r % 4u))) & 0xffu;
    let at = r * p.row_stride;
    let splits = max(1u, (pos + p.split_keys - 1u) / p.split_keys);
    return Row(p.q_offset + at, p.k_offset + at, p.v_offset + at, p.out_offset + r * p.out_stride, pos,
               slot * p.hkv, splits, r * p.hq * p.splits);
}

// Element i of the rotated query (qs) or key (ks).
fn put(key: bool, i: u32, v: f32) {
    if (key) {
        ks[i] = v;
    } else {
        qs[i] = v;
    }
}

// Normalise the head row at qkv[sb..sb+hd] with the norm weight at qk_norm[nb..] and write it
// rotated at position pos into qs (key = false) or ks (key = true).
fn norm_rope(sb: u32, nb: u32, key: bool, pos: u32, li: u32) {
    var ss = 0.0;
    for (var d = li; d < p.hd; d += WG) {
        let v = qkv[sb + d];
        ss = fma(v, v, ss);
    }
    let scale = inv_rms(ss, li);
    let r = p.rot_half;
    for (var d = li; d < p.hd; d += WG) {
        let v = qkv[sb + d] * scale * (1.0 + qk_norm[nb + d]);
        if (d < r) {
            let cs = rope[pos * r + d];
            let u = qkv[sb + d + r] * scale * (1.0 + qk_norm[nb + d + r]);
            put(key, d, v * cs.x - u * cs.y);
            put(key, d + r, u * cs.x + v * cs.y);
        } else if (d >= 2u * r) {
            put(key, d, v);
        }
    }
}

// Split `split` of query head h of `row`: its part of the head's attention (see the top).
fn attend_split(row: Row, h: u32, split: u32, li: u32) {
    let kvh = h / (p.hq / p.hkv);
    let head = row.kv0 + kvh;
    let pos = row.pos;
    let hd = p.hd;
    let last = split + 1u == row.splits;
    norm_rope(row.q + h * 2u * hd, 0u, false, pos, li);
    if (last) {
        norm_rope(row.k + kvh * hd, hd, true, pos, li);
        let cb = (head * p.s_max + pos) * hd;
        let owner = h % (p.hq / p.hkv) == 0u;
        for (var d = li; d < hd; d += WG) {
            let v = qkv[row.v + kvh * hd + d];
            vs[d] = v;
            if (owner) {
                vc[cb + d] = v;
            }
        }
        workgroupBarrier();
        if (owner) {
            for (var d = li; d < hd; d += WG) {
                kc[cb + d] = ks[d];
            }
        }
    }
    workgroupBarrier();
    let k0 = split * p.split_keys;
    var o = attend_cached(head, k0, min(k0 + p.split_keys, pos), li);
    if (last) {
        // The token's own key, from workgroup memory, as a last block of one.
        var dot = 0.0;
        for (var d = 0u; d < hd; d++) {
            dot = fma(qs[d], ks[d], dot);
        }
        let score = dot * p.scale;
        let bm = max(o.m, score);
        let corr = exp(o.m - bm);
        let pr = exp(score - bm);
        o.l = o.l * corr + pr;
        o.m = bm;
        for (var i = 0u; i < MAX_DIMS; i++) {
            let d = li + i * WG;
            if (d < hd) {
                o.acc[i] = fma(pr, vs[d], o.acc[i] * corr);
            }
        }
    }
    let pb = (row.part0 + h * p.splits + split) * (hd + 2u);
    if (li == 0u) {
        part[pb] = o.m;
        part[pb + 1u] = o.l;
    }
    for (var i = 0u; i < MAX_DIMS; i++) {
        let d = li + i * WG;
        if (d < hd) {
            part[pb + 2u + d] = o.acc[i];
        }
    }
}

// Query head h's parts of `row` combined: its gated output row, left in vs[0..hd) and written
// to out[row.out + h*hd ..].
fn merge_head(row: Row, h: u32, li: u32) {
    let hd = p.hd;
    let stride = hd + 2u;
    let base = (row.part0 + h * p.splits) * stride;
    var m = -3.4e38;
    for (var s = 0u; s < row.splits; s++) {
        m = max(m, part[base + s * stride]);
    }
    var l = 0.0;
    var acc: array<f32, MAX_DIMS>;
    for (var s = 0u; s < row.splits; s++) {
        let pb = base + s * stride;
        let c = exp(part[pb] - m);
        l = fma(part[pb + 1u], c, l);
        for (var i = 0u; i < MAX_DIMS; i++) {
            let d = li + i * WG;
            if (d < hd) {
                acc[i] = fma(part[pb + 2u + d], c, acc[i]);
            }
        }
    }
    let gb = row.q + h * 2u * hd + hd;
    for (var i = 0u; i < MAX_DIMS; i++) {
        let d = li + i * WG;
        if (d < hd) {
            let y = acc[i] / l * sigmoid(qkv[gb + d]);
            out[row.out + h * hd + d] = y;
            vs[d] = y;
        }
    }
}

@compute @workgroup_size(64)
fn attend_one(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    attend_split(one_row(), wg.x, wg.y, li);
}

@compute @workgroup_size(64)
fn attend_one_merge(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    merge_head(one_row(), wg.x, li);
}

@compute @workgroup_size(64)
fn attend_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = batch_row(wg.z);
    if (wg.y >= row.splits) {
        return;
    }
    attend_split(row, wg.x, wg.y, li);
}

@compute @workgroup_size(64)
fn attend_rows_merge(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    merge_head(batch_row(wg.z), wg.x, li);
}

// Query head h's part of o_proj's LoRA shrink from its output row (left in vs by merge_head;
// after a barrier) at out[at ..]: the rank rounded up to 4 floats, the padding zero.
fn write_shrink(h: u32, at: u32, li: u32) {
    let hd = p.hd;
    let k4 = p.hq * hd / 4u;
    let rank_pad = (p.lora_rank + 3u) & ~3u;
    for (var r = li; r < rank_pad; r += WG) {
        var sum = 0.0;
        if (r < p.lora_rank) {
            let a0 = r * k4 + h * hd / 4u;
            for (var q = 0u; q < hd / 4u; q++) {
                let d = 4u * q;
                sum += dot(lora_a[a0 + q], vec4<f32>(vs[d], vs[d + 1u], vs[d + 2u], vs[d + 3u]));
            }
        }
        out[at + h * rank_pad + r] = sum;
    }
}

@compute @workgroup_size(64)
fn attend_one_merge_lora(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    merge_head(one_row(), wg.x, li);
    workgroupBarrier();
    write_shrink(wg.x, p.out_offset + p.hq * p.hd, li);
}

@compute @workgroup_size(64)
fn attend_rows_merge_lora(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    merge_head(batch_row(wg.z), wg.x, li);
    workgroupBarrier();
    write_shrink(wg.x, p.lora_at + wg.z * p.hq * ((p.lora_rank + 3u) & ~3u), li);
}
