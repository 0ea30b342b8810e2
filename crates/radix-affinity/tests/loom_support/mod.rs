//! What the loom models of this crate share.

/// `loom::model` with room for the many atomic loads of a tree operation
/// (every node field is an atomic), which exceed loom's default branch
/// bound.
pub(crate) fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.max_branches = 100_000;
    builder.check(f);
}
