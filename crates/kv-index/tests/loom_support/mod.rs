//! What the loom models of this crate share.

/// `loom::model` with a branch bound that fits the index's atomic loads.
pub(crate) fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.max_branches = 100_000;
    builder.check(f);
}
