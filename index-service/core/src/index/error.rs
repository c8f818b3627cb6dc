//! What can go wrong in the index: caller errors ([`IndexError`]), blocks the index declines to
//! store or remove ([`RejectReason`], counted, never an error), and why a replica's events are
//! distrusted ([`FlagReason`]).

use super::ReplicaId;

/// A call the index cannot serve: the caller named something it does not know, or registration
/// would break an invariant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// No pool is registered under this model name.
    #[error("unknown pool (model) {pool:?}")]
    UnknownPool {
        /// The requested model name.
        pool: String,
    },
    /// No replica is registered under this id.
    #[error("unknown replica {replica}")]
    UnknownReplica {
        /// The requested replica.
        replica: ReplicaId,
    },
    /// A pool with this model name is already registered.
    #[error("pool {pool:?} is already registered")]
    DuplicatePool {
        /// The model name.
        pool: String,
    },
    /// A replica with this id is already registered.
    #[error("replica {replica} is already registered")]
    DuplicateReplica {
        /// The replica id.
        replica: ReplicaId,
    },
    /// A pool cannot hold more replicas (slot ids are 16-bit).
    #[error("pool {pool:?} is full ({max} replicas)")]
    PoolFull {
        /// The model name.
        pool: String,
        /// The maximum number of replicas per pool.
        max: usize,
    },
    /// A pool was configured with a block size of 0.
    #[error("pool {pool:?} has block_size 0")]
    ZeroBlockSize {
        /// The model name.
        pool: String,
    },
}

impl IndexError {
    /// Metric label value.
    pub fn as_label(&self) -> &'static str {
        match self {
            IndexError::UnknownPool { .. } => "unknown_pool",
            IndexError::UnknownReplica { .. } => "unknown_replica",
            IndexError::DuplicatePool { .. } => "duplicate_pool",
            IndexError::DuplicateReplica { .. } => "duplicate_replica",
            IndexError::PoolFull { .. } => "pool_full",
            IndexError::ZeroBlockSize { .. } => "zero_block_size",
        }
    }
}

/// Why blocks of an event were not applied. Counted per block in
/// `index_blocks_rejected_total{reason}`; the rest of the event still applies where it can.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RejectReason {
    /// Connector placeholder (`block_size` 0 or no `token_ids`): carries nothing to index.
    Placeholder,
    /// A KV-cache group whose hit rule the index does not model (Mamba state, an unknown kind,
    /// chunked local attention), or whose layout it cannot use; the replica is flagged.
    UnmodelledGroup,
    /// A store that describes its group otherwise than the group's earlier stores (another kind,
    /// block size or window), or names a group beyond the index's limit.
    GroupConflict,
    /// The event's `block_size` differs from the pool's: its keys cannot match prompt keys.
    BlockSizeMismatch,
    /// Inconsistent event (`token_ids` or `extra_keys` length does not fit `block_hashes`).
    Malformed,
    /// Token-chain pool: the parent's engine hash is not known for this replica, so the run's
    /// keys cannot be chained (storing it as a new root would invent wrong keys).
    ParentUnknown,
    /// Token-chain pool: the block carries extra keys a token chain cannot represent
    /// (multimodal inputs, prompt embeds); keying its placeholder tokens would match other inputs.
    UnsupportedExtraKeys,
    /// The replica already holds its configured maximum number of blocks.
    ReplicaCapacity,
    /// `BlockRemoved` for a block this replica is not known to hold.
    UnknownBlock,
    /// `verify_hashes: required`: the run's hashes cannot be recomputed (it continues a chain
    /// whose parent digest is not published, or carries LoRA or extra keys whose hashed form
    /// the index cannot reproduce, or a mismatch a hidden `cache_salt` may explain).
    Unverifiable,
    /// `verify_hashes: required`: a published hash disagrees with the hash of its `token_ids`.
    HashMismatch,
}

impl RejectReason {
    /// Every reason, for pre-registering metric series.
    pub const ALL: [RejectReason; 11] = [
        RejectReason::Placeholder,
        RejectReason::UnmodelledGroup,
        RejectReason::GroupConflict,
        RejectReason::BlockSizeMismatch,
        RejectReason::Malformed,
        RejectReason::ParentUnknown,
        RejectReason::UnsupportedExtraKeys,
        RejectReason::ReplicaCapacity,
        RejectReason::UnknownBlock,
        RejectReason::Unverifiable,
        RejectReason::HashMismatch,
    ];

    /// Metric label value.
    pub fn as_label(self) -> &'static str {
        match self {
            RejectReason::Placeholder => "placeholder",
            RejectReason::UnmodelledGroup => "unmodelled_group",
            RejectReason::GroupConflict => "group_conflict",
            RejectReason::BlockSizeMismatch => "block_size_mismatch",
            RejectReason::Malformed => "malformed",
            RejectReason::ParentUnknown => "parent_unknown",
            RejectReason::UnsupportedExtraKeys => "unsupported_extra_keys",
            RejectReason::ReplicaCapacity => "replica_capacity",
            RejectReason::UnknownBlock => "unknown_block",
            RejectReason::Unverifiable => "unverifiable",
            RejectReason::HashMismatch => "hash_mismatch",
        }
    }
}

/// Why a replica's index entries are not trusted for precise routing. A flagged replica keeps
/// receiving events but is reported with `precise = false` and no matched blocks until
/// [`reset_replica`](super::KvIndex::reset_replica) or [`clear_flag`](super::BlockIndex::clear_flag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FlagReason {
    /// A published block hash disagrees with the hash recomputed from the event's own
    /// `token_ids` (wrong seed, algorithm or extra keys configured for the pool).
    HashMismatch,
    /// Set by ingest: the event stream has an unrepaired gap; waiting for a reset/snapshot.
    Resyncing,
    /// Set by ingest: no events for too long; the index may not reflect the engine.
    Stale,
    /// The replica's events carry another `block_size` than the pool's: none of its blocks can
    /// be indexed (the pool or the engine is misconfigured).
    BlockSizeMismatch,
    /// The replica's messages cannot be decoded, several in a row (an encoding or schema this
    /// index does not know): its stream is unusable until a message decodes again.
    UnknownEncoding,
    /// The replica's model has a KV-cache group whose hit rule the index does not model (see
    /// [`RejectReason::UnmodelledGroup`]): its matches count its modelled groups only, so they
    /// are approximate, never precise (the only flag whose matches carry counts).
    UnmodelledCacheGroup,
}

impl FlagReason {
    /// Every reason, for pre-registering metric series.
    pub const ALL: [FlagReason; 6] = [
        FlagReason::HashMismatch,
        FlagReason::Resyncing,
        FlagReason::Stale,
        FlagReason::BlockSizeMismatch,
        FlagReason::UnknownEncoding,
        FlagReason::UnmodelledCacheGroup,
    ];

    /// Metric label value (also the admin API's `problem` text).
    pub fn as_label(self) -> &'static str {
        match self {
            FlagReason::HashMismatch => "hash_mismatch",
            FlagReason::Resyncing => "resyncing",
            FlagReason::Stale => "stale",
            FlagReason::BlockSizeMismatch => "block_size_mismatch",
            FlagReason::UnknownEncoding => "unknown_encoding",
            FlagReason::UnmodelledCacheGroup => "unmodelled_cache_group",
        }
    }
}
