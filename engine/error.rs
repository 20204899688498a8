//! Typed errors, one enum per concern. Each variant names the thing at fault and, where there is
//! one, the expected and the found value.

use std::path::PathBuf;

/// Errors of the GPU layer: adapter selection, device creation, buffer limits, validation.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No wgpu adapter was found at all.
    #[error("no GPU adapter found (backends from WGPU_BACKEND: {backends}); on Linux install Mesa's lavapipe: apt-get install mesa-vulkan-drivers libvulkan1")]
    NoAdapter {
        /// The backends that were searched.
        backends: String,
    },
    /// `WGPU_ADAPTER_NAME` was set but matched no adapter.
    #[error("WGPU_ADAPTER_NAME={wanted:?} matches no adapter; found: {found:?}")]
    AdapterNameNotFound {
        /// The requested substring.
        wanted: String,
        /// Names of the adapters that exist.
        found: Vec<String>,
    },
    /// `request_device` failed.
    #[error("device request failed: {0}")]
    RequestDevice(String),
    /// A buffer would exceed the device's limits.
    #[error("buffer {name:?} needs {needed} bytes, the device allows at most {limit}")]
    BufferTooLarge {
        /// The buffer's label.
        name: String,
        /// Requested size in bytes.
        needed: u64,
        /// The limit in bytes.
        limit: u64,
    },
    /// wgpu reported a validation or out-of-memory error inside an error scope.
    #[error("GPU error during {during}: {message}")]
    Validation {
        /// What was being done.
        during: String,
        /// wgpu's message.
        message: String,
    },
    /// Mapping a buffer for readback failed.
    #[error("buffer readback failed: {0}")]
    Readback(String),
    /// Weight data handed to an upload does not match the shape and dtype it claims.
    #[error("weight {name:?}: {what} has {found} elements, expected {expected}")]
    WeightSize {
        /// The weight's label.
        name: String,
        /// Which part (data, codes, scales, biases).
        what: &'static str,
        /// The length the shape and dtype give.
        expected: usize,
        /// The length handed over.
        found: usize,
    },
    /// An upload whose shape alone passes the address space.
    #[error("weight {name:?}: {rows} rows of {cols} {dtype} elements pass the address space")]
    WeightShape {
        /// The weight's label.
        name: String,
        /// Rows claimed.
        rows: usize,
        /// Columns claimed.
        cols: usize,
        /// The dtype, as `Debug` writes it.
        dtype: String,
    },
    /// Affine-quantized data in a format the kernels do not decode.
    #[error("weight {name:?}: {bits}-bit codes in groups of {group}; the kernels decode 4 or 8 bits in groups of 32, 64 or 128")]
    AffineFormat {
        /// The weight's label.
        name: String,
        /// Bits per code handed over.
        bits: u32,
        /// Inputs per scale/bias pair handed over.
        group: u32,
    },
}

/// Errors of reading a file handed to the engine ([`crate::io::read_bounded`]): every file is
/// untrusted, so its type and size are checked before it is opened or read.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The OS refused (no such file, permissions, a failed read).
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The path names a directory, FIFO, device or socket (after following symlinks).
    #[error("{what} {path} is not a regular file (it is {kind})")]
    NotRegular {
        /// Which file (`config.json`, …).
        what: String,
        /// The path.
        path: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// The file is larger than its bound (checked before reading).
    #[error("{what} {path} has {size} bytes, more than the {limit}-byte bound")]
    TooLarge {
        /// Which file.
        what: String,
        /// The path.
        path: PathBuf,
        /// Its length in bytes.
        size: u64,
        /// The bound.
        limit: u64,
    },
}

/// Errors while loading a model directory.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A weight is NaN, infinite or absurdly large.
    #[error("tensor {tensor}: element {index} is NaN, infinite or of magnitude above {limit}")]
    WeightOutOfRange {
        /// The tensor.
        tensor: String,
        /// The first such element.
        index: usize,
        /// The bound ([`crate::model::MAX_CHECKPOINT_WEIGHT`]).
        limit: f32,
    },
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// `config.json` (or the index) is not valid JSON of the expected form.
    #[error("invalid {file}: {message}")]
    BadJson {
        /// The file name.
        file: String,
        /// serde's message.
        message: String,
    },
    /// A config field has a value this engine cannot run.
    #[error("config field {field}: expected {expected}, found {found}")]
    BadConfig {
        /// The field name.
        field: String,
        /// What is supported.
        expected: String,
        /// What the file says.
        found: String,
    },
    /// The model family is recognised but not implemented.
    #[error("unsupported model: {what}")]
    Unsupported {
        /// What is unsupported.
        what: String,
    },
    /// No weights file was found in the directory.
    #[error("no model.safetensors or model.safetensors.index.json in {dir}")]
    NoWeights {
        /// The directory.
        dir: PathBuf,
    },
    /// A safetensors file is malformed.
    #[error("invalid safetensors file {path}: {message}")]
    BadSafetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The checkpoint holds more elements under the text prefix than its config describes
    /// (checked from the header, before reading them).
    #[error("the tensors under {prefix:?} hold {found} elements, more than the {limit} the config describes")]
    TooManyElements {
        /// The text prefix.
        prefix: String,
        /// [`crate::model::TextConfig::tensor_elements_bound`].
        limit: u64,
        /// The elements up to and including the first tensor past the bound.
        found: u64,
    },
    /// A required tensor is absent.
    #[error("missing tensor {name} (looked for {candidates:?})")]
    MissingTensor {
        /// The logical name.
        name: String,
        /// The full names tried.
        candidates: Vec<String>,
    },
    /// A tensor has the wrong shape.
    #[error("tensor {name}: expected shape {expected:?}, found {found:?}")]
    ShapeMismatch {
        /// The tensor.
        name: String,
        /// Expected shape.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A tensor entry read through a checkpoint other than the one it came from.
    #[error("a tensor entry of checkpoint {found} read through checkpoint {expected}")]
    ForeignEntry {
        /// The checkpoint read through.
        expected: u64,
        /// The checkpoint the entry belongs to.
        found: u64,
    },
    /// A matrix to quantize has no rows, or more columns than its quantized words can count.
    #[error("tensor {name}: expected a matrix of at least one row and at most {max_cols} columns to quantize at {bits} bits, found shape {found:?}")]
    QuantizeShape {
        /// The tensor.
        name: String,
        /// The bit width.
        bits: u32,
        /// The widest matrix the word count fits (`usize::MAX / bits`).
        max_cols: usize,
        /// Its shape in the file.
        found: Vec<usize>,
    },
    /// A tensor has a dtype this engine does not load.
    #[error("tensor {name}: dtype {found} is not supported (expected F32, BF16 or F16)")]
    UnsupportedDtype {
        /// The tensor.
        name: String,
        /// The dtype in the file.
        found: String,
    },
    /// Projections stored as one concatenated weight have different dtypes.
    #[error("tensor {name}: dtype {found}, but {first} (stored with it) is {expected}")]
    DtypeMismatch {
        /// The tensor.
        name: String,
        /// The tensor it is concatenated after.
        first: String,
        /// That tensor's dtype.
        expected: String,
        /// This tensor's dtype.
        found: String,
    },
    /// A file the directory names is not a regular file, or larger than the engine reads for
    /// its kind ([`FileError::NotRegular`], [`FileError::TooLarge`]).
    #[error(transparent)]
    File(FileError),
    /// A GPU error while uploading.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// Errors while running the model.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A token id is outside the vocabulary.
    #[error("token id {id} at position {index} is out of range (vocab size {vocab})")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// Its index in the input.
        index: usize,
        /// The vocabulary size.
        vocab: usize,
    },
    /// The input is empty.
    #[error("empty input: at least one token is needed")]
    EmptyInput,
    /// The session's context is full.
    #[error("context full: {needed} positions needed, session capacity is {capacity}")]
    ContextFull {
        /// Positions the step needs.
        needed: usize,
        /// The session's capacity.
        capacity: usize,
    },
    /// Sampling parameters are invalid.
    #[error("invalid sampling parameter {name}: {value} ({expected})")]
    BadParam {
        /// The parameter.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is allowed.
        expected: &'static str,
    },
    /// The model produced NaN or infinite logits (overflowing weights, an adapter or scale of
    /// absurd magnitude): generation stops instead of choosing tokens from garbage.
    #[error("non-finite logits at position {position}: the model's output overflowed")]
    NonFiniteLogits {
        /// The sequence position (0-based) of the token whose logits were not finite.
        position: usize,
    },
    /// A hand-built or edited [`crate::TextConfig`] outside the bounds the engine runs within.
    #[error("the model's config: {0}")]
    ModelConfig(Box<ModelError>),
    /// An adapter set that cannot be bound (a batched step stacks the rows' adapters).
    #[error(transparent)]
    Adapter(#[from] Box<AdapterError>),
    /// A GPU error.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// Errors while loading or managing a LoRA adapter. A failed load leaves every resident adapter
/// and the active one exactly as they were.
#[derive(Debug, thiserror::Error)]
pub enum AdapterError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The model's [`crate::TextConfig`] (hand-built or edited) is outside the bounds the engine
    /// runs within.
    #[error("the model's config: {0}")]
    ModelConfig(Box<ModelError>),
    /// The path is not a PEFT adapter (directory or `.safetensors` file).
    #[error("{path} is not a PEFT LoRA adapter: {reason}")]
    NotPeft {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The safetensors file is malformed.
    #[error("invalid adapter file {path}: {message}")]
    BadSafetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// An `adapter_config.json` field has a value this engine cannot use.
    #[error("adapter config field {field}: expected {expected}, found {found}")]
    BadConfig {
        /// The field.
        field: String,
        /// What is supported.
        expected: String,
        /// What the file says.
        found: String,
    },
    /// A PEFT feature this engine does not apply (never silently ignored).
    #[error("unsupported adapter feature {feature} (key or field {key})")]
    Unsupported {
        /// The feature (DoRA, lora_bias, embedding LoRA, …).
        feature: String,
        /// Where it was found.
        key: String,
    },
    /// A tensor key that names no LoRA weight of a Qwen 3.5 text projection.
    #[error("adapter key {key} matches no module of this model ({why})")]
    UnknownKey {
        /// The key.
        key: String,
        /// What did not match.
        why: String,
    },
    /// A projection that the layer does not have (e.g. `q_proj` on a Gated DeltaNet layer).
    #[error("adapter key {key}: layer {layer} is a {layer_type} layer without {projection}")]
    WrongTarget {
        /// The key.
        key: String,
        /// The layer index.
        layer: usize,
        /// The layer's type.
        layer_type: String,
        /// The projection named.
        projection: String,
    },
    /// A layer index beyond the model.
    #[error("adapter key {key}: layer {layer} is out of range (the model has {layers} layers)")]
    LayerOutOfRange {
        /// The key.
        key: String,
        /// The index.
        layer: usize,
        /// Layers in the model.
        layers: usize,
    },
    /// A module present in the file that the config does not target.
    #[error("adapter key {key} is not targeted by the config ({why})")]
    NotTargeted {
        /// The key.
        key: String,
        /// Which config field excludes it.
        why: String,
    },
    /// A tensor with the wrong shape for this model's widths.
    #[error("adapter tensor {key}: expected shape {expected:?}, found {found:?}")]
    ShapeMismatch {
        /// The key.
        key: String,
        /// Expected shape.
        expected: Vec<usize>,
        /// Found shape.
        found: Vec<usize>,
    },
    /// The rank of a module disagrees with the config (`r` or `rank_pattern`).
    #[error("adapter tensor {key}: rank {found}, but the config gives rank {expected}")]
    RankMismatch {
        /// The key.
        key: String,
        /// Rank from the config.
        expected: usize,
        /// Rank in the tensor.
        found: usize,
    },
    /// `lora_A` without `lora_B` or the reverse.
    #[error("adapter key {key} has no matching {missing}")]
    MissingPair {
        /// The key present.
        key: String,
        /// The key absent.
        missing: String,
    },
    /// A tensor dtype that is not F32, BF16 or F16.
    #[error("adapter tensor {key}: dtype {found} is not supported (expected F32, BF16 or F16)")]
    UnsupportedDtype {
        /// The key.
        key: String,
        /// The dtype.
        found: String,
    },
    /// NaN or infinite weights.
    #[error("adapter tensor {key}: non-finite value {value} at element {index}")]
    NonFinite {
        /// The key.
        key: String,
        /// The element.
        index: usize,
        /// The value.
        value: f32,
    },
    /// The file holds no LoRA weights for this model.
    #[error("{path} holds no LoRA weights")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// No resident adapter has this id.
    #[error("no resident adapter with id {id:?} (resident: {resident:?})")]
    UnknownId {
        /// The id asked for.
        id: String,
        /// The ids resident.
        resident: Vec<String>,
    },
    /// The scale is not a finite number of magnitude at most [`crate::lora::MAX_SCALE`].
    #[error("adapter scale {0} is not a finite number with |scale| <= 1000")]
    BadScale(f32),
    /// A file of the adapter is not a regular file, or larger than the engine reads for its
    /// kind ([`FileError::NotRegular`], [`FileError::TooLarge`]).
    #[error(transparent)]
    File(FileError),
    /// The same (layer, projection) twice: under both the text-class and the VLM-class prefix,
    /// or a factor given twice.
    #[error("adapter key {key} adapts the same module as {other}")]
    DuplicateModule {
        /// The key found second.
        key: String,
        /// The key found first.
        other: String,
    },
    /// A weight too large for the product to stay finite.
    #[error("adapter tensor {key}: |{value}| at element {index} exceeds {limit}")]
    WeightTooLarge {
        /// The key.
        key: String,
        /// The element.
        index: usize,
        /// The value.
        value: f32,
        /// The bound ([`crate::lora::MAX_WEIGHT`]).
        limit: f32,
    },
    /// An adapter id that cannot name an adapter.
    #[error("adapter id {id:?}: {why}")]
    BadId {
        /// The id given.
        id: String,
        /// What is wrong with it.
        why: String,
    },
    /// An adapter set that names one adapter twice.
    #[error("adapter {id:?} appears twice in the adapter set (give each adapter once, with one scale)")]
    DuplicateInSet {
        /// The id given twice.
        id: String,
    },
    /// A call about "the" active adapter while several are active.
    #[error("several adapters are active ({ids:?}): give each its scale with set_adapters")]
    SeveralActive {
        /// The active ids.
        ids: Vec<String>,
    },
    /// More adapters in one set than a set holds.
    #[error("an adapter set holds at most {limit} adapters, found {found}")]
    SetTooLarge {
        /// Adapters given.
        found: usize,
        /// [`crate::lora::MAX_SET`].
        limit: usize,
    },
    /// A per-layer / per-projection factor that cannot apply.
    #[error("layer scales of adapter {adapter}: {field} expected {expected}, found {found}")]
    BadLayerScales {
        /// The adapter (name or id).
        adapter: String,
        /// Which rule.
        field: String,
        /// What is accepted.
        expected: String,
        /// What was given.
        found: String,
    },
    /// An adapter made for another model (or for a model since dropped).
    #[error("adapter {name} was loaded for another model")]
    WrongModel {
        /// The adapter's name.
        name: String,
    },
    /// A GPU error while uploading.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

/// Errors of on-GPU learning. A rejected event batch or option leaves the trainable adapter and
/// its optimiser state unchanged.
#[derive(Debug, thiserror::Error)]
pub enum LearnError {
    /// A module the backward pass cannot reach yet.
    #[error("layers.{layer}.{module} cannot be trained: {why}")]
    NotLearnable {
        /// The layer.
        layer: usize,
        /// The projection path.
        module: String,
        /// Why.
        why: String,
    },
    /// An option or event field is out of range.
    #[error("invalid learning input {name}: expected {expected}, found {found}")]
    BadInput {
        /// The field (`events[2].response`, `lr`, …).
        name: String,
        /// What is allowed.
        expected: String,
        /// What was given.
        found: String,
    },
    /// No trainable adapter was created or imported.
    #[error("no trainable adapter: create or import one first")]
    NoTrainableAdapter,
    /// The step's loss or gradient was infinite or NaN (an adapter scale or learning rate the
    /// model overflows under): the step was not taken, the adapter and the optimiser's state are
    /// unchanged.
    #[error("the learning step's {what} is not finite ({value}): nothing was updated")]
    NonFinite {
        /// `"loss of event N"` or `"gradient norm"`.
        what: String,
        /// The value.
        value: f32,
    },
    /// Writing the exported adapter failed.
    #[error("cannot write {path}: {message}")]
    Export {
        /// The file.
        path: PathBuf,
        /// What failed.
        message: String,
    },
    /// Loading the adapter to continue training failed.
    #[error(transparent)]
    Adapter(#[from] AdapterError),
    /// Running the frozen forward pass failed.
    #[error(transparent)]
    Run(#[from] RunError),
    /// A GPU error.
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

impl From<FileError> for ModelError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::Io { path, source } => ModelError::Io { path, source },
            other => ModelError::File(other),
        }
    }
}

impl From<FileError> for AdapterError {
    fn from(e: FileError) -> Self {
        match e {
            FileError::Io { path, source } => AdapterError::Io { path, source },
            other => AdapterError::File(other),
        }
    }
}
