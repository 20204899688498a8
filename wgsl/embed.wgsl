// Embedding gather from one row-chunk of the (possibly split) embedding table, in any weight
// dtype (the decoder: weights.wgsl).

struct Params {
    n: u32,          // hidden size
    rows: u32,       // tokens
    row_start: u32,  // first vocabulary row held by this chunk
    row_count: u32,  // rows held by this chunk
    q_sb: u32,       // affine tables: the u32 index of the chunk's scales and biases
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

// hidden[t, d] = E[ids[t], d] for the ids that fall into this chunk

@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> hidden: array<f32>;

@compute @workgroup_size(64)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>) {
    let d = gid.x;
    let t = gid.y;
    if (d >= p.n || t >= p.rows) {
        return;
    }
    let id = ids[t];
    if (id >= p.row_start && id < p.row_start + p.row_count) {
        hidden[t * p.n + d] = weight_elem((id - p.row_start) * p.n + d, p.q_sb);
    }
}
