// What the attention kernels share (prepended by the loader to attention_prep.wgsl,
// attention.wgsl and attention_one.wgsl, after prelude.wgsl): the parameters (AttnParams on the
// host), the workgroup size and the per-head RMS of a workgroup.

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
    k_offset: u32,   // first element of the raw keys in their buffer (one token: after q|gate)
    v_offset: u32,   // first element of the raw values in their buffer
    lora_rank: u32,  // attend_one_lora: the rank of o_proj's shrink (otherwise unused)
    q_offset: u32,   // attend_one: first element of the q|gate rows in qkv (a batch's session row)
    out_offset: u32, // attend_one: first element of the output row in out
    splits: u32,     // attend_one: workgroups per head over the cached keys (and its parts)
    split_keys: u32, // attend_one: cached keys per split (a multiple of WG)
    row_stride: u32, // attend_rows: elements from one row's q|gate|k|v to the next's in qkv
    out_stride: u32, // attend_rows: elements from one row's output to the next's in out
    lora_at: u32,    // attend_rows_merge_lora: the first element of row 0's shrink parts in out
    _pad1: u32,
    slots: array<vec4<u32>, 2>,    // attend_rows: row r's cache slot, byte r % 4 of word r / 4
    positions: array<vec4<u32>, 8>, // attend_rows: row r's position, word r
}

const WG: u32 = 64u;
const MAX_DIMS: u32 = 8u;   // hd <= WG * MAX_DIMS

@group(0) @binding(0) var<uniform> p: Params;

// rsqrt(mean + eps) of a head row from each invocation's partial sum of squares (a workgroup
// sum; red is free again when it returns).
fn inv_rms(sumsq: f32, li: u32) -> f32 {
    return inverseSqrt(reduce_sum(sumsq, li) / f32(p.hd) + p.eps);
}
