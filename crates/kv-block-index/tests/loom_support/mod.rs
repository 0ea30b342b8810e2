//! What the loom models of this crate share.

/// `loom::model` with a branch bound that fits the index's atomic loads.
pub(crate) fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.max_branches = 100_000;
    builder.check(f);
}

/// What every lookup result must satisfy, whatever it raced: each reported
/// holder holds at least the first block and at most the whole request.
pub(crate) fn well_formed(found: &kv_block_index::PrefixMatches) {
    let n = found.request_blocks();
    for m in found.matches() {
        assert!((1..=n).contains(&m.blocks), "{m:?} of {n} blocks");
    }
}
