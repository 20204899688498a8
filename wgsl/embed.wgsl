// Embedding gather in any weight dtype (the decoder: weights.wgsl): `embed` from one row-chunk
// of the (possibly split) table per dispatch; `embed_split` from a table split in up to 4
// chunks of per_chunk rows each (the last may hold fewer) in one dispatch, chunk 0 bound at
// group 1 and chunks 1-3 in group 0 (the last one repeated where there are fewer).

struct Params {
    n: u32,          // hidden size
    rows: u32,       // tokens
    row_start: u32,  // embed: first vocabulary row held by this chunk
    row_count: u32,  // embed: rows held by this chunk; embed_split: rows of the table
    q_sb: u32,       // embed, affine tables: the u32 index of the chunk's scales and biases
    chunks: u32,     // embed_split: chunks of the table (1-4)
    per_chunk: u32,  // embed_split: rows per chunk
    _pad: u32,
    sb: vec4<u32>,   // embed_split, affine tables: each chunk's q_sb
}

@group(0) @binding(0) var<uniform> p: Params;

// hidden[t, d] = E[ids[t], d] for the ids that fall into this chunk (embed) or into the table
// (embed_split)

@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> hidden: array<f32>;
@group(0) @binding(3) var<storage, read> w1: array<vec4<u32>>; // embed_split: chunk 1
@group(0) @binding(4) var<storage, read> w2: array<vec4<u32>>; // embed_split: chunk 2
@group(0) @binding(5) var<storage, read> w3: array<vec4<u32>>; // embed_split: chunk 3

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

// Word i of chunk c.
fn chunk_word(c: u32, i: u32) -> u32 {
    let v = i >> 2u;
    let l = i & 3u;
    switch c {
        case 0u: {
            return w[v][l];
        }
        case 1u: {
            return w1[v][l];
        }
        case 2u: {
            return w2[v][l];
        }
        default: {
            return w3[v][l];
        }
    }
}

@compute @workgroup_size(64)
fn embed_split(@builtin(global_invocation_id) gid: vec3<u32>) {
    let d = gid.x;
    let t = gid.y;
    if (d >= p.n || t >= p.rows) {
        return;
    }
    let id = ids[t];
    let c = id / p.per_chunk;
    if (id >= p.row_count || c >= p.chunks) {
        return;
    }
    let e = (id - c * p.per_chunk) * p.n + d;
    var sb_word = 0u;
    if (W_DTYPE == 3u) {
        sb_word = chunk_word(c, p.sb[c] + e / Q_GROUP);
    }
    hidden[t * p.n + d] = weight_from_words(e, chunk_word(c, weight_word_index(e)), sb_word);
}
